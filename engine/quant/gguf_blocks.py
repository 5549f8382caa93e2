"""GGUF quantization blocks -> `QuantTensor`, for the block types the kernels run natively.

Layouts (llama.cpp ggml-common.h; gguf-py quants.py is the reference the tests compare against):
  Q4_0 (18 bytes / 32 values): fp16 d, 16 bytes; byte j = value j (low nibble), value j + 16 (high);
       W = d * (q - 8), so scale d and min -8 d.
  Q4_1 (20 bytes / 32): fp16 d, fp16 m, 16 nibble bytes as Q4_0; W = d * q + m.
  Q8_0 (34 bytes / 32): fp16 d, 32 int8; W = d * q.
  Q4_K (144 bytes / 256): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 nibble bytes
       (per 64 values: 32 bytes, low nibbles the first 32, high nibbles the next 32); sub-block j of 32
       values: W = d * sc_j * q - dmin * m_j, so a group of 32 with scale d * sc_j and min -dmin * m_j.
  Q5_0 (22 bytes / 32): fp16 d, 4 bytes qh (little-endian uint32, bit j = fifth bit of value j), 16 nibble
       bytes as Q4_0; W = d * (q - 16) with q = nibble | bit << 4: 5-bit codes q, scale d, min -16 d.
  Q5_1 (24 bytes / 32): fp16 d, fp16 m, qh, 16 nibble bytes; W = d * q + m: 5-bit codes q, scale d, min m.
  Q5_K (176 bytes / 256): fp16 d, fp16 dmin, 12 scale/min bytes as Q4_K, 32 bytes qh (bit i of byte l =
       fifth bit of value l of sub-block i), 128 nibble bytes as Q4_K; sub-blocks of 32 as Q4_K.
  Q6_K (210 bytes / 256): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, fp16 d
       (last). Per 128 values: ql[0:32] low nibbles, ql[32:64] low, ql[0:32] high, ql[32:64] high, each
       with qh[l] bits 0-1, 2-3, 4-5, 6-7 on top; W = d * sc_s * (q - 32) per sub-block s of 16 values:
       int8 codes q - 32, groups of 16, scale d * sc_s.
The 5-bit types decode to 5-bit codes and Q6_K to 6-bit codes q with min -32 d sc (the kernels keep them as
nibbles plus one or two planes of high bits). The K types also keep their scales' two levels (`SuperScales`:
the integer sc and m per group, the halfs d and dmin per 256 values), which the kernels stream instead of a
float per group. Every form decodes exactly: each scale and min is the same float32 product the reference
dequantizer forms (Q5_0's -16 d and Q6_K's -32 d sc are power-of-two multiples).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from specfleet.kernels.quantized import QuantTensor, SuperScales

BLOCK_BYTES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
NATIVE_TYPES = tuple(BLOCK_BYTES)
# Values decoded at once (a chunk of whole rows): 4M keeps a chunk's temporaries near 40 MB, where a 0.8B
# model's tied Q6_K vocabulary table (100M values) took about 120 MB above the load's steady memory.
DECODE_VALUES = 1 << 22


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits_32(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, bit j for value j."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def decode(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantTensor:
    """raw: [N, bytes per row] uint8 as gguf's reader returns it; shape: (N, K) in torch order."""
    if type_name not in BLOCK_BYTES:
        raise ValueError(
            f"GGUF type {type_name} is not run natively; native types: {', '.join(NATIVE_TYPES)}"
        )
    n, k = shape
    values, nbytes = BLOCK_BYTES[type_name]
    if k % values or raw.shape != (n, k // values * nbytes):
        raise ValueError(
            f"GGUF {type_name} tensor {shape}: raw blocks {raw.shape} do not match "
            f"{values}-value blocks of {nbytes} bytes"
        )
    rows = max(1, DECODE_VALUES // k)
    if n <= rows:
        return _decode_rows(raw, type_name, n, k)
    # Row by row-chunk into preallocated tensors: the decoders' numpy temporaries (about 10 bytes a value for
    # Q6_K: nibbles, bit fields, an int16 widening) stay those of one chunk, not of a whole vocabulary table.
    first = _decode_rows(raw[:rows], type_name, rows, k)
    whole = replace(
        first,
        codes=_rows_like(first.codes, n),
        scales=_rows_like(first.scales, n),
        mins=None if first.mins is None else _rows_like(first.mins, n),
        two_level=None if first.two_level is None else first.two_level.map(lambda t: _rows_like(t, n)),
    )
    for at in range(0, n, rows):
        part = first if at == 0 else _decode_rows(raw[at : at + rows], type_name, min(rows, n - at), k)
        whole.codes[at : at + rows], whole.scales[at : at + rows] = part.codes, part.scales
        if whole.mins is not None and part.mins is not None:
            whole.mins[at : at + rows] = part.mins
        if whole.two_level is not None and part.two_level is not None:
            _copy_rows(whole.two_level, part.two_level, at)
    return whole


def _rows_like(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((n, *t.shape[1:]), dtype=t.dtype)


def _copy_rows(dst: SuperScales, src: SuperScales, at: int) -> None:
    for a, b in ((dst.sc, src.sc), (dst.d, src.d), (dst.m, src.m), (dst.dmin, src.dmin)):
        if a is not None and b is not None and not (a is dst.m and dst.m is dst.sc):
            a[at : at + b.shape[0]] = b


def _decode_rows(raw: np.ndarray, type_name: str, n: int, k: int) -> QuantTensor:
    values, nbytes = BLOCK_BYTES[type_name]
    blocks = raw.reshape(n, k // values, nbytes)
    if type_name in ("Q5_0", "Q5_1", "Q5_K", "Q6_K"):
        return _decode_5_6(blocks, type_name, n, k)
    if type_name == "Q8_0":
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantTensor(
            torch.from_numpy(codes.copy()),
            torch.from_numpy(_f16(blocks[..., :2])[..., 0]),
            None,
            32,
            8,
            "gguf:Q8_0",
        )
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(blocks[..., :2])[..., 0]
        if type_name == "Q4_0":
            m, qs = -8.0 * d, blocks[..., 2:]
        else:
            m, qs = _f16(blocks[..., 2:4])[..., 0], blocks[..., 4:]
        codes = _nibbles_32(qs).reshape(n, k)
        return QuantTensor(
            torch.from_numpy(codes),
            torch.from_numpy(d),
            torch.from_numpy(m.astype(np.float32)),
            32,
            4,
            f"gguf:{type_name}",
        )
    # Q4_K
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)  # chunk c: sub-blocks 2c (low), 2c + 1
    return _k_quant(codes, blocks, 4, "gguf:Q4_K")


def _k_quant(codes: np.ndarray, blocks: np.ndarray, bits: int, fmt: str) -> QuantTensor:
    """Q4_K or Q5_K codes [N, K] with their blocks' two-level scales and mins (bytes 0-15 of each block)."""
    n, k = codes.shape
    sc, mn = q4k_scale_min(blocks[..., 4:16])
    two = SuperScales(
        torch.from_numpy(sc.reshape(n, k // 32).astype(np.int8)),
        torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, k // 256)),
        torch.from_numpy(mn.reshape(n, k // 32).astype(np.int8)),
        -torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(n, k // 256)),
    )
    mins = two.mins(32)
    assert mins is not None
    return QuantTensor(torch.from_numpy(codes), two.scales(32), mins, 32, bits, fmt, two_level=two)


def q4k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] bytes -> eight 6-bit scales and eight 6-bit mins, [..., 8] each (ggml get_scale_min_k4):
    bytes 0-3 and 4-7 hold scales and mins 0-3 in their low 6 bits and the top 2 bits of 4-7; bytes 8-11
    hold the low 4 bits of scales (low nibble) and mins (high nibble) 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode_5_6(blocks: np.ndarray, type_name: str, n: int, k: int) -> QuantTensor:
    """Q5_0, Q5_1, Q5_K, Q6_K blocks [N, K / values, bytes] -> 5-bit or int8 codes (layouts in the module doc)."""
    fmt = f"gguf:{type_name}"
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(blocks[..., :2])[..., 0]
        at = 2 if type_name == "Q5_0" else 4
        q = _nibbles_32(blocks[..., at + 4 :]) | (_fifth_bits_32(blocks[..., at : at + 4]) << 4)
        m = np.float32(-16.0) * d if type_name == "Q5_0" else _f16(blocks[..., 2:4])[..., 0]
        return QuantTensor(
            torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), torch.from_numpy(m), 32, 5, fmt
        )
    nb = k // 256
    if type_name == "Q5_K":
        qh = blocks[..., 16:48]  # [n, nb, 32]
        qs = blocks[..., 48:].reshape(n, nb, 4, 32)
        low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb, 8, 32)
        high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # sub-block i: bit i
        return _k_quant((low | (high << 4)).reshape(n, k), blocks, 5, fmt)
    return _q6_k(blocks, n, k)


def _q6_k(blocks: np.ndarray, n: int, k: int) -> QuantTensor:
    """Q6_K blocks -> 6-bit codes q with scale d sc and min -32 d sc, and their two levels."""
    nb, fmt = k // 256, "gguf:Q6_K"
    ql = blocks[..., :128].reshape(n, nb, 2, 64)
    low = np.stack([ql & 0x0F, ql >> 4], axis=3).reshape(n, nb, 2, 4, 32)  # [half][nibble][l < 32][32]
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [half][chunk][32]
    codes = torch.from_numpy((low | (high << 4)).reshape(n, k))
    sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, k // 16))
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).reshape(n, nb))
    offset = d * -32  # W = d sc (q - 32) = q * (d sc) + (-32 d) sc: exact unless -32 d overflows a half
    if torch.isfinite(offset).all():
        two = SuperScales(sc, d, sc, offset)
        mins = two.mins(16)
        assert mins is not None
        return QuantTensor(codes, two.scales(16), mins, 16, 6, fmt, two_level=two)
    scales = d.float().repeat_interleave(16, dim=1) * sc.float()
    return QuantTensor(codes, scales, scales * -32, 16, 6, fmt)
