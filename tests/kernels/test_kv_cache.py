"""KV cache write kernel vs its torch reference and the torch backend's write_kv."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine.attention.torch_backend import TorchAttentionBackend
from specfleet.kernels.kv_cache import reshape_and_cache, reshape_and_cache_reference


def _slots(num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding rows are skipped
    return slots


@pytest.mark.parametrize("num_tokens", [1, 7, 33, 129])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_matches_reference(num_tokens: int, block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_tokens * block_size)
    num_kv_heads, head_dim = 3, 64
    num_blocks = -(-num_tokens // block_size) * 2 + 1
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    slots = _slots(num_tokens, num_blocks * block_size, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    sentinel = torch.full(cache_shape, 7.0, dtype=dtype)
    k_cache, v_cache = sentinel.clone(), sentinel.clone()
    k_ref, v_ref = sentinel.clone(), sentinel.clone()

    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_reference(key, value, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = int((slots >= 0).sum())
    changed_rows = (k_cache != sentinel).any(-1).any(-1).sum()
    assert int(changed_rows) == written  # exactly the kept tokens' slots changed, -1 rows skipped
    kept = torch.nonzero(slots >= 0).flatten()
    flat = k_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[slots[kept]], key[kept])


def test_write_matches_torch_backend_with_strided_key() -> None:
    """Keys sliced out of a fused qkv projection (token stride > heads * head_dim) are written right."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim, block_size = 33, 4, 128, 16
    qkv = torch.randn((num_tokens, 3 * num_kv_heads, head_dim), generator=gen)
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads : 2 * num_kv_heads]
    assert not key.is_contiguous()
    slots = _slots(num_tokens, 4 * block_size, gen)
    k_cache = torch.zeros((4, block_size, num_kv_heads, head_dim))
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    reshape_and_cache(key, value, k_cache, v_cache, slots)
    from specfleet.engine.attention.base import AttentionMetadata

    meta = AttentionMetadata(
        slots,
        torch.tensor([0, num_tokens], dtype=torch.int32),
        torch.tensor([num_tokens], dtype=torch.int32),
        torch.zeros((1, 3), dtype=torch.int32),
        [num_tokens],
        [num_tokens],
        block_size,
    )
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    backend.write_kv(key, value, k_ref, v_ref, meta)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_write_rejects_wrong_shapes_and_dtypes() -> None:
    k_cache = torch.zeros((2, 16, 2, 64))
    v_cache = torch.zeros_like(k_cache)
    key = torch.zeros((3, 2, 64))
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"key.shape=\(3, 3, 64\)"):
        reshape_and_cache(torch.zeros((3, 3, 64)), key, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 tokens"):
        reshape_and_cache(key, key, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping.dtype=torch.float32"):
        reshape_and_cache(key, key, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="k_cache with strides"):
        reshape_and_cache(key, key, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots)
