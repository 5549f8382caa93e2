"""One step's adapters: which rows of the batch run which adapter, and the deltas they add.

In the spirit of Punica's shrink/expand: for each adapter in the step, its rows are gathered, shrunk to the
adapter's rank (`x @ A^T`) and expanded into the projection's columns (`@ B^T`, scale folded in), then
added back to those rows. On CPU with float32 weights one native call per projection does every adapter of
the step (kernels/cpu_lora.py); otherwise its torch reference does, adapter by adapter. Rows without an
adapter are untouched, so a base-only batch pays nothing (the runner attaches no LoraBatch at all then, and
the native fused decode path stays on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from specfleet.engine.lora.adapter import LoraAdapter
from specfleet.engine.lora.stacked import STACKS, StackCache
from specfleet.kernels import cpu_build, cpu_lora

if TYPE_CHECKING:
    from specfleet.kernels.lora_shrink_expand import LoraMapping


@dataclass(frozen=True)
class LoraBatch:
    adapters: tuple[LoraAdapter, ...]  # one per row group, in the groups' order
    groups: cpu_lora.RowGroups
    native: bool  # the native kernel runs the deltas (CPU, float32, kernels built)
    # the Triton kernels run them (CUDA; or CPU tensors through the interpreter, when built with triton=True)
    mapping: LoraMapping | None = None
    stacks: StackCache = STACKS

    @classmethod
    def build(
        cls,
        spans: list[tuple[LoraAdapter | None, int, int]],
        num_rows: int,
        device: torch.device,
        triton: bool | None = None,
    ) -> LoraBatch | None:
        """spans: (adapter or None, first row, row count) per scheduled sequence. None: no adapter in the step.
        triton: use the Triton kernels (default: on CUDA when triton is installed)."""
        by_adapter: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for adapter, start, count in spans:
            if adapter is not None and count:
                by_adapter.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + count))
        if not by_adapter:
            return None
        if triton is None:
            triton = device.type == "cuda" and _triton_installed()
        entries = list(by_adapter.values())
        if triton:  # a set of adapters in a stable order, so that its stacks are reused across steps
            entries.sort(key=lambda e: (e[0].name, e[0].digest, id(e[0])))
        adapters = tuple(a for a, _ in entries)
        groups = cpu_lora.RowGroups.of([rows for _, rows in entries])
        native = (
            not triton
            and device.type == "cpu"
            and cpu_build.available()
            and all(_described(a) for a in adapters)
        )
        if device.type != "cpu":
            groups = cpu_lora.RowGroups(groups.rows.to(device), groups.starts)
        mapping = None
        if triton:
            from specfleet.kernels.lora_shrink_expand import LoraMapping

            mapping = LoraMapping.of_groups(groups.rows, groups.starts, num_rows)
        return cls(adapters, groups, native, mapping)

    def native_step(self, num_layers: int) -> cpu_lora.LoraStep | None:
        """The step's adapters for the fused decode layers (every layer's four projections), or None when
        the native kernel does not run them (the per-layer path then adds them)."""
        if not self.native:
            return None
        weights = [
            [[_desc(a, layer, proj) for a in self.adapters] for proj in cpu_lora.PROJECTIONS]
            for layer in range(num_layers)
        ]
        return cpu_lora.lora_step(self.groups, weights)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """y [rows, out] += each group's delta from x [rows, in] on projection `proj` of `layer`; returns y."""
        weights = [a.layers[layer].get(proj) for a in self.adapters]
        if self.mapping is not None and any(w is not None for w in weights):
            stacked = self.stacks.get(self.adapters, layer, proj, x.device, x.dtype)
            if stacked is not None:
                from specfleet.kernels.lora_shrink_expand import lora_expand, lora_shrink

                s = lora_shrink(x, stacked.a, self.mapping)
                return lora_expand(y, s, stacked.b, stacked.slice_starts, self.mapping)
        if self.native and x.dtype == torch.float32 and y.dtype == torch.float32:
            return cpu_lora.lora_add(y, x, self.groups, [w.desc if w is not None else None for w in weights])
        pairs = [(w.a_t.to(x.device), w.b_t.to(x.device)) if w is not None else None for w in weights]
        return cpu_lora.lora_add_reference(y, x, self.groups, pairs)


def _desc(adapter: LoraAdapter, layer: int, proj: str) -> cpu_lora.LoraDesc | None:
    w = adapter.layers[layer].get(proj)
    return w.desc if w is not None else None


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _described(adapter: LoraAdapter) -> bool:
    """The adapter's weights have the native kernel's descriptors (all or none: float32 weights or not)."""
    first = next(w for ws in adapter.layers for w in ws.values())
    return first.desc is not None
