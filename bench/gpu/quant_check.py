"""The 4-bit dequantize-matmul (kernels/quant_matmul.py) on the device: correctness against the documented
unpacking then a float matmul, and its speed against a bf16 matmul of the same weight.

Decode (M = 1) is a weight stream: the figure of merit is the weight bytes read per second, as a fraction
of the device's measured copy bandwidth, and the time against torch's bf16 GEMV (4x the bytes).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from specfleet.bench.gpu.quant_packers import pack_awq, pack_gptq
from specfleet.engine.quant.awq_gptq import awq_weight, gptq_weight
from specfleet.kernels.quant_matmul import TritonQuantLinear


def seconds_per_call(fn: Callable[[], object], iters: int) -> float:
    """Mean wall time of `fn` over `iters` calls after one warm-up, the device synchronised around them."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def run(device: torch.device, dry_run: bool, copy_gbs: float | None) -> dict:
    dtype = torch.float32 if dry_run else torch.bfloat16
    out: dict = {"cases": 0, "passed": 0, "failures": []}
    shapes = [(72, 128, 64)] if dry_run else [(72, 128, 64), (4096 + 64, 4096, 128), (11008, 4096, 128)]
    for n, k, group in shapes:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
        for method in ("awq", "gptq-act-order"):
            tensors, reference = (
                pack_awq(w, group) if method == "awq" else pack_gptq(w, group, act_order=True)
            )
            q = (
                awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], {"group_size": group})
                if method == "awq"
                else gptq_weight(
                    tensors["qweight"],
                    tensors["qzeros"],
                    tensors["scales"],
                    tensors["g_idx"],
                    {"group_size": group},
                )
            )
            layer = TritonQuantLinear(q, None, device, dtype)
            for m in (1, 7, 33):
                out["cases"] += 1
                x = torch.randn(m, k, device=device).to(dtype)
                expected = x.float() @ reference.to(device).t()
                try:
                    tol = 1e-3 if dtype == torch.float32 else 3e-2
                    torch.testing.assert_close(
                        layer(x).float(), expected, rtol=tol, atol=tol * max(1.0, k**0.5)
                    )
                    out["passed"] += 1
                except AssertionError as e:
                    out["failures"].append(f"{method} n={n} k={k} m={m}: {str(e).splitlines()[-1]}")
    if not dry_run:
        n, k, group = 11008, 4096, 128
        tensors, _ = pack_awq(torch.randn(n, k), group)
        q = awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], {"group_size": group})
        layer = TritonQuantLinear(q, None, device, dtype)
        dense = q.dequantize().to(device=device, dtype=dtype).t().contiguous()
        bytes_q4 = n * k // 2 + 2 * (k // group) * n * 2
        for m in (1, 16):
            x = torch.randn(m, k, device=device, dtype=dtype)
            t_q4, t_bf16 = (
                seconds_per_call(functools.partial(layer, x), 100),
                seconds_per_call(functools.partial(torch.matmul, x, dense), 100),
            )
            row = {
                "q4_us": round(t_q4 * 1e6, 1),
                "bf16_us": round(t_bf16 * 1e6, 1),
                "speedup_vs_bf16": round(t_bf16 / t_q4, 2),
                "q4_weight_gbs": round(bytes_q4 / t_q4 / 1e9, 1),
            }
            if copy_gbs:
                row["q4_bw_fraction"] = round(bytes_q4 / t_q4 / 1e9 / copy_gbs, 3)
            out[f"m{m}_n{n}_k{k}"] = row
    return out
