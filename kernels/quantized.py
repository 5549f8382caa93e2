"""One in-memory form for grouped weight-only quantization, whatever the checkpoint's format.

GGUF Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0, AWQ and GPTQ all store a weight [out, in] as small integer codes with, per
output row and group of ``group_size`` input columns, a scale and an offset:
``W[n, k] = codes[n, k] * scales[n, k // G] + mins[n, k // G]``. The format readers (engine/quant/)
decode each format into a `QuantTensor`; the kernels (native CPU: kernels/cpu_native.py, Triton:
kernels/quant_matmul.py) pack it into their own layouts. Keeping one form means one kernel per code
width (4, 5 or 8 bits) instead of one per format, and one reference (`dequantize`) for every test.

GPTQ act-order checkpoints quantize input columns in a permuted order; `perm` records it: the weight's
column ``j`` multiplies ``x[:, perm[j]]``, so ``y = x[:, perm] @ W.T``.

GGUF's K-quants (Q4_K, Q5_K, Q6_K) build every scale and offset from two levels: a small integer per group
and a half per 256-value super-block. `SuperScales` keeps that factorization beside the float32 scales, so
that the kernels can stream the file's own few bits per group and form ``d * sc`` as they go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

SUPER_BLOCK = 256  # values per GGUF K-quant super-block, the span of one `SuperScales.d`


@dataclass(frozen=True)
class SuperScales:
    """Scales and offsets as products, exactly as GGUF's K-quants store them: for group g of row n,
    ``scale = d[n, g // per] * sc[n, g]`` and ``min = dmin[n, g // per] * m[n, g]`` (float32 products of a
    half and a small integer: exact), with ``per = 256 // group_size``. Q4_K/Q5_K: 6-bit sc and m, dmin the
    file's dmin negated; Q6_K: int8 sc, and its codes' -32 offset as ``m = sc`` (the same tensor: no bytes
    of its own) with ``dmin = -32 d``."""

    sc: torch.Tensor  # [N, K // group_size] int8
    d: torch.Tensor  # [N, K // 256] float16
    m: torch.Tensor | None  # [N, K // group_size] int8, None for symmetric codes; may be `sc` itself
    dmin: torch.Tensor | None  # [N, K // 256] float16, None with m

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SuperScales:
        """`fn` applied to every tensor, keeping ``m is sc`` where it was."""
        sc = fn(self.sc)
        m = None if self.m is None else sc if self.m is self.sc else fn(self.m)
        return SuperScales(sc, fn(self.d), m, None if self.dmin is None else fn(self.dmin))

    def scales(self, group_size: int) -> torch.Tensor:
        per = SUPER_BLOCK // group_size
        return self.d.float().repeat_interleave(per, dim=1) * self.sc.float()

    def mins(self, group_size: int) -> torch.Tensor | None:
        if self.m is None or self.dmin is None:
            return None
        return self.dmin.float().repeat_interleave(SUPER_BLOCK // group_size, dim=1) * self.m.float()


@dataclass(frozen=True)
class QuantTensor:
    codes: torch.Tensor  # [N, K] uint8 codes 0..2**bits - 1 (bits=4, 5, 6) or int8 (bits=8)
    scales: torch.Tensor  # [N, K // group_size] float32
    mins: torch.Tensor | None  # [N, K // group_size] float32 offsets, None for symmetric codes
    group_size: int
    bits: int
    fmt: str  # where it came from ("gguf:Q4_1", "awq", "gptq"), for logs and errors
    perm: torch.Tensor | None = None  # [K] int64 input order of the columns, None for the identity
    two_level: SuperScales | None = None  # scales and mins as GGUF K-quants store them (equal to them)

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"{self.fmt}: bits={self.bits} is not 4, 5, 6 or 8")
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.codes.dtype != want:
            raise ValueError(f"{self.fmt}: {self.bits}-bit codes must be {want}, got {self.codes.dtype}")
        if self.group_size < 2 or self.group_size % 2 or k % self.group_size:
            raise ValueError(
                f"{self.fmt}: group_size={self.group_size} must be even and divide the input size {k}"
            )
        groups = (n, k // self.group_size)
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is not None and (tuple(t.shape) != groups or t.dtype != torch.float32):
                raise ValueError(
                    f"{self.fmt}: {name} must be float32 {groups}, got {t.dtype} {tuple(t.shape)}"
                )
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"{self.fmt}: perm must have {k} entries, got {tuple(self.perm.shape)}")
        if self.two_level is not None:
            self._check_two_level(self.two_level, groups)

    def _check_two_level(self, t: SuperScales, groups: tuple[int, int]) -> None:
        n, k = self.codes.shape
        supers = (n, k // SUPER_BLOCK)
        if k % SUPER_BLOCK or SUPER_BLOCK % self.group_size or (t.m is None) != (self.mins is None):
            raise ValueError(
                f"{self.fmt}: two-level scales need {SUPER_BLOCK}-value super-blocks of whole groups and "
                f"offsets where the weight has them (K={k}, group_size={self.group_size})"
            )
        for name, v, shape, dtype in (
            ("sc", t.sc, groups, torch.int8),
            ("m", t.m, groups, torch.int8),
            ("d", t.d, supers, torch.float16),
            ("dmin", t.dmin if t.m is not None else None, supers, torch.float16),
        ):
            if (v is None and name == "dmin" and t.m is not None) or (
                v is not None and (tuple(v.shape) != shape or v.dtype != dtype)
            ):
                got = None if v is None else (v.dtype, tuple(v.shape))
                raise ValueError(f"{self.fmt}: two-level {name} must be {dtype} {shape}, got {got}")

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return rows, cols

    @property
    def packed_bytes(self) -> int:
        """Bytes the kernels stream per step: packed codes plus float32 scales and offsets (or, with
        `two_level`, their int8 factors per group and halfs per super-block)."""
        n, k = self.shape
        groups = n * (k // self.group_size)
        codes = n * k * self.bits // 8
        t = self.two_level
        if t is None:
            return codes + groups * 4 * (1 if self.mins is None else 2)
        own_m = t.m is not None and t.m is not t.sc
        return codes + groups * (2 if own_m else 1) + n * (k // SUPER_BLOCK) * 2 * (1 if t.m is None else 2)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] in the input's own column order: the reference for every kernel."""
        g = self.group_size
        w = self.codes.float() * self.scales.repeat_interleave(g, dim=1)
        if self.mins is not None:
            w += self.mins.repeat_interleave(g, dim=1)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def select_rows(self, index: torch.Tensor) -> QuantTensor:
        """Output rows in a new order (undoing GGUF's q/k row permutation works on the codes as is)."""
        return replace(
            self,
            codes=self.codes.index_select(0, index),
            scales=self.scales.index_select(0, index),
            mins=None if self.mins is None else self.mins.index_select(0, index),
            two_level=None
            if self.two_level is None
            else self.two_level.map(lambda t: t.index_select(0, index)),
        )

    def widened(self, bits: int) -> QuantTensor:
        """The same weight with `bits`-wide codes (4 -> 5 keeps the uint8 codes; -> 8 makes them int8), so
        that it can share a kernel with wider parts. Exact: an int8 code ``q - 2**(b-1)`` with no offset
        replaces ``q`` when the offsets are exactly ``-2**(b-1)`` times the scales (GGUF Q4_0, Q5_0)."""
        if bits == self.bits:
            return self
        if bits < self.bits or bits not in (5, 6, 8):
            raise ValueError(f"{self.fmt}: {self.bits}-bit codes cannot widen to {bits} bits")
        if bits < 8:
            return replace(self, bits=bits)
        half = 1 << (self.bits - 1)
        if self.mins is not None and torch.equal(self.mins, self.scales * -half):
            codes = (self.codes.to(torch.int16) - half).to(torch.int8)
            t = self.two_level
            two_level = None if t is None else replace(t, m=None, dmin=None)
            return replace(self, codes=codes, mins=None, bits=8, two_level=two_level)
        return replace(self, codes=self.codes.to(torch.int8), bits=8)

    def regrouped(self, group_size: int) -> QuantTensor:
        """The same weight with smaller groups (each scale and offset repeated): exact, for a part that shares a
        kernel with parts of finer groups (Q4_K's 32 beside Q6_K's 16)."""
        if self.group_size % group_size:
            raise ValueError(
                f"{self.fmt}: groups of {self.group_size} cannot split into groups of {group_size}"
            )
        r = self.group_size // group_size
        if r == 1:
            return self
        t = self.two_level
        return replace(
            self,
            scales=self.scales.repeat_interleave(r, dim=1),
            mins=None if self.mins is None else self.mins.repeat_interleave(r, dim=1),
            group_size=group_size,
            two_level=None
            if t is None
            else SuperScales(
                t.sc.repeat_interleave(r, dim=1),
                t.d,
                None if t.m is None else t.m.repeat_interleave(r, dim=1),
                t.dmin,
            ),
        )

    def with_mins(self) -> QuantTensor:
        """The same weight with explicit (zero) offsets, to share a kernel with asymmetric parts."""
        if self.mins is not None:
            return self
        t = self.two_level
        two_level = None if t is None else replace(t, m=torch.zeros_like(t.sc), dmin=torch.zeros_like(t.d))
        return replace(self, mins=torch.zeros_like(self.scales), two_level=two_level)

    @staticmethod
    def cat(parts: Sequence[QuantTensor]) -> QuantTensor | None:
        """Stack along the output dim (fused q/k/v, gate/up); None when the parts cannot share a kernel
        (input sizes, column orders, or group sizes that do not divide each other). Parts of different code
        widths are widened to the widest (Q4_K_M puts Q5_0 on SmolLM2's q/k and Q8_0 on its v), parts of
        coarser groups take the finest (Q4_K's 32 beside Q6_K's 16 in half of a 2048-wide model's v), and
        symmetric parts get zero offsets beside asymmetric ones: all exact, and far smaller than the float32
        weight a group that cannot fuse takes."""
        first = parts[0]
        group = min(p.group_size for p in parts)
        for p in parts[1:]:
            if p.shape[1] != first.shape[1] or not _same_perm(p.perm, first.perm):
                return None
        if any(p.group_size % group for p in parts):
            return None
        bits = max(p.bits for p in parts)
        parts = [p.regrouped(group).widened(bits) for p in parts]
        if any(p.mins is None for p in parts) and any(p.mins is not None for p in parts):
            parts = [p.with_mins() for p in parts]
        mins = [p.mins for p in parts if p.mins is not None]
        return replace(
            parts[0],
            codes=torch.cat([p.codes for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            mins=torch.cat(mins) if mins else None,
            fmt="+".join(dict.fromkeys(p.fmt for p in parts)),
            two_level=_cat_two_level(parts),
        )


def _cat_two_level(parts: Sequence[QuantTensor]) -> SuperScales | None:
    """The parts' two-level scales stacked, or None (float32 scales only) unless every part has them."""
    levels = [p.two_level for p in parts]
    if any(t is None for t in levels):
        return None
    ts = [t for t in levels if t is not None]
    m = [t.m for t in ts if t.m is not None]
    dmin = [t.dmin for t in ts if t.dmin is not None]
    return SuperScales(
        torch.cat([t.sc for t in ts]),
        torch.cat([t.d for t in ts]),
        torch.cat(m) if m else None,
        torch.cat(dmin) if dmin else None,
    )


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(torch.equal(a, b))


def as_float(w: torch.Tensor | QuantTensor) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantTensor) else w


def cat_rows(parts: Sequence[torch.Tensor | QuantTensor]) -> torch.Tensor | QuantTensor:
    """Fuse weights along the output dim, keeping them quantized when every part shares one layout;
    otherwise every part is dequantized (a mixed group runs on the float32 path)."""
    if all(isinstance(p, QuantTensor) for p in parts):
        fused = QuantTensor.cat(parts)  # type: ignore[arg-type]
        if fused is not None:
            return fused
    return torch.cat([as_float(p) for p in parts], dim=0)
