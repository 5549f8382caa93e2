"""Make draft models from a target: an early-exit copy of its first L layers (shares everything else).

Early exit from SmolLM2-135M agrees with the full model on few greedy tokens, so it is a poor draft as is;
it is the starting point `distill` trains, and a cheap draft that is exact to verify against in tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from specfleet.engine.checkpoint import load_state_dict
from specfleet.engine.model_source import resolve_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def truncate_layers(source: str, num_layers: int, out_dir: str | Path) -> Path:
    """Write an HF folder holding the target's first `num_layers` layers, embeddings, norm and head."""
    src = resolve_model(source).path
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers} must be between 1 and the target's {total} layers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor
        for name, tensor in load_state_dict(src).items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out
