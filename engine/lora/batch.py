"""One step's adapters: which rows of the batch run which adapter, and the deltas they add.

In the spirit of Punica's shrink/expand: for each adapter in the step, its rows are gathered, shrunk to the
adapter's rank (`x @ A^T`) and expanded into the projection's columns (`@ B^T`, scale folded in), then
added back to those rows. Rows without an adapter are untouched, so a base-only batch pays nothing (the
runner attaches no LoraBatch at all then, and the native fused decode path stays on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specfleet.engine.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class LoraGroup:
    adapter: LoraAdapter
    rows: torch.Tensor  # [n] int64 flat token rows of the step that run this adapter
    all_rows: bool  # every row of the step: no gather or scatter needed


@dataclass(frozen=True)
class LoraBatch:
    groups: tuple[LoraGroup, ...]

    @classmethod
    def build(
        cls, spans: list[tuple[LoraAdapter | None, int, int]], num_rows: int, device: torch.device
    ) -> LoraBatch | None:
        """spans: (adapter or None, first row, row count) per scheduled sequence. None: no adapter in the step."""
        by_adapter: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for adapter, start, count in spans:
            if adapter is not None and count:
                by_adapter.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + count))
        if not by_adapter:
            return None
        groups = tuple(
            LoraGroup(a, torch.tensor(rows, dtype=torch.int64, device=device), len(rows) == num_rows)
            for a, rows in by_adapter.values()
        )
        return cls(groups)

    @property
    def adapters(self) -> list[LoraAdapter]:
        return [g.adapter for g in self.groups]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """y [rows, out] += each group's delta from x [rows, in] on projection `proj` of `layer`; returns y."""
        for g in self.groups:
            w = g.adapter.layers[layer].get(proj)
            if w is None:
                continue
            if g.all_rows:
                y.addmm_(x @ w.a_t.to(x.dtype), w.b_t.to(x.dtype))
            else:
                xs = x.index_select(0, g.rows)
                y.index_add_(0, g.rows, (xs @ w.a_t.to(x.dtype)) @ w.b_t.to(x.dtype))
        return y
