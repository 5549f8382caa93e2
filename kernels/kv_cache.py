"""KV cache write (``reshape_and_cache``): scatter one step's new K and V rows into their cache slots.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, so slot ``s`` (block
``s // block_size``, offset ``s % block_size``) is one contiguous row of ``num_kv_heads * head_dim``
elements at ``s * num_kv_heads * head_dim``. Any block size works. Slot -1 marks padding: not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specfleet.kernels._launch import FLOAT_DTYPES, check_tensor, kernel_for, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim] new keys, head_dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim] new values, head_dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] key cache, contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] value cache, contiguous
    slot_mapping_ptr,  # [num_tokens] int64 destination slot per token, -1 = skip
    stride_kt,  # key stride between tokens
    stride_kh,  # key stride between heads
    stride_vt,
    stride_vh,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,  # next power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = tl.where(slot >= 0, num_kv_heads, 0)  # a skipped token writes no head
    mask = (h[:, None] < heads) & (d[None, :] < head_dim)
    src_k = key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :]
    dst = slot * num_kv_heads * head_dim + h[:, None] * head_dim + d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write ``key[i]``/``value[i]`` into slot ``slot_mapping[i]`` of the caches, in place."""
    device = k_cache.device
    check_tensor("k_cache", k_cache, device=device, dtypes=FLOAT_DTYPES, ndim=4, contiguous=True)
    check_tensor("v_cache", v_cache, device=device, dtypes=(k_cache.dtype,), ndim=4, contiguous=True)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache.shape={tuple(v_cache.shape)} differs from k_cache.shape={tuple(k_cache.shape)}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    check_tensor("key", key, device=device, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("value", value, device=device, dtypes=(key.dtype,), ndim=3)
    num_tokens = key.shape[0]
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(
                f"{name}.shape={tuple(t.shape)} does not match [num_tokens={num_tokens}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}] of the cache"
            )
    check_tensor("slot_mapping", slot_mapping, device=device, dtypes=(torch.int64, torch.int32), ndim=1)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    kernel_for(_reshape_and_cache_kernel, device)[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads,
        head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain torch: the same scatter, one index_copy_ per cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep].to(v_cache.dtype))
