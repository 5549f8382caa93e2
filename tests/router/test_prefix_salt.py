"""The router's prefix affinity keys blocks as the engine's prefix cache does, cache_salt included: a
salted prompt never counts as another tenant's (or an unsalted request's) cached prefix."""

from __future__ import annotations

import json

import pytest
from specfleet.router.endpoints import EndpointSet
from specfleet.router.policies import make_policy
from specfleet.router.prefix import BlockHasher
from specfleet.router.proxy import Router

PROMPT = "You are a support agent for ACME. " * 8


@pytest.mark.parametrize(
    "hasher", [BlockHasher(block_size=4), BlockHasher(block_size=4, encode=lambda t: list(t.encode()))]
)
def test_a_salt_changes_every_block_hash_and_the_same_salt_repeats_them(hasher: BlockHasher):
    plain, a, b = hasher.hashes(PROMPT), hasher.hashes(PROMPT, "tenant-a"), hasher.hashes(PROMPT, "tenant-b")
    assert len(plain) == len(a) == len(b) >= 4
    assert set(plain).isdisjoint(a) and set(a).isdisjoint(b) and set(plain).isdisjoint(b)
    assert hasher.hashes(PROMPT, "tenant-a") == a
    assert hasher.hashes(PROMPT, "") == plain  # the engine refuses an empty salt; no key of its own here


def test_the_router_reads_the_salt_from_the_request_body():
    router = Router(EndpointSet(["http://e0"], ready=True), make_policy("prefix"))
    route = lambda body: router.route_request(json.dumps(body).encode(), {}).hashes  # noqa: E731
    plain = route({"prompt": PROMPT})
    salted = route({"prompt": PROMPT, "cache_salt": "tenant-a"})
    assert plain and salted and set(plain).isdisjoint(salted)
    assert route({"prompt": PROMPT, "cache_salt": "tenant-a"}) == salted
    chat = {"messages": [{"role": "user", "content": PROMPT}]}
    assert set(route(chat)).isdisjoint(route({**chat, "cache_salt": "tenant-a"}))
