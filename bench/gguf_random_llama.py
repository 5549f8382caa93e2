"""A Q4_K_M file larger than the bundled model, for `bench.gguf_memory`: a random-weight Llama in SmolLM2's
family (its tokenizer, vocabulary, rope and norm settings; larger hidden sizes), written as a Hugging Face
checkpoint, converted with llama.cpp's own convert_hf_to_gguf.py and quantized with its llama-quantize (the
anchor build, bench/anchors/llama_server.sh), exactly as a published GGUF is made.

    python -m specfleet.bench.gguf_random_llama --out /tmp/q4km/random-llama-0.8b.Q4_K_M.gguf
    python -m specfleet.bench.gguf_memory --gguf /tmp/q4km/random-llama-0.8b.Q4_K_M.gguf

The defaults (hidden 2048, 16 layers, MLP 5632, 32 query and 8 KV heads of 64, tied embeddings: 0.82B
parameters) keep every row a multiple of 256, so llama-quantize uses its K types throughout as it does on
published models of that size, and the intermediate files (bf16 checkpoint and bf16 GGUF, 1.6 GB each) are
deleted when the Q4_K_M file is written. The weights are N(0, 0.02) (transformers' initializer_range) from a
fixed seed: memory does not depend on their values, only on the tensors' shapes and types.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specfleet.bench.llama_convert import converter_env

REPO = Path(__file__).resolve().parents[1]
ANCHOR = REPO / "bench" / "anchors" / "llama_server.sh"
log = logging.getLogger("specfleet.bench.gguf_random_llama")


def _step(message: str) -> float:
    log.info(message)
    return time.monotonic()


def smollm2_metadata() -> Path:
    """The bundled SmolLM2's metadata folder (config and tokenizer, no weights), made once in the cache."""
    from specfleet.engine.quant.gguf_source import resolve_gguf

    resolved = resolve_gguf("bundled://smollm2-135m-instruct")
    assert resolved is not None  # the bundled model is a GGUF file
    return resolved.path


def write_checkpoint(folder: Path, args: argparse.Namespace) -> int:
    """A random-weight LlamaForCausalLM in bf16 safetensors with SmolLM2's tokenizer; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    meta = smollm2_metadata()
    base = json.loads((meta / "config.json").read_text())
    for flag, value in (("--hidden-size", args.hidden_size), ("--intermediate-size", args.intermediate_size)):
        if value % 256:  # llama-quantize falls back from K types on rows that are not whole 256-blocks
            raise SystemExit(f"{flag}={value} must be a multiple of 256")
    if args.hidden_size % args.num_attention_heads or args.num_attention_heads % args.num_key_value_heads:
        raise SystemExit(
            f"--heads={args.num_attention_heads} must divide --hidden-size={args.hidden_size} and be a "
            f"multiple of --kv-heads={args.num_key_value_heads}"
        )
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.hidden_size // args.num_attention_heads,
        max_position_embeddings=base["max_position_embeddings"],
        rms_norm_eps=base["rms_norm_eps"],
        rope_parameters=base["rope_parameters"],
        tie_word_embeddings=True,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base.get("pad_token_id"),
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    torch.nn.Module.to(model, torch.bfloat16)  # in place; transformers types its own `to` for devices
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (meta / name).is_file():
            shutil.copy(meta / name, folder / name)
    return params


def llama_cpp_source() -> Path:
    """The anchor's llama.cpp tree (llama_server.sh's pinned source), where convert_hf_to_gguf.py lives."""
    tree = subprocess.run(["bash", str(ANCHOR), "source"], check=True, capture_output=True, text=True)
    return Path(tree.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the Q4_K_M file to write")
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type (default Q4_K_M)")
    p.add_argument("--hidden-size", dest="hidden_size", type=int, default=2048)
    p.add_argument("--intermediate-size", dest="intermediate_size", type=int, default=5632)
    p.add_argument("--layers", dest="num_hidden_layers", type=int, default=16)
    p.add_argument("--heads", dest="num_attention_heads", type=int, default=32)
    p.add_argument("--kv-heads", dest="num_key_value_heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="convert this Hugging Face folder instead of writing one (kept)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="for the intermediates (default: beside --out)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".random-llama-", dir=args.workdir or args.out.parent))
    try:
        hf, bf16 = args.checkpoint or work / "hf", work / "model.bf16.gguf"
        t = _step(f"event=checkpoint folder={hf}")
        if args.checkpoint is None:
            params = write_checkpoint(hf, args)
            t = _step(f"event=convert params={params} checkpoint_s={time.monotonic() - t:.0f}")
        src = llama_cpp_source()
        env = converter_env(src)
        subprocess.run(
            [
                sys.executable,
                str(src / "convert_hf_to_gguf.py"),
                str(hf),
                "--outtype",
                "bf16",
                "--outfile",
                str(bf16),
            ],
            check=True,
            env=env,
        )
        if args.checkpoint is None:
            shutil.rmtree(hf)
        t = _step(f"event=quantize type={args.type} convert_s={time.monotonic() - t:.0f}")
        subprocess.run(["bash", str(ANCHOR), "quantize", str(bf16), str(args.out), args.type], check=True)
        _step(
            f"event=done out={args.out} bytes={args.out.stat().st_size} quantize_s={time.monotonic() - t:.0f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
