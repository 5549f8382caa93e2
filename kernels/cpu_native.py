"""Native CPU kernels (kernels/cpu/native.cpp): built with g++ on first use, loaded with ctypes.

The build is cached under ``$SPECFLEET_CACHE`` (default ``~/.cache/specfleet``)/native, keyed by the
source, the flags and the CPU's feature flags (it is compiled with ``-march=native``). When no compiler
is there, or ``SPECFLEET_NATIVE=0``, `library()` returns None and callers keep their torch paths.

Every wrapper checks dtype, device, shape and contiguity before passing raw pointers on: a wrong
tensor raises ValueError naming it instead of reading out of bounds.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from specfleet.kernels.quantized import QuantTensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "native.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]
PANEL = 32
ABI_VERSION = 7

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_threads = 0


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECFLEET_CACHE", Path.home() / ".cache" / "specfleet")) / "native"


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *FLAGS, _cpu_flags()]).encode()
    ).hexdigest()
    target = _cache_dir() / key[:16] / "libspecfleet_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Concurrent processes (several engines starting at once) each build to a temporary name and
    # rename atomically, so no process ever loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.sf_abi_version.restype = i32
    lib.sf_linear_f32.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_i8.argtypes = [p, i64, i64, i64, p, p, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_q4.argtypes = [p, i64, i64, i64, p, p, p, p, i32, i64, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_q8g.argtypes = [p, i64, i64, i64, p, p, p, i32, i64, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_qdot.argtypes = [p, i64, i64, i64, i32, p, p, p, p, i32, i64, i64, p, p, i64, p, i64, i32]
    lib.sf_dot_backend.restype = ctypes.c_char_p
    lib.sf_rms_norm_f32.argtypes = [p, i64, i64, p, f32, p]
    lib.sf_silu_mul_f32.argtypes = [p, i64, i64, p]
    lib.sf_paged_attention_f32.argtypes = [
        p,
        i64,
        p,
        p,
        p,
        i64,
        p,
        i64,
        p,
        p,
        i64,
        i64,
        i64,
        i64,
        f32,
        p,
        i32,
    ]
    lib.sf_decode_layers.argtypes = [p, p, i64, p, i64, p, p, p, p, p, i64, p, i64, p, p, i32]
    for fn in (
        "sf_decode_layers",
        "sf_linear_f32",
        "sf_linear_i8",
        "sf_linear_q4",
        "sf_linear_q8g",
        "sf_linear_qdot",
        "sf_rms_norm_f32",
        "sf_silu_mul_f32",
        "sf_paged_attention_f32",
    ):
        getattr(lib, fn).restype = None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first call; None when disabled or the build failed."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("SPECFLEET_NATIVE", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(_build()))
            _declare(lib)
            if lib.sf_abi_version() != ABI_VERSION:
                raise RuntimeError(f"ABI version {lib.sf_abi_version()} != {ABI_VERSION}")
            _lib = lib
            num_threads()  # fix the default now, outside any single-threaded section of the engine
        except (OSError, RuntimeError) as exc:
            log.warning("native CPU kernels unavailable, using torch ops: %s", exc)
    return _lib


def available() -> bool:
    return library() is not None


def set_num_threads(n: int) -> None:
    """Threads the native kernels use (default: torch's thread count when first asked)."""
    global _threads
    if n < 1:
        raise ValueError(f"threads={n} must be >= 1")
    _threads = n


def num_threads() -> int:
    global _threads
    if _threads == 0:
        _threads = torch.get_num_threads()
    return _threads


def _lib_or_raise() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available (see the log for why)")
    return lib


def _check(name: str, t: torch.Tensor, dtype: torch.dtype = torch.float32, dim: int | None = None) -> None:
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.device.type} {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")


def _rows(name: str, t: torch.Tensor, cols: int) -> int:
    """Row stride of a 2-D float32 tensor whose rows are contiguous, each holding `cols` values."""
    _check(name, t, dim=2)
    if t.shape[1] != cols or (t.shape[0] > 1 and t.stride(1) != 1) or t.stride(0) < cols:
        raise ValueError(
            f"{name} must be [rows, {cols}] with contiguous rows, got shape {tuple(t.shape)} "
            f"strides {t.stride()}"
        )
    return t.stride(0)


def pack_panels(weight_t: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [ceil(N / 32), K, 32] contiguous, the last panel zero-padded: each panel is one
    sequential stream for the kernel."""
    k, n = weight_t.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(k, panels * PANEL, dtype=weight_t.dtype)
    padded[:, :n] = weight_t
    return padded.view(k, panels, PANEL).transpose(0, 1).contiguous()


def _pad(v: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(-(-n // PANEL) * PANEL)
    out[: v.shape[0]] = v
    return out


def int8_column_scale(weight_t: torch.Tensor) -> torch.Tensor:
    """Symmetric max-abs int8 scale of each output column of an [in, out] weight."""
    return weight_t.abs().amax(dim=0).clamp_min(1e-12) / 127.0


class LinearDesc(ctypes.Structure):
    """sf_linear_desc (kernels/cpu/native.cpp): one linear's kernel and packed tensors."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("q4", ctypes.c_int32),
        ("half_scales", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("codes", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("high", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("K", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("G", ctypes.c_int64),
    ]


class _LayerDesc(ctypes.Structure):
    _fields_ = [
        ("qkv", LinearDesc),
        ("o", LinearDesc),
        ("gate_up", LinearDesc),
        ("down", LinearDesc),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _ModelDesc(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@dataclass(frozen=True)
class DecodeLayerWeights:
    """What sf_decode_layers needs of one decoder layer: its four linears' descriptors and its norms."""

    qkv: LinearDesc
    o: LinearDesc
    gate_up: LinearDesc
    down: LinearDesc
    input_norm: torch.Tensor  # [hidden] float32, contiguous
    post_norm: torch.Tensor


class DecodeLayers:
    """Every decoder layer of a decode step in one native call (sf_decode_layers): the per-op path's
    kernels and arithmetic without a Python call per op. For steps whose queries are all short; built once
    per model and set of KV caches (their pointers are baked in)."""

    def __init__(
        self,
        layers: list[DecodeLayerWeights],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        heads: int,
        eps: float,
        scale: float,
    ):
        if len(layers) != len(kv_caches):
            raise ValueError(f"{len(layers)} layers but {len(kv_caches)} KV caches")
        self._lib = _lib_or_raise()
        blocks, block_size, kv_heads, head_dim = kv_caches[0][0].shape
        for name, t in (("k_cache", kv_caches[0][0]), ("v_cache", kv_caches[0][1])):
            _check(name, t, dim=4)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if head_dim % 16 or heads % kv_heads:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 16 and heads={heads} of {kv_heads}")
        first = layers[0]
        self.hidden, self.heads, self.kv_heads, self.head_dim = first.qkv.K, heads, kv_heads, head_dim
        if first.qkv.N != (heads + 2 * kv_heads) * head_dim:
            raise ValueError(f"q/k/v has {first.qkv.N} outputs, not (heads + 2 kv_heads) * head_dim")
        self._model = _ModelDesc(self.hidden, heads, kv_heads, head_dim, first.down.K, block_size, eps, scale)
        self._layers = (_LayerDesc * len(layers))(
            *(
                _LayerDesc(
                    w.qkv,
                    w.o,
                    w.gate_up,
                    w.down,
                    w.input_norm.data_ptr(),
                    w.post_norm.data_ptr(),
                    k.data_ptr(),
                    v.data_ptr(),
                )
                for w, (k, v) in zip(layers, kv_caches, strict=True)
            )
        )
        self._keep = (layers, kv_caches)  # the tensors behind the pointers

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] float32, contiguous, updated in place
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [max_position, head_dim] float32
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, < 0 for padding rows
        block_tables: torch.Tensor,  # [seqs, width] int32
        seqs: torch.Tensor,  # [n] int32
        query_start_loc: torch.Tensor,  # [seqs + 1] int32
        seq_lens: torch.Tensor,  # [seqs] int32
    ) -> torch.Tensor:
        tokens = x.shape[0]
        _check("x", x, dim=2)
        if x.shape[1] != self.hidden or not x.is_contiguous():
            raise ValueError(f"x must be contiguous [tokens, {self.hidden}], got {tuple(x.shape)}")
        for name, t, dtype in (
            ("positions", positions, torch.int64),
            ("slot_mapping", slot_mapping, torch.int64),
            ("cos", cos, torch.float32),
            ("sin", sin, torch.float32),
            ("block_tables", block_tables, torch.int32),
            ("seqs", seqs, torch.int32),
            ("query_start_loc", query_start_loc, torch.int32),
            ("seq_lens", seq_lens, torch.int32),
        ):
            _check(name, t, dtype)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if positions.numel() != tokens or slot_mapping.numel() != tokens:
            raise ValueError(f"positions and slot_mapping need {tokens} entries (one per row of x)")
        if cos.shape != sin.shape or cos.shape[-1] != self.head_dim:
            raise ValueError(f"cos/sin must be [positions, {self.head_dim}], got {tuple(cos.shape)}")
        if tokens and int(positions.max()) >= cos.shape[0]:
            raise ValueError(f"a position is past the rotary table's {cos.shape[0]} entries")
        self._lib.sf_decode_layers(
            ctypes.byref(self._model),
            self._layers,
            len(self._layers),
            x.data_ptr(),
            tokens,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seqs.data_ptr(),
            seqs.numel(),
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            num_threads(),
        )
        return x


class PackedLinear:
    """``x @ weight_t (+ bias) (+ residual)`` for a fixed [in, out] weight, packed for the native kernel.

    ``quantize="int8"`` stores the weight as int8 with one scale per output column (symmetric,
    max-abs): a quarter of the bytes, for a quantized draft model. Activations stay float32.
    """

    def __init__(
        self,
        weight_t: torch.Tensor,
        bias: torch.Tensor | None = None,
        quantize: str | None = None,
        int8_scale: torch.Tensor | None = None,
    ):
        """`int8_scale`: the column scales to quantize with instead of this weight's own max-abs (a
        tensor-parallel slice of a row-parallel weight keeps the whole weight's scales, so its codes are the
        unsplit model's)."""
        _check("weight_t", weight_t, dim=2)
        self._lib = _lib_or_raise()
        self.in_features, self.out_features = weight_t.shape
        self.scale = None
        if quantize == "int8":
            scale = int8_column_scale(weight_t) if int8_scale is None else int8_scale
            q = torch.round(weight_t / scale).clamp_(-127, 127).to(torch.int8)
            self.panels, self.scale = pack_panels(q), _pad(scale, self.out_features)
        elif quantize is None:
            self.panels = pack_panels(weight_t)
        else:
            raise ValueError(f"quantize={quantize!r} is not one of None, 'int8'")
        self.bias = None
        if bias is not None:
            _check("bias", bias, dim=1)
            self.bias = _pad(bias, self.out_features)

    def descriptor(self) -> LinearDesc:
        """This linear for sf_decode_layers (the tensors stay owned by this object)."""
        return LinearDesc(
            kind=0 if self.scale is None else 1,
            codes=self.panels.data_ptr(),
            scale=None if self.scale is None else self.scale.data_ptr(),
            bias=None if self.bias is None else self.bias.data_ptr(),
            K=self.in_features,
            N=self.out_features,
        )

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        ldx = _rows("x", x, self.in_features)
        ldr = 0
        if residual is not None:
            ldr = _rows("residual", residual, self.out_features)
            if residual.shape[0] != rows:
                raise ValueError(f"residual has {residual.shape[0]} rows, x has {rows}")
        y = torch.empty(rows, self.out_features)
        bias = self.bias.data_ptr() if self.bias is not None else None
        res = residual.data_ptr() if residual is not None else None
        if self.scale is None:
            self._lib.sf_linear_f32(
                x.data_ptr(),
                rows,
                self.in_features,
                ldx,
                self.panels.data_ptr(),
                self.out_features,
                bias,
                res,
                ldr,
                y.data_ptr(),
                self.out_features,
                num_threads(),
            )
        else:
            self._lib.sf_linear_i8(
                x.data_ptr(),
                rows,
                self.in_features,
                ldx,
                self.panels.data_ptr(),
                self.scale.data_ptr(),
                self.out_features,
                bias,
                res,
                ldr,
                y.data_ptr(),
                self.out_features,
                num_threads(),
            )
        return y


ACTIVATIONS = ("int8", "float32")
QBLOCK = 32  # the int8 activation path quantizes x per 32 values (GGUF's Q8_0/Q8_1 block)


def _scale_panels(q: QuantTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Scales and mins as halfs when that is exact (GGUF's d and m are fp16 in the file): 1 bit per weight
    # instead of 2 at groups of 32; otherwise (Q4_K's d * sc, AWQ/GPTQ's -z * s) float32.
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
    """A `QuantTensor` in one of the kernels' panel layouts. `high`: for 5-bit codes, the fifth bits
    (`fifth_bit_plane`) beside the nibble panels in `codes`, which then hold the low 4 bits; else None."""

    codes: torch.Tensor
    high: torch.Tensor | None
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.high, self.scales, self.mins) if t is not None)


def fifth_bit_plane(lo: torch.Tensor, hi: torch.Tensor, unit: int) -> torch.Tensor:
    """The fifth bits of 5-bit codes laid out as nibble bytes: `lo` holds the codes whose low 4 bits go into
    each byte's low nibble, `hi` those of its high nibble, both in the bytes' order. Per `unit` bytes (the
    kernel's vector: 16 on the float path, 64 on the dot path) and per pair of units: a little-endian bit
    mask of unit 0's low nibbles, one of its high nibbles, then unit 1's two (native.cpp, "5-bit codes").
    Flat uint8, one bit per code."""
    bits = torch.stack([lo.reshape(-1, 2, unit) >> 4, hi.reshape(-1, 2, unit) >> 4], dim=2)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (bits.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _nibble_bytes(
    lo: torch.Tensor, hi: torch.Tensor, bits: int, unit: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bytes holding `lo` in their low nibbles and `hi` in their high ones, and for 5-bit codes their plane."""
    if bits == 4:
        return (lo | (hi << 4)).contiguous(), None
    return ((lo & 0x0F) | ((hi & 0x0F) << 4)).contiguous(), fifth_bit_plane(lo, hi, unit)


# The float path reads 16 nibble bytes (16 columns of a row pair) per vector, the dot path 64 (16 columns x
# 4 rows); each 5-bit plane is laid out per such unit.
FLOAT_UNIT, DOT_UNIT = 16, 64


def pack_quant_panels(q: QuantTensor) -> QuantPanels:
    """Codes, scales and mins in the float kernel's panels: 32 output columns per panel, each a sequential
    stream. 4- and 5-bit codes: byte (k / 2, c) holds row k's code (its low 4 bits) in its low nibble, row
    k + 1's in its high; a 5-bit weight's plane then has [panel][K / 2][2 (columns 0-15, 16-31)][2 (low,
    high nibbles)][2 bytes]."""
    codes = pack_panels(q.codes.t())  # [panels, K, 32], padding columns get code 0
    high = None
    if q.bits in (4, 5):
        codes, high = _nibble_bytes(codes[:, 0::2], codes[:, 1::2], q.bits, FLOAT_UNIT)
        if high is not None:
            high = high.view(codes.shape[0], -1, 2, 2, FLOAT_UNIT // 8)
    return QuantPanels(codes, high, *_scale_panels(q))


def pack_dot_panels(q: QuantTensor) -> QuantPanels:
    """Codes in the int8-activation kernel's panels (native.cpp, "dot panels"): per 32-column panel and
    chunk of input rows (8 for 4- and 5-bit, 4 for 8-bit), [half][column 0..15][i 0..3], so that one 64-byte
    load is 16 columns x 4 rows. 4-bit: row k0 + i in the low nibble, k0 + 4 + i in the high; 5-bit: their
    low 4 bits so, and a plane [panel][K / 8][2 (half)][2 (low, high nibbles)][8 bytes]; 8-bit: code + 128."""
    n, k = q.shape
    panels = -(-n // PANEL)
    codes = torch.zeros(panels * PANEL, k, dtype=torch.uint8)
    codes[:n] = q.codes.view(torch.uint8) if q.bits == 8 else q.codes
    high = None
    if q.bits == 8:
        codes[:n] ^= 0x80  # two's complement int8 -> code + 128 as uint8
        codes = codes.view(panels, 2, 16, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
    else:
        c = codes.view(panels, 2, 16, k // 8, 2, 4)  # [..., lo/hi half of the 8 rows, i]
        lo, hi = (c[:, :, :, :, j].permute(0, 3, 1, 2, 4).contiguous() for j in (0, 1))
        codes, high = _nibble_bytes(lo, hi, q.bits, DOT_UNIT)
        if high is not None:
            high = high.view(panels, -1, 2, 2, DOT_UNIT // 8)
    return QuantPanels(codes, high, *_scale_panels(q))


def dot_supported(q: QuantTensor) -> bool:
    """Whether the int8-activation kernel takes this weight: groups and rows in whole 32-blocks."""
    return q.group_size % QBLOCK == 0 and q.shape[1] % QBLOCK == 0


class QuantLinear:
    """``x @ W.T (+ bias) (+ residual)`` for a grouped-quantized weight (`QuantTensor`): GGUF Q4_0,
    Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, AWQ, GPTQ. The codes stay packed (5-bit ones as nibbles plus a
    plane of fifth bits, 6-bit ones as int8).

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
        # One call shape for the three kernels: (x, rows, K, ldx, codes, scales, mins, half, group, N, bias,
        # residual, ldr, y, ldy, threads); the int8-activation kernel also takes the code width after ldx,
        # and the nibble kernels the 5-bit plane (or null) after the codes.
        self._kernel: Callable[..., None]
        packed = pack_dot_panels(weight) if self.activations == "int8" else pack_quant_panels(weight)
        self.codes, self.high, self.scales, self.mins = packed.codes, packed.high, packed.scales, packed.mins
        self.packed_nbytes = packed.nbytes
        high = None if self.high is None else self.high.data_ptr()
        nibbles = weight.bits in (4, 5)
        if self.activations == "int8":
            qdot = self._lib.sf_linear_qdot
            self._kernel = lambda x, rows, k, ldx, codes, *rest: qdot(
                x, rows, k, ldx, int(nibbles), codes, high, *rest
            )
        elif nibbles:
            q4 = self._lib.sf_linear_q4
            self._kernel = lambda x, rows, k, ldx, codes, *rest: q4(x, rows, k, ldx, codes, high, *rest)
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
            codes = codes | (self._fifth_bits(panel, col) << 4)
        g = self.group_size
        w = codes.float() * self.scales[panel, :, col].float().repeat_interleave(g, dim=1)
        if self.mins is not None:
            w += self.mins[panel, :, col].float().repeat_interleave(g, dim=1)
        return w

    def _fifth_bits(self, panel: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """The fifth bits of columns (panel, col) from the plane [panel, K / chunk, half, low/high nibble,
        unit / 8 bytes], [len(col), K] uint8 in the input's order (as the nibbles are read back)."""
        assert self.high is not None
        plane = self.high[panel, :, col // 16]  # [rows, K / chunk, 2, unit / 8]
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
        nibbles = self.bits in (4, 5)
        return LinearDesc(
            kind=4 if dot else 2 if nibbles else 3,
            q4=int(nibbles),
            half_scales=int(self.scales.dtype == torch.float16),
            codes=self.codes.data_ptr(),
            scale=self.scales.data_ptr(),
            mins=None if self.mins is None else self.mins.data_ptr(),
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
        mins = None if self.mins is None else self.mins.data_ptr()
        half = int(self.scales.dtype == torch.float16)
        bias = None if self.bias is None else self.bias.data_ptr()
        res = None if residual is None else residual.data_ptr()
        self._kernel(
            x.data_ptr(),
            rows,
            self.in_features,
            ldx,
            self.codes.data_ptr(),
            self.scales.data_ptr(),
            mins,
            half,
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
