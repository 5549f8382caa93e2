"""The engines a router may send to: address, readiness, draining, requests in flight. Plain Python."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Endpoint:
    url: str  # http://host:port, no trailing slash
    ready: bool = False
    draining: bool = False  # terminating: finishes what it has, gets nothing new
    outstanding: int = 0  # requests this router has in flight on it
    role: str | None = None  # "prefill" (computes prompts for decode engines), "decode", or None (aggregated)

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining


class EndpointSet:
    """The routable set as discovery last saw it, plus this router's in-flight counts.

    Discovery calls `replace` (the whole set, as an EndpointSlice watch or the local fleet sees it) or
    `set_state`; the proxy calls `acquire`/`release` around each forwarded request. `version` grows on
    every change so a waiter (the scale-from-zero queue) can tell that something happened.
    """

    def __init__(self, urls: Iterable[str] = (), ready: bool = False) -> None:
        self._by_url: dict[str, Endpoint] = {}
        self.version = 0
        for url in urls:
            self._by_url[url] = Endpoint(url, ready=ready)

    def __contains__(self, url: str) -> bool:
        return url in self._by_url

    def get(self, url: str) -> Endpoint | None:
        return self._by_url.get(url)

    def all(self) -> list[Endpoint]:
        return list(self._by_url.values())

    def routable(self) -> list[Endpoint]:
        """Ready and not draining, in a stable order (by URL), so policies are deterministic. Prefill
        engines are not among them: they take only the prefill half of a request (`prefill_routable`)."""
        return sorted(
            (e for e in self._by_url.values() if e.routable and e.role != "prefill"), key=lambda e: e.url
        )

    def prefill_routable(self) -> list[Endpoint]:
        """Ready prefill engines, fewest requests in flight first (router/disaggregation.py)."""
        live = (e for e in self._by_url.values() if e.routable and e.role == "prefill")
        return sorted(live, key=lambda e: (e.outstanding, e.url))

    def replace(self, states: dict[str, tuple[bool, bool]]) -> list[str]:
        """The full set: url -> (ready, draining). Keeps in-flight counts of engines that stay; the removed URLs."""
        removed = [u for u in self._by_url if u not in states]
        for url in removed:
            if self._by_url[url].outstanding == 0:
                del self._by_url[url]
            else:  # still finishing requests: keep counting them, route nothing new
                self._by_url[url].ready, self._by_url[url].draining = False, True
        for url, (ready, draining) in states.items():
            self.set_state(url, ready=ready, draining=draining, bump=False)
        self.version += 1
        return removed

    def set_state(
        self,
        url: str,
        *,
        ready: bool | None = None,
        draining: bool | None = None,
        bump: bool = True,
        role: str | None = None,
    ) -> None:
        endpoint = self._by_url.setdefault(url, Endpoint(url))
        if role is not None:
            endpoint.role = role
        if ready is not None:
            endpoint.ready = ready
        if draining is not None:
            endpoint.draining = draining
        if bump:
            self.version += 1

    def remove(self, url: str) -> None:
        self.replace({u: (e.ready, e.draining) for u, e in self._by_url.items() if u != url})

    def acquire(self, url: str) -> None:
        self._by_url[url].outstanding += 1

    def release(self, url: str) -> None:
        endpoint = self._by_url.get(url)
        if endpoint is None:
            return
        endpoint.outstanding = max(0, endpoint.outstanding - 1)
