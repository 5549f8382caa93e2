"""Peak memory of serving a GGUF file as published: load it with ``--quantization gguf``, generate, and
compare the process's peak RSS with the file's size and the KV cache's.

    python -m specfleet.bench.gguf_memory --gguf model.Q4_K_M.gguf [--quantization gguf] [--kv-cache-gib 0.05]

Each measurement is a fresh child process (its peak RSS is the kernel's ``ru_maxrss`` for it, read by the
parent after it exits, so nothing the parent holds counts). A first child makes the cache's metadata folder
(config, tokenizer: transformers parses the GGUF's metadata once) and is reported as ``cold``; the second is
the start every later engine makes. ``runtime_rss_bytes`` is the child's peak after importing torch and the
engine, before it reads the model: Python, torch, transformers (the tokenizer) and the kernels' libraries,
which no file size changes.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys
import torch
from specfleet.engine import LLM, SamplingParams
from specfleet.kernels import cpu_native

cpu_native.available()  # build or load the kernels before the baseline
import transformers, tokenizers  # the tokenizer's libraries: runtime too, whatever the model
runtime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
args = json.loads(sys.argv[1])
llm = LLM(model="file://" + args["gguf"], quantization=args["quantization"], kv_cache_gib=args["kv_cache_gib"],
          max_model_len=args["max_model_len"])
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = llm.generate(["The capital of France is"] * args["requests"],
                   SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True))
kv = sum(k.nbytes + v.nbytes for k, v in llm.engine.runner.kv_caches)
print(json.dumps({"runtime_rss_bytes": runtime, "after_load_rss_bytes": loaded, "kv_cache_bytes": kv,
                  "tokens": sum(len(r.outputs[0].token_ids) for r in out)}))
"""


def measure(args: argparse.Namespace) -> dict:
    """One child: load, generate, exit; its own report plus the peak RSS the kernel kept for it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    params = {
        "gguf": str(Path(args.gguf).resolve()),
        "quantization": args.quantization,
        "kv_cache_gib": args.kv_cache_gib,
        "max_model_len": args.max_model_len,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(params)],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    # RUSAGE_CHILDREN is the largest child so far: a second child that peaks lower reads as the first's
    report["peak_rss_bytes"] = peak if peak > before * 1024 else None
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="the GGUF file (e.g. a Q4_K_M from llama-quantize)")
    p.add_argument("--quantization", default="gguf", help="gguf (the file's blocks), or none for float32")
    p.add_argument("--kv-cache-gib", type=float, default=0.05)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    if args.quantization == "none":
        args.quantization = None
    file_bytes = Path(args.gguf).stat().st_size
    cold = measure(args)
    warm = measure(args)
    peak = warm["peak_rss_bytes"] or cold["peak_rss_bytes"]
    kv = warm["kv_cache_bytes"]
    result = {
        "gguf": str(args.gguf),
        "quantization": args.quantization,
        "file_bytes": file_bytes,
        "kv_cache_bytes": kv,
        "peak_rss_bytes": peak,
        "peak_rss_note": None if warm["peak_rss_bytes"] else "warm child peaked below the cold one: cold's",
        "cold_peak_rss_bytes": cold["peak_rss_bytes"],
        "runtime_rss_bytes": warm["runtime_rss_bytes"],
        "after_load_rss_bytes": warm["after_load_rss_bytes"],
        # the bound: peak <= 1.3 x file + KV cache
        "ratio": round((peak - kv) / file_bytes, 3),
        # the same without Python, torch and the kernels, which a 100 MB model cannot amortize
        "ratio_above_runtime": round((peak - warm["runtime_rss_bytes"] - kv) / file_bytes, 3),
        "tokens": warm["tokens"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
