"""The eviction phase's per-decision shadow (bench/route_decisions.py) on the prefix policy as shipped: it
changes no decision, and it records where the exact index and the estimate part and what the engines held.
The engines' holdings are given as a table (what the exact index answers from their KV events)."""

from __future__ import annotations

from collections.abc import Sequence

from specfleet.bench.route_decisions import ShadowedPolicy
from specfleet.router.endpoints import Endpoint
from specfleet.router.policies import PrefixAffinity, RouteRequest, load_cap

A, B = "http://a", "http://b"
TENANT = tuple(range(100, 127))  # one tenant's system prompt: 27 blocks


def _held(table: dict[str, int]):
    def truth(url: str, hashes: Sequence[int]) -> int | None:
        return table.get(url)

    return truth


def _endpoints(a: int, b: int) -> list[Endpoint]:
    return [Endpoint(A, ready=True, outstanding=a), Endpoint(B, ready=True, outstanding=b)]


def _estimate_on_both(policy: PrefixAffinity) -> None:
    """The tenant's prompt was sent to both engines (a spill under the load cap): the estimate holds it on
    both for good."""
    for tail, url in ((1, A), (2, B)):
        policy.routed(RouteRequest(TENANT + (tail,)), url)


def test_a_prefix_evicted_here_and_held_there_parts_the_picks() -> None:
    table = {A: 0, B: 27}  # A evicted the tenant's prompt, B still holds it
    request = RouteRequest(TENANT + (3,), session="conv-1")
    # on the estimate: a 27-27 tie, broken to the less loaded A, which holds nothing
    estimate = PrefixAffinity()
    _estimate_on_both(estimate)
    shadow = ShadowedPolicy(estimate, _held(table))
    choice = shadow.choose(request, _endpoints(0, 1))
    assert choice is not None and (choice.url, choice.reason, choice.match_blocks) == (A, "prefix", 27)
    assert estimate.exact is None  # the shadow left the routing index as it found it
    figures = shadow.log.figures()
    assert figures["picks_differ"] == figures["stale_at_pick"] == figures["held_longer_elsewhere"] == 1
    assert (figures["held_blocks"], figures["best_held_blocks"], figures["prompt_blocks"]) == (0, 27, 28)
    assert figures["cap_bound"] == 0 and figures["reasons"] == {"prefix": 1}
    assert figures["believed_on_several_held_on_fewer"] == 1  # believed on A and B, held on B alone
    # on the events: the same state, B, which holds it
    events = PrefixAffinity()
    _estimate_on_both(events)
    events.exact = _held(table)
    shadow = ShadowedPolicy(events, _held(table))
    choice = shadow.choose(request, _endpoints(0, 1))
    assert choice is not None and (choice.url, choice.match_blocks) == (B, 27)
    figures = shadow.log.figures()
    assert figures["picks_differ"] == 1 and figures["stale_at_pick"] == figures["held_longer_elsewhere"] == 0
    assert figures["held_blocks"] == 27
    assert shadow.log.decisions[0].session == "conv-1"


def test_the_shadow_changes_no_decision_and_logs_only_what_the_index_decides() -> None:
    plain, shadowed = PrefixAffinity(), PrefixAffinity()
    shadow = ShadowedPolicy(shadowed, _held({A: 0, B: 0}))
    requests = [
        RouteRequest(tuple(range(t * 50, t * 50 + 27)) + (i,)) for i, t in enumerate([0, 1, 2, 0, 1, 3])
    ]
    loads = [(0, 0), (1, 0), (1, 1), (2, 1), (0, 3), (2, 2)]
    for request, (a, b) in zip(requests, loads, strict=True):
        want, got = plain.choose(request, _endpoints(a, b)), shadow.choose(request, _endpoints(a, b))
        assert want == got and got is not None
        plain.routed(request, want.url)
        shadow.routed(request, got.url)
    assert len(shadow.log.decisions) == len(requests)
    assert shadow.log.figures()["believed_on_several_held_on_fewer"] == 0  # no tenant was sent to both
    # the cap ceil(1.25 * (m + 1) / 2) excludes an engine only at (0, 3): 3 in flight, cap 3, B full
    assert shadow.log.figures()["cap_bound"] == 1
    # a chat request (hashed off the chat template) and a short prompt are not the index's to decide
    shadow.choose(RouteRequest(TENANT, engine_hashes=False), _endpoints(0, 0))
    shadow.choose(RouteRequest(()), _endpoints(0, 0))
    assert len(shadow.log.decisions) == len(requests)


def test_with_two_in_flight_on_two_engines_the_load_cap_never_binds() -> None:
    """Why the phase's earlier workload (two conversations in flight) could not show the index: at most one
    other request in flight, every engine stays under the cap, so every tenant keeps its ring home in
    both modes."""
    for a, b in [(0, 0), (1, 0), (0, 1)]:
        endpoints = _endpoints(a, b)
        cap = load_cap(endpoints, PrefixAffinity.load_factor)
        assert all(e.outstanding + 1 <= cap for e in endpoints)
    # with three or more in flight it does: 2 + 0 in flight, cap ceil(1.25 * 3 / 2) = 2, and A is full
    endpoints = _endpoints(2, 0)
    assert load_cap(endpoints, PrefixAffinity.load_factor) == 2
