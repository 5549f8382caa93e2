"""The engine's adapters: names the engine knows (and where their files are), the ones held in host memory
(an LRU of at most `max_cpu_loras`), their load and eviction counts, and each served adapter's speculative
draft and accepted tokens (the draft proposes without the adapter, so its acceptance differs by adapter).

A known adapter that was evicted is read again from its path on its next request. A request holds its
adapter object until it finishes, so unloading or reloading a name never changes what an in-flight request
runs: it finishes on the weights it started with.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from specfleet.engine.lora.adapter import LoraAdapter, LoraError, ModelShape, read_adapter

log = logging.getLogger("specfleet.engine")


@dataclass
class LoraStats:
    loads: int = 0
    evictions: int = 0
    load_seconds: list[float] = field(default_factory=list)  # each load's time, drained by the metrics
    # adapter name -> [draft tokens verified, of those accepted]: served adapters only, dropped on unload
    drafts: dict[str, list[int]] = field(default_factory=dict)


class LoraManager:
    def __init__(
        self,
        shape: ModelShape,
        base_name: str,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype = torch.float32,
    ):
        self.shape, self.base_name, self.max_rank = shape, base_name, max_rank
        self.max_cpu_loras, self.dtype = max_cpu_loras, dtype
        self.paths: dict[str, str] = {}  # name -> folder, every adapter the engine serves
        self.resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.stats = LoraStats()

    def check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise LoraError("lora_name must be a non-empty string")
        if name == self.base_name:
            raise LoraError(f"lora_name={name!r} shadows the served model's name; pick another name")

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read, check and register adapter `name` from `path` (a reload replaces the files it serves)."""
        return self.register(*self.read(name, path))

    def read(self, name: str, path: str) -> tuple[LoraAdapter, float]:
        """The adapter's files read and checked, and the seconds that took; changes nothing here, so it may
        run on a worker thread while the engine steps (the engine core does: a load never blocks streams)."""
        self.check_name(name)
        start = time.perf_counter()
        adapter = read_adapter(name, path, self.shape, self.max_rank, self.dtype)
        return adapter, time.perf_counter() - start

    def register(self, adapter: LoraAdapter, seconds: float) -> LoraAdapter:
        """Serve a read adapter under its name (on the engine's thread, between steps)."""
        self.stats.loads += 1
        self.stats.load_seconds.append(seconds)
        self.paths[adapter.name] = str(Path(adapter.path))
        self._keep(adapter)
        log.info(
            "event=lora_loaded name=%s rank=%d digest=%s modules=%s ms=%.1f",
            adapter.name,
            adapter.rank,
            adapter.digest,
            ",".join(adapter.target_modules),
            seconds * 1000,
        )
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.paths:
            raise LoraError(f"lora_name={name!r} is not loaded (loaded: {', '.join(self.paths) or 'none'})")
        del self.paths[name]
        self.resident.pop(name, None)
        self.stats.drafts.pop(name, None)
        log.info("event=lora_unloaded name=%s", name)

    def count_drafts(self, per_adapter: dict[str, list[int]]) -> None:
        """Add a step's [draft tokens, accepted] per adapter name; requests still finishing on an adapter
        unloaded meanwhile are not counted (its series is gone)."""
        for name, (drafted, accepted) in per_adapter.items():
            if name in self.paths:
                total = self.stats.drafts.setdefault(name, [0, 0])
                total[0] += drafted
                total[1] += accepted

    def get(self, name: str) -> LoraAdapter:
        """The adapter a request names, read again from its path when the LRU evicted it."""
        adapter = self.resident.get(name)
        if adapter is not None:
            self.resident.move_to_end(name)
            return adapter
        if name not in self.paths:
            raise LoraError(f"model {name!r} is neither the served model nor a loaded LoRA adapter")
        return self.load(name, self.paths[name])

    def _keep(self, adapter: LoraAdapter) -> None:
        self.resident.pop(adapter.name, None)
        self.resident[adapter.name] = adapter
        while len(self.resident) > self.max_cpu_loras:
            evicted, _ = self.resident.popitem(last=False)
            self.stats.evictions += 1
            log.info("event=lora_evicted name=%s reason=max_cpu_loras=%d", evicted, self.max_cpu_loras)

    def names(self) -> dict[str, str]:
        """name -> path of every adapter served, in load order."""
        return dict(self.paths)
