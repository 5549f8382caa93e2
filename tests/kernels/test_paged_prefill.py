"""Chunked-prefill attention kernel vs the torch reference and TorchAttentionBackend."""

from __future__ import annotations

import pytest
import torch
from specfleet.bench.gpu.paged_cases import TOLERANCE, PagedCase, make_case
from specfleet.engine.attention.torch_backend import TorchAttentionBackend
from specfleet.kernels.attention_reference import paged_attention_reference
from specfleet.kernels.paged_prefill import paged_prefill_attention

# Each case runs the attention kernel through Triton's interpreter on CPU, seconds per case: the fast lane
# (`pytest -m "not slow"`) leaves them to the full suite and to `pytest tests/kernels`.
pytestmark = pytest.mark.slow

GQA = [(4, 4), (9, 3), (8, 2)]  # (num_heads, num_kv_heads): ratios 1, 3, 4


def _run(case: PagedCase, block_m: int | None = None) -> torch.Tensor:
    return paged_prefill_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
        max(case.query_lens),
        block_m=block_m,
    )


def _check(case: PagedCase, out: torch.Tensor, dtype: torch.dtype) -> None:
    expected = paged_attention_reference(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
    )
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    backend, meta = TorchAttentionBackend(), case.metadata()
    backend.prepare(meta)
    torch_out = backend.forward(case.query, case.k_cache, case.v_cache, meta, case.scale)
    torch.testing.assert_close(out.float(), torch_out.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fresh_prompts_of_odd_lengths(heads, block_size, dtype) -> None:
    """Whole prompts of 1, 7, 33 and 129 tokens with nothing cached before them."""
    lens = [1, 7, 33, 129]
    case = make_case(lens, lens, *heads, 64, block_size, dtype, seed=block_size)
    _check(case, _run(case), dtype)


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunks_after_cached_prefixes(heads, head_dim, dtype) -> None:
    """Chunks attend to their cached prefix (shared prefix blocks, earlier chunks) and causally to
    themselves, in a batch mixed with decode and verification rows."""
    query_lens = [33, 7, 1, 5, 17]
    seq_lens = [129, 71, 40, 33, 17]
    case = make_case(query_lens, seq_lens, *heads, head_dim, 16, dtype, share_prefix=True, seed=head_dim)
    assert torch.equal(case.block_tables[0, :2], case.block_tables[1, :2])
    _check(case, _run(case), dtype)


@pytest.mark.parametrize("block_m", [16, 32])
def test_several_query_tiles_per_sequence(block_m: int) -> None:
    """Small tiles: a GQA-3 tile of 16 holds 5 query rows, so 129 rows span 26 tiles."""
    case = make_case([129, 20], [161, 20], 9, 3, 64, 32, torch.float32, seed=block_m)
    _check(case, _run(case, block_m=block_m), torch.float32)


def test_later_chunk_tokens_do_not_leak_into_earlier_rows() -> None:
    case = make_case([7], [40], 4, 4, 64, 16, torch.float32, seed=9)
    before = _run(case)
    block = int(case.block_tables[0, 39 // 16])
    case.v_cache[block, 39 % 16] += 5.0  # position 39: seen by the last row only
    after = _run(case)
    torch.testing.assert_close(after[:6], before[:6])
    assert (after[6] - before[6]).abs().max() > 1e-3


def test_rejects_mismatched_metadata() -> None:
    case = make_case([7], [40], 4, 4, 64, 16, torch.float32)
    with pytest.raises(ValueError, match=r"query_start_loc.shape=\(3,\)"):
        paged_prefill_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            torch.tensor([0, 3, 7], dtype=torch.int32),
            case.seq_lens,
            case.scale,
            7,
        )
    with pytest.raises(ValueError, match="head_dim=32"):
        paged_prefill_attention(
            case.query[..., :32],
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.query_start_loc,
            case.seq_lens,
            case.scale,
            7,
        )
