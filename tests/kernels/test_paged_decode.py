"""Decode / speculative-verification attention kernel vs the torch reference and TorchAttentionBackend."""

from __future__ import annotations

import pytest
import torch
from specfleet.bench.gpu.paged_cases import TOLERANCE, PagedCase, make_case
from specfleet.engine.attention.torch_backend import TorchAttentionBackend
from specfleet.kernels.attention_reference import paged_attention_reference
from specfleet.kernels.paged_decode import paged_decode_attention

# Each case runs the attention kernel through Triton's interpreter on CPU, seconds per case: the fast lane
# (`pytest -m "not slow"`) leaves them to the full suite and to `pytest tests/kernels`.
pytestmark = pytest.mark.slow

SEQ_LENS = [1, 7, 33, 129]
GQA = [(4, 4), (9, 3), (8, 2)]  # (num_heads, num_kv_heads): ratios 1, 3, 4


def _run(case: PagedCase, num_splits: int | None = None) -> torch.Tensor:
    return paged_decode_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
        max(case.query_lens),
        max(case.seq_lens_list),
        num_splits=num_splits,
    )


def _reference(case: PagedCase) -> torch.Tensor:
    return paged_attention_reference(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
    )


def _torch_backend(case: PagedCase) -> torch.Tensor:
    backend, meta = TorchAttentionBackend(), case.metadata()
    backend.prepare(meta)
    return backend.forward(case.query, case.k_cache, case.v_cache, meta, case.scale)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_matches_reference_and_torch_backend(heads, head_dim, block_size, dtype) -> None:
    num_heads, num_kv_heads = heads
    case = make_case(
        [1] * len(SEQ_LENS),
        SEQ_LENS,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=head_dim + block_size,
    )
    out = _run(case)
    _close(out, _reference(case), dtype)
    _close(out, _torch_backend(case), dtype)


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_verify_rows_are_causal_among_themselves(heads, dtype, num_splits) -> None:
    """k + 1 query rows per sequence (speculative verification), over shared prefix blocks."""
    num_heads, num_kv_heads = heads
    query_lens = [1, 5, 3, 5]
    seq_lens = [129, 40, 7, 5]  # the last sequence is all query: nothing cached before it
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, 64, 16, dtype, share_prefix=True)
    assert torch.equal(case.block_tables[0, :2], case.block_tables[1, :2])  # the shared prefix is real
    out = _run(case, num_splits=num_splits)
    _close(out, _reference(case), dtype)
    _close(out, _torch_backend(case), dtype)


def test_split_context_equals_single_pass() -> None:
    case = make_case([1, 2], [129, 300], 8, 2, 128, 32, torch.float32, seed=3)
    single = _run(case, num_splits=1)
    for num_splits in (2, 5, 64):  # 64 splits: most of them are empty for the shorter sequence
        torch.testing.assert_close(_run(case, num_splits=num_splits), single, **TOLERANCE[torch.float32])


def test_output_depends_on_every_visible_key_and_no_future_key() -> None:
    """Changing the last visible key changes row 0; changing a key past row 0's position does not."""
    case = make_case([2], [33], 4, 4, 64, 16, torch.float32, seed=5)
    before = _run(case)
    last_row_block = int(case.block_tables[0, 32 // 16])
    case.k_cache[last_row_block, 32 % 16] += 3.0  # position 32: visible to row 1 only
    after = _run(case)
    torch.testing.assert_close(after[0], before[0])
    assert (after[1] - before[1]).abs().max() > 1e-3


def test_rejects_bad_arguments() -> None:
    case = make_case([1], [7], 4, 4, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="max_query_len=17 must be in 1..16"):
        paged_decode_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.query_start_loc,
            case.seq_lens,
            case.scale,
            17,
            7,
        )
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        k = torch.zeros(case.k_cache.shape[:2] + (3, 64))
        paged_decode_attention(
            case.query, k, k, case.block_tables, case.query_start_loc, case.seq_lens, case.scale, 1, 7
        )
    with pytest.raises(ValueError, match="block_tables.dtype=torch.int64"):
        paged_decode_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables.long(),
            case.query_start_loc,
            case.seq_lens,
            case.scale,
            1,
            7,
        )
    with pytest.raises(ValueError, match="k_cache.dtype=torch.bfloat16"):
        paged_decode_attention(
            case.query,
            case.k_cache.bfloat16(),
            case.v_cache.bfloat16(),
            case.block_tables,
            case.query_start_loc,
            case.seq_lens,
            case.scale,
            1,
            7,
        )
