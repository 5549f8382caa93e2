"""Block-quantized weights (GGUF / AWQ / GPTQ) in the native kernels' panel layouts, and `QuantLinear`
over them."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
from specfleet.kernels.cpu_build import PANEL, _check, _lib_or_raise, _rows, num_threads
from specfleet.kernels.cpu_dense import LinearDesc, _pad, pack_panels
from specfleet.kernels.quantized import SUPER_BLOCK, QuantTensor

ACTIVATIONS = ("int8", "float32")
QBLOCK = 32  # the int8 activation path quantizes x per 32 values (GGUF's Q8_0/Q8_1 block)
# How a packed weight's scales and mins are stored (native.cpp, with_scales)
FLOAT_SCALES, HALF_SCALES, TWO_LEVEL_SCALES = 0, 1, 2


class _TwoLevel(ctypes.Structure):
    """sf_two_level (native.cpp): the panels of a two-level weight's factors."""

    _fields_ = [
        ("sc", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("dmin", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class TwoLevelPanels:
    """`SuperScales` in panels: sc and m [panels, K / G, 32] int8, d and dmin [panels, K / 256, 32] halfs
    (padding columns 0, so they add nothing); m may be sc itself."""

    sc: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    dmin: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        own_m = self.m is not None and self.m is not self.sc
        return [t for t in (self.sc, self.d, self.m if own_m else None, self.dmin) if t is not None]

    def struct(self) -> _TwoLevel:
        return _TwoLevel(
            self.sc.data_ptr(),
            self.d.data_ptr(),
            None if self.m is None else self.m.data_ptr(),
            None if self.dmin is None else self.dmin.data_ptr(),
        )

    def group_values(
        self, panel: torch.Tensor, col: torch.Tensor, group_size: int
    ) -> tuple[torch.Tensor, ...]:
        """Columns (panel, col) of the scales and mins as float32 [len(col), K / G] (the kernels' products)."""
        per = SUPER_BLOCK // group_size

        def product(sub: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
            return sub[panel, :, col].float() * sup[panel, :, col].float().repeat_interleave(per, dim=1)

        scales = product(self.sc, self.d)
        if self.m is None or self.dmin is None:
            return (scales,)
        return scales, product(self.m, self.dmin)


def _two_level_panels(q: QuantTensor) -> TwoLevelPanels:
    t = q.two_level
    assert t is not None
    sc = pack_panels(t.sc.t())
    m = None if t.m is None else sc if t.m is t.sc else pack_panels(t.m.t())
    return TwoLevelPanels(sc, pack_panels(t.d.t()), m, None if t.dmin is None else pack_panels(t.dmin.t()))


def _scale_panels(q: QuantTensor) -> tuple[torch.Tensor | TwoLevelPanels, torch.Tensor | None]:
    # GGUF's K-quants keep their two levels (4.625 bits per value for Q4_K instead of 6). Otherwise scales
    # and mins as halfs when that is exact (GGUF's d and m are fp16 in the file): 1 bit per weight instead of
    # 2 at groups of 32; else (AWQ/GPTQ's -z * s) float32.
    if q.two_level is not None:
        return _two_level_panels(q), None
    dtype = (
        torch.float16
        if all(t is None or torch.equal(t.half().float(), t) for t in (q.scales, q.mins))
        else torch.float32
    )
    scales = pack_panels(q.scales.t().to(dtype))  # padding columns get scale 0, so they add nothing
    mins = None if q.mins is None else pack_panels(q.mins.t().to(dtype))
    return scales, mins


@dataclass(frozen=True)
class QuantPanels:
    """A `QuantTensor` in one of the kernels' panel layouts. `high`: for 5- and 6-bit codes, the planes of
    their high bits (`fifth_bit_plane`: the fifth bits, then for 6-bit the sixth) beside the nibble panels in
    `codes`, which then hold the low 4 bits; else None. `scales`: the per-group scale panels, or a K-quant's
    two levels (then `mins` is None and the offsets, if any, are in them)."""

    codes: torch.Tensor
    high: torch.Tensor | None
    scales: torch.Tensor | TwoLevelPanels
    mins: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        scales = self.scales.tensors() if isinstance(self.scales, TwoLevelPanels) else [self.scales]
        return sum(t.nbytes for t in (self.codes, self.high, self.mins, *scales) if t is not None)


def fifth_bit_plane(lo: torch.Tensor, hi: torch.Tensor, unit: int) -> torch.Tensor:
    """The fifth bits (bit 4) of codes laid out as nibble bytes: `lo` holds the codes whose low 4 bits go into
    each byte's low nibble, `hi` those of its high nibble, both in the bytes' order. Per `unit` bytes (the
    kernel's vector: 16 on the float path, 64 on the dot path) and per pair of units: a little-endian bit
    mask of unit 0's low nibbles, one of its high nibbles, then unit 1's two (native.cpp, "5-bit codes").
    Flat uint8, one bit per code."""
    bits = torch.stack([lo.reshape(-1, 2, unit) >> 4, hi.reshape(-1, 2, unit) >> 4], dim=2) & 1
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (bits.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _nibble_bytes(
    lo: torch.Tensor, hi: torch.Tensor, bits: int, unit: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bytes holding `lo` in their low nibbles and `hi` in their high ones, and for 5- and 6-bit codes the
    planes of their high bits, one after the other (flat)."""
    if bits == 4:
        return (lo | (hi << 4)).contiguous(), None
    planes = [fifth_bit_plane(lo, hi, unit)]
    if bits == 6:
        planes.append(fifth_bit_plane(lo >> 1, hi >> 1, unit))
    return ((lo & 0x0F) | ((hi & 0x0F) << 4)).contiguous(), torch.cat(planes)


# The float path reads 16 nibble bytes (16 columns of a row pair) per vector, the dot path 64 (16 columns x
# 4 rows); each 5-bit plane is laid out per such unit.
FLOAT_UNIT, DOT_UNIT = 16, 64


def pack_quant_panels(q: QuantTensor) -> QuantPanels:
    """Codes, scales and mins in the float kernel's panels: 32 output columns per panel, each a sequential
    stream. 4- to 6-bit codes: byte (k / 2, c) holds row k's code (its low 4 bits) in its low nibble, row
    k + 1's in its high; a 5- or 6-bit weight's planes then have [panel][K / 2][2 (columns 0-15, 16-31)][2
    (low, high nibbles)][2 bytes]."""
    return QuantPanels(*_by_panels(q, _float_rows), *_scale_panels(q))


def _float_rows(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    panels = pack_panels(codes.t())  # [panels, K, 32], padding columns get code 0
    if bits == 8:
        return panels, None
    nibbles, high = _nibble_bytes(panels[:, 0::2], panels[:, 1::2], bits, FLOAT_UNIT)
    if high is None:
        return nibbles, None
    return nibbles, high.view(-1, nibbles.shape[0], nibbles.shape[1], 2, 2, FLOAT_UNIT // 8)


def pack_dot_panels(q: QuantTensor) -> QuantPanels:
    """Codes in the int8-activation kernel's panels (native.cpp, "dot panels"): per 32-column panel and
    chunk of input rows (8 for 4- to 6-bit, 4 for 8-bit), [half][column 0..15][i 0..3], so that one 64-byte
    load is 16 columns x 4 rows. 4-bit: row k0 + i in the low nibble, k0 + 4 + i in the high; 5- and 6-bit:
    their low 4 bits so, and a plane per high bit [panel][K / 8][2 (half)][2 (low, high nibbles)][8 bytes];
    8-bit: code + 128."""
    return QuantPanels(*_by_panels(q, _dot_rows), *_scale_panels(q))


def _dot_rows(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = rows.shape
    panels = -(-n // PANEL)
    codes = torch.zeros(panels * PANEL, k, dtype=torch.uint8)
    codes[:n] = rows.view(torch.uint8) if bits == 8 else rows
    if bits == 8:
        codes[:n] ^= 0x80  # two's complement int8 -> code + 128 as uint8
        return codes.view(panels, 2, 16, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous(), None
    c = codes.view(panels, 2, 16, k // 8, 2, 4)  # [..., lo/hi half of the 8 rows, i]
    lo, hi = (c[:, :, :, :, j].permute(0, 3, 1, 2, 4).contiguous() for j in (0, 1))
    del codes, c
    nibbles, high = _nibble_bytes(lo, hi, bits, DOT_UNIT)
    return nibbles, None if high is None else high.view(-1, panels, k // 8, 2, 2, DOT_UNIT // 8)


# Code values packed at a time: the packing's temporaries (a padded copy, the two nibble halves, the bit
# planes' byte-per-bit intermediates: about 6 bytes a value for 6-bit codes) stay near 12 MB for a chunk of 2M,
# where a 0.8B model's fused gate/up (23M values) took about 100 MB above its packed size at once.
PACK_VALUES = 1 << 21


def _by_panels(
    q: QuantTensor, pack_rows: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`pack_rows` over chunks of whole panels of the codes, into one output (panels are independent:
    [panel, ...] codes and [plane, panel, ...] high-bit planes)."""
    n, k = q.shape
    panels = -(-n // PANEL)
    step = max(1, PACK_VALUES // (PANEL * k))  # panels per chunk
    if step >= panels:
        return pack_rows(q.codes, q.bits)
    codes: torch.Tensor | None = None
    high: torch.Tensor | None = None
    for p0 in range(0, panels, step):
        c, h = pack_rows(q.codes[p0 * PANEL : (p0 + step) * PANEL], q.bits)
        if codes is None:
            codes = torch.empty((panels, *c.shape[1:]), dtype=c.dtype)
            high = None if h is None else torch.empty((h.shape[0], panels, *h.shape[2:]), dtype=h.dtype)
        codes[p0 : p0 + step] = c
        if high is not None and h is not None:
            high[:, p0 : p0 + step] = h
    assert codes is not None
    return codes, high


def dot_supported(q: QuantTensor) -> bool:
    """Whether the int8-activation kernel takes this weight: rows in whole 32-blocks, and groups of whole
    32-blocks or, for 4- to 6-bit codes, half of one (GGUF Q6_K's 16: each half of a block summed and scaled
    on its own, native.cpp dot_tile)."""
    halves = q.group_size == QBLOCK // 2 and q.bits < 8
    return (q.group_size % QBLOCK == 0 or halves) and q.shape[1] % QBLOCK == 0


class QuantLinear:
    """``x @ W.T (+ bias) (+ residual)`` for a grouped-quantized weight (`QuantTensor`): GGUF Q4_0,
    Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, AWQ, GPTQ. The codes stay packed (5- and 6-bit ones as nibbles
    plus planes of high bits), and the K-quants' scales in their two levels.

    ``activations="int8"`` (default where the weight's groups are whole 32-blocks): each call quantizes x
    per row and 32-block to int8 (max-abs / 127, as llama.cpp's Q8_0/Q8_1) and runs integer dot products
    with the codes (`vpdpbusd`), scaling once per block. ``"float32"``: x stays float32 and the kernel
    dequantizes the codes in registers; exact up to float rounding (the tests' and the quality oracle's
    path). docs/kernels.md has the measured cost and quality of each."""

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None = None, activations: str = "int8"):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r} is not one of {ACTIVATIONS}")
        self._lib = _lib_or_raise()
        self.out_features, self.in_features = weight.shape
        self.group_size, self.bits, self.fmt = weight.group_size, weight.bits, weight.fmt
        self.activations = activations if dot_supported(weight) else "float32"
        # One call shape for the three kernels: (x, rows, K, ldx, codes, scales, mins, scale kind, group, N,
        # bias, residual, ldr, y, ldy, threads); the int8-activation kernel also takes the code width after
        # ldx, and the nibble kernel the high-bit planes (or null) and the code width after the codes.
        self._kernel: Callable[..., None]
        packed = pack_dot_panels(weight) if self.activations == "int8" else pack_quant_panels(weight)
        self.codes, self.high, self.mins = packed.codes, packed.high, packed.mins
        self.packed_nbytes = packed.nbytes
        self.two_level: TwoLevelPanels | None = None
        self.scales: torch.Tensor | None = None
        if isinstance(packed.scales, TwoLevelPanels):
            self.two_level = packed.scales
            self._two_level_struct = self.two_level.struct()  # kept alive: the kernels read it every call
            self.scale_kind = TWO_LEVEL_SCALES
            self._scale_ptr: int = ctypes.addressof(self._two_level_struct)
            self._mins_ptr: int | None = self._scale_ptr if self.two_level.m is not None else None
        else:
            self.scales = packed.scales
            self.scale_kind = HALF_SCALES if packed.scales.dtype == torch.float16 else FLOAT_SCALES
            self._scale_ptr = packed.scales.data_ptr()
            self._mins_ptr = None if self.mins is None else self.mins.data_ptr()
        high = None if self.high is None else self.high.data_ptr()
        bits = weight.bits
        if self.activations == "int8":
            qdot = self._lib.sf_linear_qdot
            self._kernel = lambda x, rows, k, ldx, codes, *rest: qdot(
                x, rows, k, ldx, bits, codes, high, *rest
            )
        elif bits < 8:
            q4 = self._lib.sf_linear_q4
            self._kernel = lambda x, rows, k, ldx, codes, *rest: q4(x, rows, k, ldx, codes, high, bits, *rest)
        else:
            self._kernel = self._lib.sf_linear_q8g
        self.perm = weight.perm
        self.bias = None
        if bias is not None:
            _check("bias", bias, dim=1)
            self.bias = _pad(bias, self.out_features)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight, [len(index), K] float32, read back from the packed panels: equal to
        ``QuantTensor.select_rows(index).dequantize()``. A tied embedding looks its rows up here, so the
        model holds the table once, in the head's layout."""
        if self.perm is not None:
            raise ValueError(f"{self.fmt}: an act-order weight's rows are not read back")
        index = index.to(torch.int64)
        panel, col = index // PANEL, index % PANEL
        k, rows = self.in_features, index.shape[0]
        if self.activations == "int8":  # dot panels [panel, K / chunk, half, 16, 4] (pack_dot_panels)
            b = self.codes[panel, :, col // 16, col % 16, :]  # [rows, K / chunk, 4]
            if self.bits == 8:
                codes = (b ^ 0x80).view(torch.int8).reshape(rows, k)
            else:  # low nibble: row k0 + i, high: k0 + 4 + i
                codes = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(rows, k)
        else:  # float panels [panel, K (or K / 2 for nibbles), 32] (pack_quant_panels)
            b = self.codes[panel, :, col]
            codes = b if self.bits == 8 else torch.stack([b & 0x0F, b >> 4], dim=2).reshape(rows, k)
        if self.high is not None:
            for i in range(self.high.shape[0]):  # the fifth bit, then for 6-bit codes the sixth
                codes = codes | (self._high_bits(i, panel, col) << (4 + i))
        g = self.group_size
        if self.two_level is not None:
            scales, *mins = self.two_level.group_values(panel, col, g)
        else:
            assert self.scales is not None
            scales = self.scales[panel, :, col].float()
            mins = [] if self.mins is None else [self.mins[panel, :, col].float()]
        w = codes.float() * scales.repeat_interleave(g, dim=1)
        if mins:
            w += mins[0].repeat_interleave(g, dim=1)
        return w

    def _high_bits(self, i: int, panel: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """Bit 4 + i of columns (panel, col) from plane i [panel, K / chunk, half, low/high nibble,
        unit / 8 bytes], [len(col), K] uint8 in the input's order (as the nibbles are read back)."""
        assert self.high is not None
        plane = self.high[i][panel, :, col // 16]  # [rows, K / chunk, 2, unit / 8]
        unit = plane.shape[-1] * 8
        shifts = torch.arange(8, dtype=torch.uint8)
        bits = ((plane.unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [rows, K / chunk, 2, unit]
        per = unit // 16  # rows of one column per nibble half: 1 on the float path, 4 on the dot path
        at = ((col % 16) * per).unsqueeze(1) + torch.arange(per)  # [rows, per]
        picked = torch.take_along_dim(bits, at[:, None, None, :], dim=3)  # [rows, K / chunk, 2, per]
        return picked.reshape(col.shape[0], self.in_features)

    def descriptor(self) -> LinearDesc | None:
        """This linear for sf_decode_layers; None for an act-order weight (its input is permuted first)."""
        if self.perm is not None:
            return None
        dot = self.activations == "int8"
        return LinearDesc(
            kind=4 if dot else 2 if self.bits < 8 else 3,
            bits=self.bits,
            scale_kind=self.scale_kind,
            codes=self.codes.data_ptr(),
            scale=self._scale_ptr,
            mins=self._mins_ptr,
            high=None if self.high is None else self.high.data_ptr(),
            bias=None if self.bias is None else self.bias.data_ptr(),
            K=self.in_features,
            N=self.out_features,
            G=self.group_size,
        )

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        rows = x.shape[0]
        ldx = _rows("x", x, self.in_features)
        ldr = 0
        if residual is not None:
            ldr = _rows("residual", residual, self.out_features)
            if residual.shape[0] != rows:
                raise ValueError(f"residual has {residual.shape[0]} rows, x has {rows}")
        y = torch.empty(rows, self.out_features)
        bias = None if self.bias is None else self.bias.data_ptr()
        res = None if residual is None else residual.data_ptr()
        self._kernel(
            x.data_ptr(),
            rows,
            self.in_features,
            ldx,
            self.codes.data_ptr(),
            self._scale_ptr,
            self._mins_ptr,
            self.scale_kind,
            self.group_size,
            self.out_features,
            bias,
            res,
            ldr,
            y.data_ptr(),
            self.out_features,
            num_threads(),
        )
        return y


def dot_backend() -> str:
    """The instructions the integer dot products compiled to: "avx512-vnni", "avx512bw", "avx-vnni",
    "avx2" (maddubs; all four vectorized) or "portable" (element by element: correct, slow)."""
    return str(_lib_or_raise().sf_dot_backend().decode())
