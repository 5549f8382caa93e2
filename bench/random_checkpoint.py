"""A random-weight checkpoint of one architecture, the same shapes for every one, to compare their speed:

    python -m specfleet.bench.random_checkpoint --arch qwen3 --hidden 512 --layers 8 --out /tmp/rc/qwen3
    specfleet bench offline --model file:///tmp/rc/qwen3 --skip-hf

Every architecture gets the same hidden size, layers, MLP width (3x hidden), heads (hidden / 64 of 64, half
as many KV heads), the bundled SmolLM2 tokenizer and its vocabulary of 49152, tied embeddings: a Llama, a
Qwen3 (plus its q/k norms, 2 x 64 values a layer) and a Phi-3 (the same tensors, fused) of one parameter
count; Gemma 2 and 3 with their extra norms, GeGLU and a sliding window of GEMMA_WINDOW on their
sliding layers. Weights are transformers' own initialization from a fixed seed, in float32.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# --arch -> (transformers config class, architecture name)
ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
# --arch mixtral: Mixtral's 8 experts, 2 active per token; a dense model of the same active parameters is
# `--arch llama --intermediate` 2 x the expert width
MOE_EXPERTS, MOE_TOP_K = 8, 2
# Gemma's sliding layers attend over this many tokens (the checkpoints ship 4096 and 1024, past the
# contexts these benchmarks reach; a quarter of the 2048 positions makes the window count)
GEMMA_WINDOW = 512
HEAD_DIM = 64  # the head size of SmolLM2, Llama 3.2 1B and Qwen3's smaller models is 64 or 128


def config_for(arch: str, hidden: int, layers: int, vocab: int, intermediate: int | None = None):
    import transformers

    if hidden % (2 * HEAD_DIM):
        raise SystemExit(f"--hidden={hidden} must be a multiple of {2 * HEAD_DIM} (heads of {HEAD_DIM})")
    config_class, architecture = ARCHES[arch]
    heads = hidden // HEAD_DIM
    return getattr(transformers, config_class)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        sliding_window=GEMMA_WINDOW if arch.startswith("gemma") else None,
        architectures=[architecture],
        **({"query_pre_attn_scalar": HEAD_DIM} if arch.startswith("gemma") else {}),
        **({"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K} if arch == "mixtral" else {}),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specfleet.bench.random_checkpoint", description=__doc__)
    parser.add_argument("--arch", choices=sorted(ARCHES), required=True)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, help="MLP (or each expert's) width; default 3 x hidden")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    params = write_checkpoint(args.arch, args.hidden, args.layers, args.out, args.intermediate, args.seed)
    print(f"{args.arch}: {params / 1e6:.2f}M parameters -> {args.out}")
    sys.stdout.flush()
    return 0


def write_checkpoint(
    arch: str, hidden: int, layers: int, out: Path, intermediate: int | None = None, seed: int = 0
) -> int:
    """Writes the checkpoint (weights, config, the bundled tokenizer) to `out`; returns its parameter count."""
    import torch
    from specfleet.engine.model_source import resolve_model
    from transformers import AutoModelForCausalLM

    tokenizer = resolve_model("bundled://smollm2-135m-instruct").path
    config = config_for(arch, hidden, layers, vocab=49152, intermediate=intermediate)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    raise SystemExit(main())
