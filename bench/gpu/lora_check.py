"""The Triton LoRA shrink/expand kernels (kernels/lora_shrink_expand.py) on the device: correctness against the
torch reference (kernels/lora_reference.py) on mixed batches, and the time of one shrink + expand against
the plain-torch gather-bmm baseline (each token's A and B gathered, then two batched matmuls).

The timed shape is issue 38's: T=256 tokens over 8 adapters (a quarter of the tokens on the base model),
H=4096 in and out, rank 16, in bf16. The dry run checks a tiny shape in float32 through the interpreter
and times that (its figures only show the keys are written).
"""

from __future__ import annotations

import torch
from specfleet.bench.gpu.quant_check import seconds_per_call
from specfleet.kernels.lora_reference import lora_expand_reference, lora_gather_bmm, lora_shrink_reference
from specfleet.kernels.lora_shrink_expand import LoraMapping, lora_expand, lora_shrink


def _inputs(tokens: int, hidden: int, widths: list[int], loras: int, rank: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(len(widths), loras, rank, hidden, generator=g) / hidden**0.5
    b = torch.randn(len(widths), loras, max(widths), rank, generator=g) / rank**0.5
    token_lora = torch.randint(-1, loras, (tokens,), generator=g)  # -1: base-model tokens, 1 in loras+1
    x = torch.randn(tokens, hidden, generator=g)
    out = torch.randn(tokens, sum(widths), generator=g)
    starts = [sum(widths[:i]) for i in range(len(widths) + 1)]
    move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return move(x), move(a), move(b), starts, token_lora.to(device), move(out)


def run(device: torch.device, dry_run: bool) -> dict:
    dtype = torch.float32 if dry_run else torch.bfloat16
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    report: dict = {"cases": 0, "passed": 0, "failures": []}
    # (tokens, hidden, slice widths, adapters, rank): decode-sized and prefill-sized steps, fused q/k/v
    # slices of Llama-3-8B's GQA widths, ranks 8 to 64
    cases = (
        [(7, 48, [32, 16, 16], 3, 8), (20, 40, [24], 2, 64)]
        if dry_run
        else [
            (8, 4096, [4096, 1024, 1024], 4, 16),
            (256, 4096, [4096], 8, 64),
            (77, 2048, [8192, 8192], 3, 8),
        ]
    )
    for tokens, hidden, widths, loras, rank in cases:
        report["cases"] += 1
        x, a, b, starts, token_lora, out = _inputs(tokens, hidden, widths, loras, rank, dtype, device, tokens)
        try:
            mapping = LoraMapping.of(token_lora)
            got = lora_expand(out.clone(), lora_shrink(x, a, mapping), b, starts, mapping)
            s_ref = lora_shrink_reference(x, a, token_lora)
            want = lora_expand_reference(out.float(), s_ref, b, starts, token_lora)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, rank**0.5))
            report["passed"] += 1
        except (AssertionError, RuntimeError, ValueError) as e:
            report["failures"].append(
                f"T={tokens} H={hidden} slices={widths} r={rank}: {str(e).splitlines()[-1]}"
            )
    tokens, hidden, loras, rank = (16, 32, 2, 16) if dry_run else (256, 4096, 8, 16)
    x, a, b, starts, token_lora, out = _inputs(tokens, hidden, [hidden], loras, rank, dtype, device, 0)
    iters = 2 if dry_run else 200

    mapping = LoraMapping.of(token_lora)  # once per step, shared by every projection of every layer

    def triton_step() -> None:
        lora_expand(out, lora_shrink(x, a, mapping), b, starts, mapping)

    t_triton = seconds_per_call(triton_step, iters)
    t_torch = seconds_per_call(lambda: lora_gather_bmm(out, x, a, b, starts, token_lora), iters)
    report[f"t{tokens}_h{hidden}_r{rank}_loras{loras}"] = {
        "triton_us": round(t_triton * 1e6, 1),
        "gather_bmm_us": round(t_torch * 1e6, 1),
        "speedup_vs_gather_bmm": round(t_torch / t_triton, 2),
        "dtype": str(dtype),
    }
    return report
