"""The kernel correctness checks on the target device: each kernel vs its torch reference on odd shapes.

The same cases as tests/kernels (built by ``paged_cases.make_case``, beside this file), moved to the device. Returns a
summary dict; a failing case is recorded with its error, never raised.
"""

from __future__ import annotations

import itertools
import time

import torch
from specfleet.bench.gpu.paged_cases import TOLERANCE, PagedCase, make_case
from specfleet.kernels.attention_reference import paged_attention_reference
from specfleet.kernels.kv_cache import reshape_and_cache, reshape_and_cache_reference
from specfleet.kernels.paged_decode import paged_decode_attention
from specfleet.kernels.paged_prefill import paged_prefill_attention

GQA = [(4, 4), (9, 3), (32, 8)]
DECODE_STEPS = [([1, 1, 1, 1], [1, 7, 33, 129]), ([5, 3, 1], [40, 129, 7])]
PREFILL_STEPS = [([1, 7, 33, 129], [1, 7, 33, 129]), ([33, 7, 1, 5, 17], [129, 71, 40, 33, 17])]


def _to(case: PagedCase, device: torch.device) -> PagedCase:
    for name in ("query", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens"):
        setattr(case, name, getattr(case, name).to(device))
    return case


def _attention_error(case: PagedCase, out: torch.Tensor, dtype: torch.dtype) -> str | None:
    expected = paged_attention_reference(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
    )
    try:
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    except AssertionError as e:
        return str(e).splitlines()[1] if len(str(e).splitlines()) > 1 else str(e)
    return None


def _kv_write_case(num_tokens: int, block_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    num_blocks = -(-num_tokens // block_size) * 2 + 1
    key = torch.randn((num_tokens, 8, 128), device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::5] = -1
    caches = [torch.zeros((num_blocks, block_size, 8, 128), dtype=dtype, device=device) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    reshape_and_cache_reference(key, value, caches[2], caches[3], slots)
    ok = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    return None if ok else "cache contents differ from the reference"


def run_checks(device: torch.device, quick: bool = False, budget_s: float = 150.0) -> dict:
    """Every case on ``device``; ``quick`` keeps a handful (for the CPU dry run). Cases left when
    ``budget_s`` runs out (Triton compiles each new specialisation) are counted as skipped."""
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    gqa = GQA[1:2] if quick else GQA
    head_dims = [64] if quick else [64, 128]
    block_sizes = [16] if quick else [16, 32]
    cases: list[tuple[str, object]] = []
    for tokens, bs, dtype in itertools.product([1, 7, 33, 129], block_sizes, dtypes):
        if quick and tokens > 7:
            continue
        cases.append(
            (
                f"kv_write tokens={tokens} bs={bs} {dtype}",
                lambda t=tokens, b=bs, d=dtype: _kv_write_case(t, b, d, device),
            )
        )
    for (h, kv), d, bs, dtype, step in itertools.product(
        gqa, head_dims, block_sizes, dtypes, range(len(DECODE_STEPS))
    ):
        for splits in [1] if quick else [1, 3]:

            def decode(h=h, kv=kv, d=d, bs=bs, dtype=dtype, step=step, splits=splits):
                q_lens, s_lens = DECODE_STEPS[step]
                case = _to(make_case(q_lens, s_lens, h, kv, d, bs, dtype, share_prefix=True), device)
                out = paged_decode_attention(
                    case.query,
                    case.k_cache,
                    case.v_cache,
                    case.block_tables,
                    case.query_start_loc,
                    case.seq_lens,
                    case.scale,
                    max(q_lens),
                    max(s_lens),
                    num_splits=splits,
                )
                return _attention_error(case, out, dtype)

            cases.append((f"decode heads={h}/{kv} d={d} bs={bs} {dtype} step={step} splits={splits}", decode))
    for (h, kv), d, bs, dtype, step in itertools.product(
        gqa, head_dims, block_sizes, dtypes, range(len(PREFILL_STEPS))
    ):

        def prefill(h=h, kv=kv, d=d, bs=bs, dtype=dtype, step=step):
            q_lens, s_lens = PREFILL_STEPS[step]
            case = _to(make_case(q_lens, s_lens, h, kv, d, bs, dtype, share_prefix=True), device)
            out = paged_prefill_attention(
                case.query,
                case.k_cache,
                case.v_cache,
                case.block_tables,
                case.query_start_loc,
                case.seq_lens,
                case.scale,
                max(q_lens),
            )
            return _attention_error(case, out, dtype)

        cases.append((f"prefill heads={h}/{kv} d={d} bs={bs} {dtype} step={step}", prefill))

    failures, skipped = {}, 0
    deadline = time.monotonic() + budget_s
    for name, check in cases:
        if time.monotonic() > deadline:
            skipped += 1
            continue
        try:
            error = check()
        except Exception as e:  # recorded, the run goes on
            error = f"{type(e).__name__}: {e}"
        if error:
            failures[name] = error[:300]
    return {
        "cases": len(cases),
        "passed": len(cases) - len(failures) - skipped,
        "skipped": skipped,
        "failures": failures,
    }
