"""Peak memory of serving a GGUF file as published: load it with ``--quantization gguf``, generate, and
compare the process's peak RSS with the file's size and the KV cache's.

    python -m specfleet.bench.gguf_memory --gguf model.Q4_K_M.gguf [--quantization gguf] [--runs 3]

Files to measure: the bundled model requantized by llama.cpp (``bench/anchors/llama_server.sh quantize``
with the bundled Q4_1 file, Q4_K_M and ``--allow-requantize``), and a larger one in the same family made by
``python -m specfleet.bench.gguf_random_llama --out FILE`` (a random-weight 0.8B Llama, converted and
quantized by llama.cpp's own tools), on which the runtime's fixed share is small.

Each measurement is a fresh child process that reads its resident memory (``/proc/self/statm``, after
returning the C heap's free pages: what stays) and its peak (``ru_maxrss``) at four points: after importing
torch, transformers, tokenizers and the engine and building the kernels (``runtime``: what no model
changes), after loading the model's tokenizer (``tokenizer``: the Rust BPE tables, handed to the engine so
it is loaded once), after loading the model (``load_peak``), and after generating (``peak``). A first child
makes the cache's metadata folder (config, tokenizer: transformers parses the GGUF's metadata once) and is
not counted; then ``--runs`` children, reported by their median.

Three ratios to the file's size, each net of the KV cache:
  ratio                (peak - KV) / file: the whole process; the issue's bound (at most 1.3) is on this one
  ratio_above_runtime  (peak - runtime - KV) / file: the model and its tokenizer
  ratio_model          (peak - runtime - tokenizer - KV) / file: the weights as loaded and served, with the
                       step's activations and logits
and the weights alone: ratio_packed_weights, the bytes of every packed linear's tensors (codes, high-bit
planes, scales and mins or their two levels, biases; the head included) over the file's.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from specfleet.engine.python_child import python_command

CHILD = r"""
import gc, json, resource, sys
import torch
from specfleet.engine import LLM, SamplingParams, loader
from specfleet.engine.heap import release_free_memory
from specfleet.engine.checkpoint import load_tokenizer
from specfleet.engine.quant.gguf_source import resolve_gguf
from specfleet.kernels import cpu_native

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()

cpu_native.available()  # build or load the kernels before the baseline
import transformers, tokenizers  # the tokenizer's libraries: runtime too, whatever the model
import transformers.tokenization_utils_tokenizers
args = json.loads(sys.argv[1])
source = "file://" + args["gguf"]
resolved = resolve_gguf(source).path
release_free_memory()
runtime, runtime_peak = rss(), peak()
tokenizer = load_tokenizer(resolved)  # returns the heap it freed (engine/heap.py)
with_tokenizer = rss()
loader.load_tokenizer = lambda path: tokenizer  # the engine's own load: the same tokenizer, not a second
llm = LLM(model=source, quantization=args["quantization"], kv_cache_gib=args["kv_cache_gib"],
          max_model_len=args["max_model_len"])
loaded, load_peak = rss(), peak()
out = llm.generate(["The capital of France is"] * args["requests"],
                   SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True))
kv = sum(k.nbytes + v.nbytes for k, v in llm.engine.runner.kv_caches)
linears = [o for o in gc.get_objects() if isinstance(o, (cpu_native.QuantLinear, cpu_native.PackedLinear))]
def parts(o):  # a linear's tensors, with a K-quant's two-level scale panels (cpu_quant.TwoLevelPanels)
    for t in vars(o).values():
        if isinstance(t, torch.Tensor):
            yield t
        elif hasattr(t, "tensors"):
            yield from t.tensors()
tensors = {t.data_ptr(): t.nbytes for o in linears for t in parts(o)}
print(json.dumps({"runtime_rss_bytes": runtime, "runtime_peak_rss_bytes": runtime_peak,
                  "tokenizer_rss_bytes": with_tokenizer - runtime, "after_load_rss_bytes": loaded,
                  "load_peak_rss_bytes": load_peak, "peak_rss_bytes": peak(), "kv_cache_bytes": kv,
                  "packed_weight_bytes": sum(tensors.values()),
                  "tokens": sum(len(r.outputs[0].token_ids) for r in out)}))
"""


def measure(args: argparse.Namespace) -> dict:
    """One child: load, generate, exit; its own report."""
    params = {
        "gguf": str(Path(args.gguf).resolve()),
        "quantization": args.quantization,
        "kv_cache_gib": args.kv_cache_gib,
        "max_model_len": args.max_model_len,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
    }
    proc = subprocess.run(
        python_command("-c", CHILD, json.dumps(params)),
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="the GGUF file (e.g. a Q4_K_M from llama-quantize)")
    p.add_argument("--quantization", default="gguf", help="gguf (the file's blocks), or none for float32")
    p.add_argument("--kv-cache-gib", type=float, default=0.05)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3, help="measured children (median reported)")
    args = p.parse_args(argv)
    if args.quantization == "none":
        args.quantization = None
    file_bytes = Path(args.gguf).stat().st_size
    measure(args)  # cold: makes the metadata folder
    runs = [measure(args) for _ in range(args.runs)]

    def median(key: str) -> int:
        return int(statistics.median(r[key] for r in runs))

    peak, kv = median("peak_rss_bytes"), median("kv_cache_bytes")
    runtime, tokenizer = median("runtime_rss_bytes"), median("tokenizer_rss_bytes")
    result = {
        "gguf": str(args.gguf),
        "quantization": args.quantization,
        "runs": args.runs,
        "file_bytes": file_bytes,
        "kv_cache_bytes": kv,
        "runtime_rss_bytes": runtime,
        "tokenizer_rss_bytes": tokenizer,
        "runtime_peak_rss_bytes": median("runtime_peak_rss_bytes"),
        "after_load_rss_bytes": median("after_load_rss_bytes"),
        "load_peak_rss_bytes": median("load_peak_rss_bytes"),
        "peak_rss_bytes": peak,
        "peak_rss_bytes_each": [r["peak_rss_bytes"] for r in runs],
        "ratio": round((peak - kv) / file_bytes, 3),
        "ratio_above_runtime": round((peak - runtime - kv) / file_bytes, 3),
        "ratio_model": round((peak - runtime - tokenizer - kv) / file_bytes, 3),
        "packed_weight_bytes": median("packed_weight_bytes"),
        "ratio_packed_weights": round(median("packed_weight_bytes") / file_bytes, 3),
        "tokens": runs[-1]["tokens"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
