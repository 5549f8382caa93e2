"""Per-op benchmark: achieved bandwidth of each Triton kernel against the device's measured copy bandwidth.

    python -m specfleet.bench.kernels_bench                 # CUDA, real sizes (Llama-3-8B attention layout)
    python -m specfleet.bench.kernels_bench --dry-run       # CPU, interpreter, tiny sizes: checks it runs

Bytes counted are the unavoidable traffic: what the op must read and write once (the K/V context for
attention, the new rows for the KV write). The ratio to the copy bandwidth is the number to compare;
absolute CPU-interpreter figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from specfleet.kernels.kv_cache import reshape_and_cache
from specfleet.kernels.paged_decode import paged_decode_attention
from specfleet.kernels.paged_prefill import paged_prefill_attention


@dataclass
class Shape:
    batch: int = 64
    context: int = 2048
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    prefill_len: int = 2048
    dtype: torch.dtype = torch.bfloat16


DRY_SHAPE = Shape(
    batch=2,
    context=40,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    prefill_len=33,
    dtype=torch.float32,
)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call (CUDA events on GPU, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy: (read + write) bytes per second, in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=iters)
    return 2 * nbytes / ms / 1e6


def _paged_inputs(shape: Shape, query_len: int, context: int, device: torch.device):
    """Caches, shuffled block tables and metadata for ``batch`` sequences of ``context`` tokens."""
    s = shape
    blocks_per_seq = -(-context // s.block_size)
    num_blocks = s.batch * blocks_per_seq
    cache_shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache = torch.randn(cache_shape, dtype=s.dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=s.dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(s.batch, blocks_per_seq)
    starts = torch.arange(0, (s.batch + 1) * query_len, query_len, dtype=torch.int32, device=device)
    seq_lens = torch.full((s.batch,), context, dtype=torch.int32, device=device)
    query = torch.randn((s.batch * query_len, s.num_heads, s.head_dim), dtype=s.dtype, device=device)
    return query, k_cache, v_cache, tables, starts, seq_lens


def bench_decode(shape: Shape, device: torch.device, query_len: int = 1, iters: int = 20) -> dict:
    query, k_cache, v_cache, tables, starts, seq_lens = _paged_inputs(shape, query_len, shape.context, device)
    out = torch.empty_like(query)
    scale = shape.head_dim**-0.5

    def run() -> None:
        paged_decode_attention(
            query, k_cache, v_cache, tables, starts, seq_lens, scale, query_len, shape.context, out=out
        )

    ms = time_ms(run, device, iters=iters)
    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * k_cache.element_size()
    io_bytes = 2 * query.numel() * query.element_size()
    return {
        "op": f"paged_decode(q={query_len})",
        "ms": ms,
        "bytes": kv_bytes + io_bytes,
        "gbs": (kv_bytes + io_bytes) / ms / 1e6,
    }


def bench_prefill(shape: Shape, device: torch.device, iters: int = 10) -> dict:
    batch = max(1, shape.batch // 16)
    s = Shape(**{**asdict(shape), "batch": batch})
    n = shape.prefill_len
    query, k_cache, v_cache, tables, starts, seq_lens = _paged_inputs(s, n, n, device)
    out = torch.empty_like(query)
    scale = shape.head_dim**-0.5

    def run() -> None:
        paged_prefill_attention(query, k_cache, v_cache, tables, starts, seq_lens, scale, n, out=out)

    ms = time_ms(run, device, iters=iters)
    flops = 4 * batch * shape.num_heads * shape.head_dim * n * n / 2  # causal: half the square
    return {"op": f"paged_prefill(len={n}, batch={batch})", "ms": ms, "tflops": flops / ms / 1e9}


def bench_kv_write(shape: Shape, device: torch.device, iters: int = 20) -> dict:
    num_tokens = shape.batch * 16
    num_blocks = -(-num_tokens // shape.block_size) * 2
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.zeros(cache_shape, dtype=shape.dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn((num_tokens, shape.num_kv_heads, shape.head_dim), dtype=shape.dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * shape.block_size, device=device)[:num_tokens]
    ms = time_ms(lambda: reshape_and_cache(key, value, k_cache, v_cache, slots), device, iters=iters)
    nbytes = 4 * key.numel() * key.element_size() + slots.numel() * 8  # read k, v; write k, v
    return {
        "op": f"reshape_and_cache({num_tokens} tokens)",
        "ms": ms,
        "bytes": nbytes,
        "gbs": nbytes / ms / 1e6,
    }


def run_all(device: torch.device, dry_run: bool) -> dict:
    shape = DRY_SHAPE if dry_run else Shape()
    iters = 2 if dry_run else 20
    copy = copy_bandwidth_gbs(device, nbytes=1 << 20 if dry_run else 2 << 30, iters=iters)
    results = [
        bench_kv_write(shape, device, iters),
        bench_decode(shape, device, 1, iters),
        bench_decode(shape, device, 5, iters),
        bench_prefill(shape, device, max(1, iters // 2)),
    ]
    for r in results:
        if "gbs" in r:
            r["fraction_of_copy_bw"] = r["gbs"] / copy
    return {
        "device": str(device),
        "dry_run": dry_run,
        "copy_gbs": copy,
        "shape": {**asdict(shape), "dtype": str(shape.dtype)},
        "ops": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny sizes")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    report = run_all(device, args.dry_run or device.type == "cpu")
    print(f"device={report['device']} copy_bandwidth={report['copy_gbs']:.1f} GB/s")
    for r in report["ops"]:
        extra = (
            f"{r['gbs']:.1f} GB/s ({r['fraction_of_copy_bw']:.2f} of copy)"
            if "gbs" in r
            else f"{r['tflops']:.2f} TFLOP/s"
        )
        print(f"  {r['op']:<36} {r['ms']:9.3f} ms  {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
