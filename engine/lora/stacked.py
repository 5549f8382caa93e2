"""A step's adapters stacked for the Triton shrink/expand kernels (kernels/lora_shrink_expand.py): the GPU
twin of the CPU kernel's per-adapter descriptors.

An adapter's fused projection keeps its CPU layout (engine/lora/adapter.py: A_t [in, pieces x rank], B_t
block-diagonal [pieces x rank, fused out], each piece's output columns in `cols`). The kernels want the
pieces as slices, every adapter of the step side by side: a [slices, adapters, rank, in] and b [slices,
adapters, width, rank], ranks zero-padded to the step's largest. The slices are the pieces' column ranges
(the union over the step's adapters, so an adapter on q and v only still gets its slices; a gap no adapter
writes becomes a slice of zero weights, which adds nothing). The scale stays folded into B.

Stacking copies the adapters' weights to the device, so it is done once per set of adapters: steps that mix
the same adapters reuse the stacks (one set is kept; a step with another set replaces it, and the old
adapters' device copies go with it). Adapters whose pieces overlap without coinciding (two layouts of one
fused projection) cannot share a slice grid: `stack` returns None and the caller adds them with the torch
reference. Not run on a GPU here: tests/engine/test_lora_stacked.py checks it through Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from specfleet.engine.lora.adapter import LoraAdapter, LoraWeights


@dataclass(frozen=True)
class StackedProjection:
    a: torch.Tensor  # [slices, adapters, rank, in]
    b: torch.Tensor  # [slices, adapters, width, rank]
    slice_starts: torch.Tensor  # [slices + 1] int32 on the device: slice i writes columns [i] .. [i + 1]


def _pieces(w: LoraWeights) -> list[tuple[int, int, int]]:
    """(first column, end column, piece index) of each piece of an adapter's fused projection."""
    return [(int(c0), int(c1), j) for j, (c0, c1) in enumerate(w.cols.tolist())]


def slice_bounds(weights: Sequence[LoraWeights | None]) -> list[int] | None:
    """The slices' column starts (and the last one's end) covering every piece of `weights`, gaps filled;
    None when two pieces overlap without being the same range."""
    ranges = sorted({(c0, c1) for w in weights if w is not None for c0, c1, _ in _pieces(w)})
    if not ranges:
        return None
    bounds = [ranges[0][0]]
    for c0, c1 in ranges:
        if c0 < bounds[-1]:
            return None  # overlaps the previous range
        if c0 > bounds[-1]:
            bounds.append(c0)  # a gap no adapter writes: a slice of zeros
        bounds.append(c1)
    return bounds


def stack(
    weights: Sequence[LoraWeights | None], device: torch.device, dtype: torch.dtype
) -> StackedProjection | None:
    """weights[g]: adapter g's weights on one fused projection (None: it leaves the projection alone).
    None when no adapter touches the projection or their pieces cannot share slices."""
    bounds = slice_bounds(weights)
    if bounds is None:
        return None
    slices = len(bounds) - 1
    ranks = [w.a_t.shape[1] // w.cols.shape[0] for w in weights if w is not None]
    rank, width = max(ranks), max(bounds[i + 1] - bounds[i] for i in range(slices))
    fan_in = next(w.a_t.shape[0] for w in weights if w is not None)
    a = torch.zeros(slices, len(weights), rank, fan_in, dtype=dtype)
    b = torch.zeros(slices, len(weights), width, rank, dtype=dtype)
    for g, w in enumerate(weights):
        if w is None:
            continue
        r = w.a_t.shape[1] // w.cols.shape[0]
        for c0, c1, j in _pieces(w):
            sl = bounds.index(c0)
            a[sl, g, :r] = w.a_t[:, j * r : (j + 1) * r].t()
            b[sl, g, : c1 - c0, :r] = w.b_t[j * r : (j + 1) * r, c0:c1].t()
    starts = torch.tensor(bounds, dtype=torch.int32)
    return StackedProjection(a.to(device), b.to(device), starts.to(device))


class StackCache:
    """The stacks of one set of adapters (the last step's), built per (layer, projection) on first use."""

    def __init__(self) -> None:
        self._key: tuple[LoraAdapter, ...] = ()
        self._stacks: dict[tuple[int, str, torch.dtype, torch.device], StackedProjection | None] = {}

    def get(
        self,
        adapters: tuple[LoraAdapter, ...],
        layer: int,
        proj: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> StackedProjection | None:
        if adapters != self._key:  # identity: a reloaded adapter is another object, so it is restacked
            self._key, self._stacks = adapters, {}
        key = (layer, proj, dtype, device)
        if key not in self._stacks:
            self._stacks[key] = stack([a.layers[layer].get(proj) for a in adapters], device, dtype)
        return self._stacks[key]

    def clear(self) -> None:
        self._key, self._stacks = (), {}


STACKS = StackCache()  # one engine per process: its runner's steps share it
