"""LoRA deltas of a mixed-adapter step, gathered by adapter: the native kernel (kernels/cpu/lora.cpp,
`sf_lora_add_f32`) and its torch reference, side by side.

A step's rows are laid out once (`RowGroups`: the rows of each adapter, one group after the other); each
projection of each layer then adds `(x[rows] @ A_t) @ B_t` to `y[rows]` for every group in one call.
`describe` turns an adapter's fused A_t / B_t into the kernel's descriptor once, when the adapter loads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from specfleet.kernels.cpu_build import _check, _lib_or_raise, _rows, num_threads

MAX_RANK_SUM = 512  # the kernel's per-row accumulator (lora.cpp shrink): 7 pieces x rank 64 = 448 fit


class LoraDesc(ctypes.Structure):
    """sf_lora_weights (kernels/cpu/lora.cpp): one adapter on one projection."""

    _fields_ = [
        ("a_t", ctypes.c_void_p),
        ("b_t", ctypes.c_void_p),
        ("K", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("R", ctypes.c_int64),
        ("r", ctypes.c_int64),
        ("cols", ctypes.c_void_p),
    ]
    _tensors: tuple[torch.Tensor, ...]  # what the pointers point into, kept alive with the descriptor


def describe(a_t: torch.Tensor, b_t: torch.Tensor, rank: int, cols: torch.Tensor) -> LoraDesc:
    """The descriptor of y += (x @ a_t) @ b_t, a_t [K, R], b_t [R, N], R = pieces x `rank`; cols [pieces, 2]
    int64: the output columns of each piece (its rows of b_t are zero elsewhere)."""
    _check("a_t", a_t, dim=2)
    _check("b_t", b_t, dim=2)
    _check("cols", cols, torch.int64, dim=2)
    (k, big_r), n = a_t.shape, b_t.shape[1]
    if not (a_t.is_contiguous() and b_t.is_contiguous() and cols.is_contiguous()):
        raise ValueError("a_t, b_t and cols must be contiguous")
    if b_t.shape[0] != big_r or rank < 1 or big_r % rank or big_r > MAX_RANK_SUM:
        raise ValueError(
            f"a_t {tuple(a_t.shape)} and b_t {tuple(b_t.shape)} need the same rank sum R, a multiple of "
            f"rank={rank} and at most {MAX_RANK_SUM}"
        )
    if tuple(cols.shape) != (big_r // rank, 2) or bool((cols[:, 0] > cols[:, 1]).any()):
        raise ValueError(f"cols must be [{big_r // rank}, 2] column ranges, got {cols.tolist()}")
    if bool((cols < 0).any()) or bool((cols > n).any()):
        raise ValueError(f"cols {cols.tolist()} fall outside b_t's {n} columns")
    desc = LoraDesc(a_t.data_ptr(), b_t.data_ptr(), k, n, big_r, rank, cols.data_ptr())
    desc._tensors = (a_t, b_t, cols)
    return desc


@dataclass(frozen=True)
class RowGroups:
    """A step's rows grouped by adapter: group g owns rows[starts[g] : starts[g + 1]]."""

    rows: torch.Tensor  # [n] int64, each row of the step at most once
    starts: torch.Tensor  # [groups + 1] int64, starts[0] = 0

    @classmethod
    def of(cls, groups: Sequence[Sequence[int]]) -> RowGroups:
        starts = [0]
        for g in groups:
            starts.append(starts[-1] + len(g))
        rows = torch.tensor([r for g in groups for r in g], dtype=torch.int64)
        return cls(rows, torch.tensor(starts, dtype=torch.int64))

    def group(self, g: int) -> torch.Tensor:
        return self.rows[int(self.starts[g]) : int(self.starts[g + 1])]


class LoraStep(ctypes.Structure):
    """sf_lora_step (kernels/cpu/native.cpp): a step's adapters for the fused decode layers (DecodeLayers)."""

    _fields_ = [
        ("groups", ctypes.c_int64),
        ("group_start", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
    ]
    _keep: tuple[object, ...]  # what the pointers point into


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the order of sf_lora_step's weights within a layer


def lora_step(groups: RowGroups, weights: Sequence[Sequence[Sequence[LoraDesc | None]]]) -> LoraStep:
    """weights[layer][projection, in PROJECTIONS' order][group]: the descriptors DecodeLayers adds."""
    flat = [w for layer in weights for proj in layer for w in proj]
    count = groups.starts.numel() - 1
    if any(len(proj) != count for layer in weights for proj in layer) or any(len(la) != 4 for la in weights):
        raise ValueError(f"weights must be [layers, {len(PROJECTIONS)}, {count} groups]")
    pointers = (ctypes.c_void_p * len(flat))(*(ctypes.addressof(w) if w else None for w in flat))
    step = LoraStep(count, groups.starts.data_ptr(), groups.rows.data_ptr(), ctypes.addressof(pointers))
    step._keep = (groups, pointers, flat)
    return step


def lora_add(
    y: torch.Tensor, x: torch.Tensor, groups: RowGroups, weights: Sequence[LoraDesc | None]
) -> torch.Tensor:
    """y [T, N] += (x[rows] @ A_t) @ B_t for each group's rows, in place; weights[g]: group g's adapter on
    this projection (None: it leaves the projection alone). Returns y."""
    if len(weights) != groups.starts.numel() - 1:
        raise ValueError(f"{len(weights)} weights for {groups.starts.numel() - 1} row groups")
    present = [w for w in weights if w is not None]
    if not present:
        return y
    k, n = present[0].K, present[0].N
    if any(w.K != k or w.N != n for w in present):
        raise ValueError("every group's weights must be for the same projection (same K and N)")
    ldx, ldy = _rows("x", x, k), _rows("y", y, n)
    rows = groups.rows
    if x.shape[0] != y.shape[0] or (rows.numel() and int(rows.max()) >= y.shape[0]):
        raise ValueError(f"x {tuple(x.shape)}, y {tuple(y.shape)}: rows must index both")
    pointers = (ctypes.c_void_p * len(weights))(*(ctypes.addressof(w) if w else None for w in weights))
    _lib_or_raise().sf_lora_add_f32(
        x.data_ptr(),
        ldx,
        y.data_ptr(),
        ldy,
        len(weights),
        groups.starts.data_ptr(),
        rows.data_ptr(),
        pointers,
        num_threads(),
    )
    return y


def lora_add_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    groups: RowGroups,
    weights: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
) -> torch.Tensor:
    """The same in torch, weights[g] = (a_t, b_t): gather each group's rows, shrink, expand, add back."""
    for g, w in enumerate(weights):
        if w is None:
            continue
        rows = groups.group(g)
        a_t, b_t = w[0].to(x.dtype), w[1].to(x.dtype)
        if rows.numel() == y.shape[0]:  # every row of the step (each row is in one group at most)
            y.addmm_(x @ a_t, b_t)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
    return y
