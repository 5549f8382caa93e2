"""Routing policies: which ready engine gets a request. Pure: no I/O and no clock, so the simulator and
the property tests drive them exactly as the proxy does.

A policy sees the routable endpoints with this router's in-flight counts and answers a `Choice` (the
engine, the reason, the estimated prefix match); the proxy then calls `routed` once it sent the request
there, so a policy's state (the round-robin cursor, the prefix index, session affinity) moves only with
what really happened.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .endpoints import Endpoint
from .prefix import PrefixIndex, stable_hash


@dataclass(frozen=True)
class RouteRequest:
    hashes: tuple[int, ...] = ()  # chained block hashes of the prompt (prefix.BlockHasher)
    session: str | None = None  # the session-affinity header's value, if any
    adapter: str | None = None  # the LoRA adapter `model` names (router/adapters.py), None for the base
    # The hashes are of the tokens the engine will prefill (a completion's prompt, or chat messages through
    # the model's chat template, by the model's tokenizer), so the engines' KV events can confirm them;
    # False for chat messages the router could not render as the engine does (router/chat_template.py),
    # which it flattens instead: their blocks never equal the engine's
    engine_hashes: bool = True


@dataclass(frozen=True)
class Choice:
    url: str
    reason: str  # a value of REASONS: the metric label and the log's reason=
    match_blocks: int = 0  # leading prompt blocks the chosen engine is estimated to hold


RING_MASK = 2**64 - 1  # ring points are unsigned 64-bit; block hashes are signed
REASONS = ("round-robin", "least-loaded", "prefix", "prefix-bounded", "session", "ring", "short-prompt")


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Choice | None: ...

    def routed(self, request: RouteRequest, url: str) -> None: ...

    def forget(self, url: str) -> None: ...


def load_cap(endpoints: Sequence[Endpoint], load_factor: float) -> int:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): no engine may hold
    more than ceil(c * (m + 1) / n) of the m + 1 requests in flight once this one is placed. The least
    loaded engine always fits (floor(m/n) + 1 = ceil((m+1)/n)), so the cap never leaves nowhere to go."""
    total = sum(e.outstanding for e in endpoints)
    return math.ceil(load_factor * (total + 1) / len(endpoints))


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Choice | None:
        if not endpoints:
            return None
        return Choice(endpoints[self._next % len(endpoints)].url, "round-robin")

    def routed(self, request: RouteRequest, url: str) -> None:
        self._next += 1

    def forget(self, url: str) -> None:
        pass


class LeastLoaded:
    """Fewest requests in flight through this router; ties rotate so a burst onto idle engines spreads."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Choice | None:
        if not endpoints:
            return None
        n = len(endpoints)
        order = [endpoints[(self._next + i) % n] for i in range(n)]
        return Choice(min(order, key=lambda e: e.outstanding).url, "least-loaded")

    def routed(self, request: RouteRequest, url: str) -> None:
        self._next += 1

    def forget(self, url: str) -> None:
        pass


@dataclass
class PrefixAffinity:
    """Longest estimated prefix match among the engines under the load cap; a new prefix goes where the
    consistent-hash ring puts its first block (so each tenant's prompt has one home while loads allow).

    Decisions, in order: the session's engine if the request names a session and that engine is under
    the cap (`session`); else the engine under the cap with the longest match, ties to the less loaded
    (`prefix`, or `prefix-bounded` when an engine with a longer match was over the cap); else, when no
    engine holds any block, the ring's first engine under the cap from the first block's hash (`ring`);
    a prompt shorter than one block goes to the least loaded (`short-prompt`).
    """

    load_factor: float = 1.25  # KubeAI's default meanLoadFactor (125%); measured in docs/router.md
    index_blocks: int = (
        65536  # per-engine LRU of block hashes (a 2 GiB CPU cache holds ~2-8k blocks; GPUs more)
    )
    ring_replicas: int = 128  # virtual nodes per engine: with 2-8 engines the ring's shares stay within ~10%
    sessions_max: int = 100_000
    name: str = field(default="prefix", init=False)

    def __post_init__(self) -> None:
        if self.load_factor < 1.0:
            raise ValueError(
                f"prefix policy load_factor={self.load_factor} must be >= 1.0 (1.0: perfectly even)"
            )
        self.index = PrefixIndex(self.index_blocks)
        # The exact index from the engines' KV events (router/kv_subscriber.py): a url -> match, or None
        # for an engine that publishes none, whose match is then this router's estimate.
        self.exact: Callable[[str, Sequence[int]], int | None] | None = None
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._ring_key: frozenset[str] = frozenset()
        self._ring: list[tuple[int, str]] = []

    def _ring_for(self, urls: Sequence[str]) -> list[tuple[int, str]]:
        key = frozenset(urls)
        if key != self._ring_key:
            self._ring = sorted(
                (stable_hash(f"{url}#{i}"), url) for url in urls for i in range(self.ring_replicas)
            )
            self._ring_key = key
        return self._ring

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Choice | None:
        if not endpoints:
            return None
        cap = load_cap(endpoints, self.load_factor)
        under = [e for e in endpoints if e.outstanding + 1 <= cap]
        # the engines' KV events publish no adapter's blocks, and hash what the engine prefilled: a chat
        # prompt the router flattened (no template to render it with) never matches them, so it is
        # matched on the estimate
        exact = request.adapter is None and request.engine_hashes
        matches = {e.url: self._match(e.url, request.hashes, exact) for e in endpoints}
        if request.session is not None:
            url = self._sessions.get(request.session)
            if url is not None and any(e.url == url for e in under):
                return Choice(url, "session", matches[url])
        if not request.hashes:
            best = min(under, key=lambda e: e.outstanding)
            return Choice(best.url, "short-prompt", 0)
        best = max(under, key=lambda e: (matches[e.url], -e.outstanding))
        if matches[best.url] > 0:
            longest = max(matches.values())
            return Choice(
                best.url, "prefix" if matches[best.url] == longest else "prefix-bounded", matches[best.url]
            )
        ring = self._ring_for([e.url for e in endpoints])
        allowed = {e.url for e in under}
        start = bisect.bisect_left(ring, (request.hashes[0] & RING_MASK, ""))
        for i in range(len(ring)):
            url = ring[(start + i) % len(ring)][1]
            if url in allowed:
                return Choice(url, "ring", 0)
        raise AssertionError("unreachable: the least loaded engine is always under the cap")

    def _match(self, url: str, hashes: Sequence[int], use_exact: bool = True) -> int:
        exact = self.exact(url, hashes) if self.exact is not None and use_exact else None
        return self.index.match(url, hashes) if exact is None else exact

    def routed(self, request: RouteRequest, url: str) -> None:
        self.index.insert(url, request.hashes)
        if request.session is not None:
            self._sessions[request.session] = url
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > self.sessions_max:
                self._sessions.popitem(last=False)

    def forget(self, url: str) -> None:
        self.index.forget(url)
        for session in [s for s, u in self._sessions.items() if u == url]:
            del self._sessions[session]


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "prefix": PrefixAffinity,
    "least-loaded": LeastLoaded,
    "round-robin": RoundRobin,
}
DEFAULT_POLICY = "prefix"


def make_policy(name: str, **options: float | int) -> RoutingPolicy:
    """The policy registered under `name`; unknown names are refused with the known ones."""
    if name not in POLICIES:
        raise ValueError(f"routing policy {name!r} is not one of {', '.join(POLICIES)}")
    return POLICIES[name](**options)


# With `routing.enabled: false` no router runs: the Service spreads requests over the engines itself. The
# local fleet and the simulator stand in for that with least-loaded (no prefix affinity, even spread).
UNROUTED_POLICY = "least-loaded"


def service_policy(
    policy: str, enabled: bool, load_factor_percent: int, override: str | None = None
) -> RoutingPolicy:
    """The policy an InferenceService's router runs, from its `spec.routing` (policy, enabled,
    loadFactorPercent) as the operator renders the router's flags; `override` replaces the policy's name."""
    name = override or (policy if enabled else UNROUTED_POLICY)
    options = {"load_factor": load_factor_percent / 100} if name == "prefix" else {}
    return make_policy(name, **options)
