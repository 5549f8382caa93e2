"""LoRA adapter affinity: a request whose `model` names an adapter goes to an engine where that adapter is
active, else where it has a free adapter slot, else (all of those over the load cap) to the least loaded
engine that serves it, which then takes it into a slot (the engine mixes up to --max-loras adapters per
step; a request for another waits for a slot).

What each engine serves comes from its `/v1/models` (the entries with a `parent`: adapters loaded, by
`--lora-modules` or by the operator through the admin API) and which adapters are active, and how many
slots it has, from vLLM's `vllm:lora_requests_info` gauge on its `/metrics` (labels `max_lora`,
`running_lora_adapters`, `waiting_lora_adapters`; the latest sample counts), as llm-d's lora-affinity
scorer reads them. Engines that do not serve the adapter are never picked while one does (they would
answer 404); when none does, the request goes as any other and the engine's 404 lists what it serves.

The prefix index keys an adapter's blocks apart (prefix.BlockHasher.salted_seed): the same prompt under two adapters, or
under an adapter and the base, never counts as a shared prefix (the engine keys its cache the same way).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from .endpoints import Endpoint, EndpointSet
from .policies import load_cap

logger = logging.getLogger("specfleet.router")

# How often each engine is asked: an adapter loaded by the operator is routed to within this; the calls
# are two small GETs per engine (llm-d refreshes its LoRA metrics every 50 ms from a sidecar; 1 s is
# enough for adapters that are loaded once and stay).
POLL_SECONDS = 1.0
# Over the load cap (policies.load_cap, KubeAI's 125%), an engine with the adapter active is saturated and
# the request spills to a less loaded engine that serves it.
LOAD_FACTOR = 1.25
_INFO = re.compile(r"^vllm:lora_requests_info\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class AdapterState:
    loaded: frozenset[str] = frozenset()  # adapters the engine serves (/v1/models)
    active: frozenset[str] = frozenset()  # adapters with requests running or waiting there
    max_loras: int = 0  # adapters one step may mix (0: not reported)

    def has_slot(self) -> bool:
        return self.max_loras == 0 or len(self.active) < self.max_loras


def parse_lora_info(text: str) -> tuple[frozenset[str], int]:
    """The latest `vllm:lora_requests_info` sample of a /metrics page: (running ∪ waiting, max_lora)."""
    latest: tuple[float, dict[str, str]] | None = None
    for match in _INFO.finditer(text):
        labels = dict(_LABEL.findall(match["labels"]))
        value = float(match["value"])
        if latest is None or value >= latest[0]:
            latest = (value, labels)
    if latest is None:
        return frozenset(), 0
    labels = latest[1]
    names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
    return frozenset(n for n in names.split(",") if n), int(labels.get("max_lora") or 0)


def adapter_candidates(
    adapter: str, endpoints: Sequence[Endpoint], states: dict[str, AdapterState]
) -> list[Endpoint]:
    """The engines a request for `adapter` may go to, best tier first that has an engine under the cap:
    adapter active; adapter served with a free slot; adapter served (spill, least loaded first)."""
    serving = [e for e in endpoints if adapter in states.get(e.url, AdapterState()).loaded]
    if not serving:
        return list(endpoints)
    cap = load_cap(serving, LOAD_FACTOR)
    under = [e for e in serving if e.outstanding + 1 <= cap]
    active = [e for e in under if adapter in states[e.url].active]
    if active:
        return active
    free = [e for e in under if states[e.url].has_slot()]
    if free:
        return free
    least = min(e.outstanding for e in serving)
    return [e for e in serving if e.outstanding == least]


@dataclass
class AdapterTable:
    """Per engine, the adapters it serves and has active, refreshed by `run`."""

    states: dict[str, AdapterState] = field(default_factory=dict)

    def known(self, name: object) -> bool:
        return isinstance(name, str) and any(name in s.loaded for s in self.states.values())

    def candidates(self, adapter: str, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        return adapter_candidates(adapter, endpoints, self.states)

    async def _read(self, session: aiohttp.ClientSession, url: str) -> AdapterState | None:
        try:
            async with session.get(f"{url}/v1/models") as response:
                if response.status != 200:
                    return None
                models = (await response.json(content_type=None)).get("data") or []
            loaded = frozenset(m["id"] for m in models if isinstance(m, dict) and m.get("parent"))
            if not loaded:
                return AdapterState()
            async with session.get(f"{url}/metrics") as response:
                active, max_loras = (
                    parse_lora_info(await response.text()) if response.status == 200 else ((), 0)
                )
            return AdapterState(loaded, frozenset(active), max_loras)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, AttributeError):
            return None

    async def refresh(self, session: aiohttp.ClientSession, endpoints: EndpointSet) -> None:
        urls = [e.url for e in endpoints.routable()]
        read = await asyncio.gather(*(self._read(session, u) for u in urls))
        self.states = {u: s for u, s in zip(urls, read, strict=True) if s is not None}

    async def run(self, endpoints: EndpointSet, interval_s: float = POLL_SECONDS) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while True:
                await self.refresh(session, endpoints)
                await asyncio.sleep(interval_s)
