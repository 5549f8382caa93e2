"""Packers for tests and the GPU check (quant_check.py): a float weight -> the bytes a quantizing tool would write, so that the engine's
readers can be checked against formats nothing here can download.

- GGUF Q4_K, Q5_K, Q6_K: gguf-py has dequantizers for them but no quantizers; `pack_q4_k`, `pack_q5_k` and
  `pack_q6_k` write the 144-, 176- and 210-byte blocks (ggml-common.h block_q4_K, block_q5_K, block_q6_K)
  and the tests check them against ``gguf.quants.dequantize``.
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
    return _pack_k_asymmetric(w, bits=4)


def pack_q5_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> [N, K / 256 * 176] uint8 Q5_K blocks: Q4_K's form with 5-bit codes,
    the fifth bits in 32 bytes qh (bit i of byte l = value l of sub-block i)."""
    return _pack_k_asymmetric(w, bits=5)


def _pack_k_asymmetric(w: np.ndarray, bits: int) -> np.ndarray:
    n, k = w.shape
    top = (1 << bits) - 1
    sub = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # ggml keeps min <= 0 so that dmin * m is a subtraction
    hi = sub.max(axis=-1)
    scale = (hi - lo) / top
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dminf > 0, np.rint(-lo / dminf), 0).clip(0, 63).astype(np.uint8)
        eff_s = df * sc
        eff_m = dminf * mn
        q = np.where(eff_s[..., None] > 0, np.rint((sub + eff_m[..., None]) / eff_s[..., None]), 0)
    q = q.clip(0, top).astype(np.uint8)  # [n, blocks, 8, 32]
    packed = np.zeros((n, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 0x3F) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (mn[..., 0:4] & 0x3F) | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    low = q & 0x0F
    chunks = low.reshape(n, k // 256, 4, 2, 32)  # 64-value chunks: low nibbles first 32, high nibbles next 32
    qs = (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(n, k // 256, 128)
    parts = [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), packed]
    if bits == 5:
        fifth = (q >> 4).astype(np.uint8)  # [n, blocks, 8 sub-blocks, 32]
        parts.append((fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8))
    blocks = np.concatenate([*parts, qs], axis=-1)
    return blocks.reshape(n, -1)


def pack_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> [N, K / 256 * 210] uint8 Q6_K blocks: symmetric 6-bit codes per
    16-value sub-block, an int8 scale per sub-block against the fp16 super-block d (stored last)."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(axis=-1) / 31.0  # codes -32..31: the largest magnitude maps to 31
    d = (scale.max(axis=-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        eff = df * sc.astype(np.float32)
        q = np.where(eff[..., None] != 0, np.rint(sub / eff[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # [half][chunk][l]
    low, high = q & 0x0F, q >> 4
    # per half: ql[0:32] = chunk 0 | chunk 2 << 4, ql[32:64] = chunk 1 | chunk 3 << 4; qh[l] = chunk j's
    # two high bits at bits 2j, 2j + 1
    ql = np.concatenate(
        [low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], axis=-1
    )
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    blocks = np.concatenate(
        [
            ql.reshape(n, k // 256, 128),
            qh.reshape(n, k // 256, 64),
            sc.view(np.uint8).reshape(n, k // 256, 16),
            d.view(np.uint8).reshape(n, -1, 2),
        ],
        axis=-1,
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
