"""The native kernels' single ops: RMSNorm, SiLU-and-multiply, soft-capping, paged attention."""

from __future__ import annotations

import torch
from specfleet.kernels.cpu_build import _check, _lib_or_raise, num_threads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check("x", x, dim=2)
    _check("weight", weight, dim=1)
    if not x.is_contiguous() or not weight.is_contiguous() or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm needs contiguous x [rows, {weight.shape[0]}], got {tuple(x.shape)}")
    y = torch.empty_like(x)
    _lib_or_raise().sf_rms_norm_f32(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, y.data_ptr()
    )
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * I] (gate then up) -> [rows, I] = silu(gate) * up."""
    _check("gate_up", gate_up, dim=2)
    if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be contiguous [rows, 2 * I], got {tuple(gate_up.shape)}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, inter)
    _lib_or_raise().sf_silu_mul_f32(gate_up.data_ptr(), rows, inter, y.data_ptr())
    return y


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x = cap * tanh(x / cap) in place (Gemma 2's final logit soft-cap), one pass over a contiguous x."""
    _check("x", x)
    if not x.is_contiguous():
        raise ValueError(f"softcap_ needs a contiguous x, got strides {x.stride()}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    _lib_or_raise().sf_softcap_f32(x.data_ptr(), x.numel(), cap, num_threads())
    return x


def paged_attention(
    query: torch.Tensor,  # [tokens, H, D], rows may be strided
    k_cache: torch.Tensor,  # [blocks, BS, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    seqs: torch.Tensor,  # [n] int32: which sequences to compute
    query_start_loc: torch.Tensor,  # [seqs + 1] int32
    seq_lens: torch.Tensor,  # [seqs] int32
    scale: float,
    out: torch.Tensor,  # [tokens, H, D] contiguous; rows of the listed sequences are written
) -> torch.Tensor:
    _check("query", query, dim=3)
    _check("k_cache", k_cache, dim=4)
    _check("v_cache", v_cache, dim=4)
    _check("out", out, dim=3)
    for name, t in (
        ("block_tables", block_tables),
        ("seqs", seqs),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        _check(name, t, torch.int32)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    tokens, heads, head_dim = query.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    if head_dim % 16 or heads % kv_heads or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"unsupported shapes: query {tuple(query.shape)}, caches {tuple(k_cache.shape)} "
            "(head_dim must be a multiple of 16, heads a multiple of kv heads)"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError("k_cache, v_cache and out must be contiguous")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError(f"query rows must hold [heads, head_dim] contiguously, strides {query.stride()}")
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    _lib_or_raise().sf_paged_attention_f32(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seqs.data_ptr(),
        seqs.numel(),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        num_threads(),
    )
    return out
