"""bench/random_checkpoint.py: one parameter count for every architecture, so their speeds compare."""

from __future__ import annotations

import json

import pytest
from specfleet.bench.random_checkpoint import config_for, main


def test_architectures_get_the_same_shapes_and_bad_sizes_are_refused():
    import torch
    from transformers import AutoModelForCausalLM

    counts = {}
    for arch in ("llama", "qwen3", "phi3"):
        config = config_for(arch, hidden=128, layers=2, vocab=49152)  # Phi3Config pads with id 32000
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        counts[arch] = sum(p.numel() for p in model.parameters())
    assert counts["phi3"] == counts["llama"]  # the same tensors, fused
    assert counts["qwen3"] - counts["llama"] == 2 * 2 * 64  # q_norm and k_norm, [head_dim] each, per layer
    with pytest.raises(SystemExit, match="--hidden=200 must be a multiple of 128"):
        config_for("llama", hidden=200, layers=2, vocab=1000)


@pytest.mark.slow
def test_the_written_checkpoint_loads_in_the_engine(tmp_path, capsys):
    from specfleet.engine import LLM, SamplingParams

    out = tmp_path / "qwen3"
    main(["--arch", "qwen3", "--hidden", "128", "--layers", "1", "--out", str(out)])
    assert "qwen3:" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    llm = LLM(model=f"file://{out}", block_size=4)
    assert (
        len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids)
        == 3
    )
