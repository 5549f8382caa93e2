"""Routing policies as plain objects: the choices, the reasons, and the load bound as a property."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.router.endpoints import Endpoint, EndpointSet
from specfleet.router.policies import (
    POLICIES,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
    load_cap,
    make_policy,
)
from specfleet.router.prefix import BlockHasher, PrefixIndex, chain_hashes, token_blocks


def _eps(*loads: int) -> list[Endpoint]:
    return [Endpoint(f"http://e{i}", ready=True, outstanding=n) for i, n in enumerate(loads)]


def test_chained_block_hashes_share_exactly_the_common_prefix():
    a = chain_hashes(token_blocks(list(range(64)), 16))
    b = chain_hashes(token_blocks(list(range(48)) + [999] * 16, 16))
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    # a block equal in content but after a different parent is a different block (the engine's rule)
    c = chain_hashes(token_blocks([7] * 16 + list(range(16, 32)), 16))
    assert c[1] != a[1]
    assert token_blocks(list(range(15)), 16) == []  # a partial block is never cached


def test_char_hasher_blocks_are_stable_and_prefix_shared():
    hasher = BlockHasher(block_size=4)  # 16-character blocks without a tokenizer
    system = "You are a support agent for ACME. " * 4
    a, b = hasher.hashes(system + "Where is my order?"), hasher.hashes(system + "Cancel my plan please")
    assert len(a) >= 8 and a[:8] == b[:8]
    assert hasher.hashes("short") == []


def test_prefix_index_match_and_lru():
    index = PrefixIndex(capacity_blocks=4)
    index.insert("a", [1, 2, 3])
    assert index.match("a", [1, 2, 9]) == 2 and index.match("a", [9, 1]) == 0 and index.match("b", [1]) == 0
    index.insert("a", [4, 5])  # 5 hashes in a 4-slot LRU: the oldest (1) goes, so nothing chains from it
    assert index.match("a", [1, 2]) == 0 and index.match("a", [2, 3]) == 2
    with pytest.raises(ValueError, match="capacity_blocks=0"):
        PrefixIndex(0)


def test_round_robin_and_least_loaded():
    rr, eps = RoundRobin(), _eps(0, 0, 0)
    picks = []
    for _ in range(6):
        choice = rr.choose(RouteRequest(), eps)
        rr.routed(RouteRequest(), choice.url)
        picks.append(choice.url)
    assert picks == [e.url for e in eps] * 2
    ll = LeastLoaded()
    assert ll.choose(RouteRequest(), _eps(3, 1, 2)).url == "http://e1"
    # ties rotate: a burst onto idle engines with the counts updated between decisions spreads evenly
    eps = _eps(0, 0)
    for _ in range(4):
        choice = ll.choose(RouteRequest(), eps)
        ll.routed(RouteRequest(), choice.url)
        next(e for e in eps if e.url == choice.url).outstanding += 1
    assert [e.outstanding for e in eps] == [2, 2]
    assert rr.choose(RouteRequest(), []) is None and ll.choose(RouteRequest(), []) is None


def test_prefix_policy_reasons():
    policy = PrefixAffinity()
    eps = _eps(0, 0)
    tenant = RouteRequest(tuple(range(100, 110)))
    first = policy.choose(tenant, eps)
    assert first.reason == "ring" and first.match_blocks == 0
    policy.routed(tenant, first.url)
    # the same tenant's next turn (its history plus more) goes to the engine that holds the history
    again = policy.choose(RouteRequest(tuple(range(100, 114))), eps)
    assert (again.url, again.reason, again.match_blocks) == (first.url, "prefix", 10)
    # over the load cap the longest match is passed over for the other engine
    holder = next(e for e in eps if e.url == first.url)
    holder.outstanding = 5
    short = RouteRequest(tuple(range(100, 105)))
    bounded = policy.choose(short, eps)
    assert bounded.url != first.url and bounded.reason == "ring"
    policy.routed(short, bounded.url)
    holder.outstanding = 3  # the other engine holds 5 of the 10 blocks; the bound excludes the holder
    assert (policy.choose(tenant, eps).reason, policy.choose(tenant, eps).match_blocks) == (
        "prefix-bounded",
        5,
    )
    # sessions stick while the engine is under the cap
    s = RouteRequest((1, 2), session="chat-7")
    policy.routed(s, "http://e0")
    for e in eps:
        e.outstanding = 0
    assert (policy.choose(s, eps).url, policy.choose(s, eps).reason) == ("http://e0", "session")
    assert policy.choose(RouteRequest(), eps).reason == "short-prompt"
    policy.forget("http://e0")
    assert policy.choose(s, eps).reason != "session"


def test_registry_refuses_unknown_names():
    assert set(POLICIES) == {"prefix", "least-loaded", "round-robin"}
    with pytest.raises(ValueError, match="'hash' is not one of prefix, least-loaded, round-robin"):
        make_policy("hash")
    with pytest.raises(ValueError, match="load_factor=0.5"):
        make_policy("prefix", load_factor=0.5)


def test_endpoint_set_routes_only_ready_not_draining():
    es = EndpointSet()
    es.replace({"http://a": (True, False), "http://b": (False, False), "http://c": (True, True)})
    assert [e.url for e in es.routable()] == ["http://a"]
    es.acquire("http://a")
    removed = es.replace({"http://b": (True, False)})
    assert removed == ["http://a", "http://c"]
    # a removed engine with requests in flight is kept, draining, until they finish
    assert es.get("http://a").draining and es.get("http://c") is None
    assert [e.url for e in es.routable()] == ["http://b"]


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(1, 6),
    factor=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 50)), max_size=200),
)
def test_prefix_policy_never_exceeds_the_load_cap(n, factor, ops):
    """Whatever arrives and leaves, the engine chosen ends at most at ceil(c * total / n) in flight, and
    a choice always exists while any engine is routable."""
    policy, eps = PrefixAffinity(load_factor=factor), _eps(*([0] * n))
    rng_tenants = [tuple(range(t * 1000, t * 1000 + 8)) for t in range(8)]
    for arrive, tenant, pick in ops:
        if arrive or not any(e.outstanding for e in eps):
            req = RouteRequest(
                rng_tenants[tenant][: 1 + pick % 8], session=f"s{pick % 3}" if pick % 5 == 0 else None
            )
            cap = load_cap(eps, factor)
            choice = policy.choose(req, eps)
            assert choice is not None
            chosen = next(e for e in eps if e.url == choice.url)
            chosen.outstanding += 1
            policy.routed(req, choice.url)
            total = sum(e.outstanding for e in eps)
            assert chosen.outstanding <= cap == math.ceil(factor * total / n)
        else:
            busy = [e for e in eps if e.outstanding]
            busy[pick % len(busy)].outstanding -= 1


def test_service_policy_is_spec_routing_as_the_operator_renders_it_for_the_simulator_and_the_local_fleet():
    from specfleet.router.policies import service_policy

    prefix = service_policy("prefix", True, 150)
    assert isinstance(prefix, PrefixAffinity) and prefix.load_factor == 1.5
    assert service_policy("round-robin", True, 125).name == "round-robin"
    assert service_policy("prefix", False, 125).name == "least-loaded"  # no router: the Service spreads
    assert service_policy("prefix", True, 125, override="round-robin").name == "round-robin"
    with pytest.raises(ValueError, match="is not one of"):
        service_policy("fastest", True, 125)
