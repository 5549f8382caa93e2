"""Random LoRA adapters in PEFT's file format for `specfleet bench lora`, written without loading the base
into transformers (the engine's ModelShape gives every projection's size), and the process's resident
memory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from specfleet.engine.lora.adapter import CONFIG_FILE, TARGETS, WEIGHTS_FILE, ModelShape

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def write_adapter(folder: Path, shape: ModelShape, rank: int, modules: list[str], seed: int) -> Path:
    """A rank-`rank` adapter on `modules` of every layer: A ~ N(0, 1 / in), B ~ N(0, 0.01^2), alpha = 2r
    (B nonzero, unlike PEFT's init, so it changes the output as a trained adapter would)."""
    from safetensors.torch import save_file

    unknown = [m for m in modules if m not in TARGETS]
    if unknown:
        raise ValueError(f"target modules {unknown} unknown (LoRA targets: {', '.join(TARGETS)})")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module in modules:
            fused, index = TARGETS[module]
            fan_in, fan_out = shape.pieces(fused)[index]
            part = "self_attn" if module in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return folder


def resident_bytes() -> int:
    """This process's resident set size (/proc/self/statm's second field, in pages)."""
    import os

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")
