"""Argument checks shared by the paged attention wrappers (decode and prefill)."""

from __future__ import annotations

import torch
from specfleet.kernels._launch import FLOAT_DTYPES, check_shape, check_tensor

MAX_HEAD_DIM = 256


def check_paged_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Check devices, dtypes, shapes and strides; return (num_heads, num_kv_heads, head_dim)."""
    device = query.device
    check_tensor("query", query, device=device, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("k_cache", k_cache, device=device, dtypes=(query.dtype,), ndim=4, contiguous=True)
    check_tensor("v_cache", v_cache, device=device, dtypes=(query.dtype,), ndim=4, contiguous=True)
    check_shape("v_cache", v_cache, k_cache.shape)
    num_tokens, num_heads, head_dim = query.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim={cache_head_dim} differs from query head_dim={head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} exceeds the kernels' limit of {MAX_HEAD_DIM}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    check_tensor("block_tables", block_tables, device=device, dtypes=(torch.int32,), ndim=2)
    check_tensor(
        "query_start_loc", query_start_loc, device=device, dtypes=(torch.int32,), ndim=1, contiguous=True
    )
    check_tensor("seq_lens", seq_lens, device=device, dtypes=(torch.int32,), ndim=1, contiguous=True)
    num_seqs = seq_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if out is not None:
        check_tensor("out", out, device=device, dtypes=(query.dtype,), ndim=3)
        check_shape("out", out, query.shape)
    return num_heads, num_kv_heads, head_dim
