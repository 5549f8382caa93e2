"""Test-only packers: a float weight -> the bytes a quantizing tool would write, so that the engine's
readers can be checked against formats nothing here can download.

- GGUF Q4_K: gguf-py has a dequantizer for it but no quantizer; `pack_q4_k` writes the 144-byte blocks
  (ggml-common.h block_q4_K) and the tests check it against ``gguf.quants.dequantize``.
- AWQ (AutoAWQ WQLinear_GEMM.from_linear's packing loop) and GPTQ (AutoGPTQ QuantLinear.pack's loop, v1
  zero - 1 storage, optional act-order g_idx), each returning the integers it packed so the tests can
  compare the engine's unpacking with the documented formula ``(q - z) * s``.
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> [N, K / 256 * 144] uint8 Q4_K blocks (asymmetric per 32-value
    sub-block, 6-bit scale and min quantized against fp16 super-block d and dmin)."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # ggml keeps min <= 0 so that dmin * m is a subtraction
    hi = sub.max(axis=-1)
    scale = (hi - lo) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dminf > 0, np.rint(-lo / dminf), 0).clip(0, 63).astype(np.uint8)
        eff_s = df * sc
        eff_m = dminf * mn
        q = np.where(eff_s[..., None] > 0, np.rint((sub + eff_m[..., None]) / eff_s[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8)  # [n, blocks, 8, 32]
    packed = np.zeros((n, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 0x3F) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (mn[..., 0:4] & 0x3F) | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    chunks = q.reshape(n, k // 256, 4, 2, 32)  # 64-value chunks: low nibbles first 32, high nibbles next 32
    qs = (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), packed, qs], axis=-1
    )
    return blocks.reshape(n, -1)


def quantize_groups(w: torch.Tensor, group: int, g_idx: torch.Tensor | None = None):
    """W [N, K] -> codes [K, N] int, zeros and scales [K / G, N] (asymmetric min-max 4-bit), as the
    tools compute them; with g_idx, input row k belongs to group g_idx[k]."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    wt = w.t().float()
    groups = k // group
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(dim=0).values.clamp(max=0), rows.max(dim=0).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        # zero >= 1: GPTQ v1 stores zero - 1 in a nibble, so a zero of 0 cannot be written (a known
        # quirk of the format); min-max ranges that include 0 rarely need it
        scales[g], zeros[g] = s, torch.round(-lo / s).clamp(1, 15).long()
    codes = torch.round(wt / scales[g_idx] + zeros[g_idx]).clamp(0, 15).long()
    return codes, zeros, scales.half()


def _pack_cols(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, N] ints 0..15 -> [R, N / 8] int32: nibble slot i of word j = column 8 j + order[i]."""
    r, n = values.shape
    out = torch.zeros(r, n // 8, dtype=torch.int64)
    for i in range(8):
        out |= values[:, [8 * j + order[i] for j in range(n // 8)]] << (4 * i)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def pack_awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ GEMM tensors for W [N, K], and the dequantized [N, K] weight they stand for."""
    codes, zeros, scales = quantize_groups(w, group)
    tensors = {
        "qweight": _pack_cols(codes, AWQ_PACK_ORDER),
        "qzeros": _pack_cols(zeros, AWQ_PACK_ORDER),
        "scales": scales,
    }
    g_idx = torch.arange(w.shape[1]) // group
    return tensors, ((codes - zeros[g_idx]) * scales.float()[g_idx]).t().contiguous()


def pack_gptq(w: torch.Tensor, group: int, act_order: bool = False, seed: int = 0):
    """GPTQ v1 tensors (qweight packed along K, qzeros storing zero - 1, g_idx), and the dequantized [N, K]."""
    n, k = w.shape
    g_idx = torch.arange(k) // group
    if act_order:  # desc_act: rows quantized in a permuted order, so g_idx is a shuffled assignment
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))]
    codes, zeros, scales = quantize_groups(w, group, g_idx)
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= codes[j::8] << (4 * j)
    qweight = (qweight - (qweight >= 2**31).long() * 2**32).to(torch.int32)
    tensors = {
        "qweight": qweight,
        "qzeros": _pack_cols((zeros - 1) & 0xF, list(range(8))),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, ((codes - zeros[g_idx]) * scales.float()[g_idx]).t().contiguous()
