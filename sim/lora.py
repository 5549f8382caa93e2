"""LoRA adapters in a simulated engine: the engine's own admission rule and the cost of loading adapters.

A request's adapter (`SimRequest.adapter`) rides on its sequence as the engine's does (`Sequence.lora`,
as a `SimLora`), so
the real scheduler applies `--max-loras`: a waiting request whose adapter would make the running batch
mix more adapters than that is passed over until one drains. A step that first runs an adapter the engine
does not hold in host memory (its `--max-cpu-loras` LRU, default `max_loras`) is longer by the adapter's
load time, which the engine spends between two steps (engine/lora: the read and checks of the files);
measure it with the engine's `specfleet_lora_adapter_load_seconds`. A step whose sequences run on adapters is
longer by what the profile measured them to add (`Profile.lora_s`, from `specfleet profile --lora-rank`):
per token on an adapter and per distinct adapter in the step (`adapter_work`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimLora:
    """What the engine's scheduler and block manager read of a request's adapter (`Sequence.lora`): one
    adapter per name (the scheduler counts distinct ones) and the prefix cache's key (LoraAdapter.cache_key;
    the simulated adapters are never reloaded, so the name is enough)."""

    name: str

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.name, "")

    def __str__(self) -> str:
        return self.name


def adapter_work(work: Iterable[tuple[object, int]]) -> tuple[int, int]:
    """(tokens on an adapter, distinct adapters) of a step, from each sequence's (adapter or None, tokens
    in the step): what `Profile.lora_s` prices."""
    tokens, names = 0, set()
    for adapter, n in work:
        if adapter is not None:
            tokens += n
            names.add(str(adapter))
    return tokens, len(names)


@dataclass
class SimAdapters:
    max_loras: int  # --max-loras: adapters one step may mix
    load_s: float  # one adapter's load (the engine's specfleet_lora_adapter_load_seconds)
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras, the engine's default)
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recently used first
    loads: int = 0

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be >= 1")
        if self.load_s < 0:
            raise ValueError(f"load_s={self.load_s} must be >= 0")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")

    def step_load_s(self, adapters: Iterable[object]) -> float:
        """Seconds a step that runs `adapters` (None: the base) spends loading the ones not resident."""
        seconds = 0.0
        for name in sorted({str(a) for a in adapters if a is not None}):
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            self.resident[name] = None
            self.loads += 1
            seconds += self.load_s
            while len(self.resident) > (self.max_cpu_loras or self.max_loras):
                self.resident.popitem(last=False)
        return seconds
