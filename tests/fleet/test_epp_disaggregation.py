"""Prefill/decode disaggregation behind a gateway's endpoint picker: the router's EPP (a real gRPC server,
played against as Envoy would) picks the decode engine and names a prefill engine in `x-prefiller-host-port`;
the gateway's request, sent with that header to the decode engine (real uvicorn servers in front of real
engine cores on the tiny llama, the bundled model's tokenizer), runs its prefill on the named engine and
decodes with the pulled KV. The client sees the aggregated engine's greedy tokens; the prefill engine's
counters show it computed the prompt, the decode engine's that it pulled the KV. The picker and the decode
engine share a key, as the operator and `specfleet up` wire them: the picker signs the prefill engine and the
body (x-specfleet-prefill-signature), and the same request with a client's own header, unsigned or signed
with another key, runs aggregated and is counted as rejected.

What is not modelled: Envoy itself (the EPP's answer is read and the request sent on by the test, as the
gateway would send it), and pods on other hosts (all on loopback)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from envoy_exchange import buffered_exchange
from helpers import free_port
from role_servers import pd_endpoints, served_roles
from specfleet.engine.config import EngineConfig
from specfleet.engine.core.client import EngineCoreClient
from specfleet.engine.kv_transfer import prefill_leg, prefill_signature
from specfleet.engine.server import remote_prefill
from specfleet.engine.server.remote_prefill import RemotePrefill, parse_networks
from specfleet.router.endpoint_picker import DESTINATION_KEY, PREFILLER_HEADER, address
from specfleet.router.ext_proc_server import serve_endpoint_picker
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router

pytestmark = pytest.mark.slow

COMMON = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=64)
# The prefill engine takes shorter prompts than the decode engine: a prompt between the two is its refusal.
PREFILL_MAX_LEN, DECODE_MAX_LEN = 128, 256
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
KEY = b"the picker's and the decode engines' key"  # what the operator's NAME-pd-key Secret holds
SIGNATURE = prefill_signature.HEADER


@pytest.fixture(scope="module")
def pool(tiny_llama) -> Iterator[dict[str, Any]]:
    from specfleet.engine.server.app import build_state

    configs = {
        "prefill": EngineConfig(model=tiny_llama, kv_role="prefill", max_model_len=PREFILL_MAX_LEN, **COMMON),
        "decode": EngineConfig(model=tiny_llama, kv_role="decode", max_model_len=DECODE_MAX_LEN, **COMMON),
        "aggregated": EngineConfig(model=tiny_llama, max_model_len=DECODE_MAX_LEN, **COMMON),  # the oracle
    }
    engines = {role: EngineCoreClient(config, log_level="warning") for role, config in configs.items()}
    accept = RemotePrefill(parse_networks(["127.0.0.0/8"]), timeout_s=10.0, key=KEY)
    states = {
        role: build_state(engine, remote_prefill=accept if role == "decode" else None)
        for role, engine in engines.items()
    }
    with served_roles(states, engines) as urls:
        yield {"urls": urls, "states": states, "engines": engines}


async def epp_pick(urls: dict[str, str], path: str, body: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    """One request's ext_proc exchange (BUFFERED bodies) with the router's EPP, which holds the decode
    engine's key, over a pool of one prefill and one decode engine: the request headers the EPP set, by name,
    and the body as the gateway sends it on (the bytes the signature covers)."""
    router = Router(pd_endpoints(urls), make_policy("least-loaded"))
    server, port = await serve_endpoint_picker(router, "127.0.0.1", 0, prefill_key=KEY)
    raw = json.dumps(body).encode()
    try:
        return await buffered_exchange(port, path, raw), raw
    finally:
        await server.stop(0)


def counter(url: str, name: str) -> float:
    """A counter's total over its series, from the engine's /metrics as Prometheus scrapes it."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def rejected(url: str, reason: str) -> float:
    return sum(
        float(v)
        for v in re.findall(
            rf'^specfleet_remote_prefill_rejected_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$',
            httpx.get(f"{url}/metrics", timeout=10).text,
            re.MULTILINE,
        )
    )


def transfers(pool: dict[str, Any]) -> int:
    return pool["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"]


def held_blocks(pool: dict[str, Any]) -> int:
    return pool["states"]["prefill"].async_engine.call_sync("kv_blocks_in_use")


def wait_no_held_blocks(pool: dict[str, Any], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while held_blocks(pool) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held_blocks(pool) == 0


def test_the_epp_names_the_prefill_engine_and_the_decode_engine_runs_the_leg(pool):
    urls = pool["urls"]
    body = {"prompt": "The quick brown fox jumps over the lazy dog and", **GREEDY}
    picked, raw = asyncio.run(epp_pick(urls, "/v1/completions", body))
    assert picked[DESTINATION_KEY] == address(urls["decode"])
    assert picked[PREFILLER_HEADER] == address(urls["prefill"])
    prefill_signature.verify(KEY, picked[SIGNATURE], picked[PREFILLER_HEADER], raw)

    want = httpx.post(f"{urls['aggregated']}/v1/completions", json=body, timeout=60).json()
    prompt_tokens, pulls = counter(urls["prefill"], "specfleet_prompt_tokens_total"), transfers(pool)
    sent = {"content-type": "application/json", **{k: picked[k] for k in (PREFILLER_HEADER, SIGNATURE)}}
    got = httpx.post(  # what the gateway sends: the body, to the destination, with the EPP's headers
        f"http://{picked[DESTINATION_KEY]}/v1/completions", content=raw, headers=sent, timeout=60
    )
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert got.json()["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 10
    assert "kv_transfer_params" not in got.json()  # the hold is the decode engine's business
    # The prefill engine computed the prompt (its counter, as Prometheus reads it), the decode engine pulled it.
    assert (
        counter(urls["prefill"], "specfleet_prompt_tokens_total") - prompt_tokens
        == want["usage"]["prompt_tokens"]
    )
    assert transfers(pool) == pulls + 1
    wait_no_held_blocks(pool)

    # The same request reaching the decode engine with a client's own header (past the gateway): unsigned,
    # signed with another key, or the picker's signature on another body: aggregated, the prefill engine idle.
    prompt_tokens = counter(urls["prefill"], "specfleet_prompt_tokens_total")
    before = {r: rejected(urls["decode"], r) for r in ("missing", "mismatch")}
    other = json.dumps({**body, "prompt": "Another prompt entirely"}).encode()
    guessed = prefill_signature.sign(b"a client's guess of the key", sent[PREFILLER_HEADER], raw)
    copied = prefill_signature.sign(KEY, sent[PREFILLER_HEADER], other)  # the picker's, for another body
    for headers in ({}, {SIGNATURE: guessed}, {SIGNATURE: copied}):
        forged = {"content-type": "application/json", PREFILLER_HEADER: sent[PREFILLER_HEADER], **headers}
        ran = httpx.post(f"{urls['decode']}/v1/completions", content=raw, headers=forged, timeout=60)
        assert ran.status_code == 200 and ran.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert counter(urls["prefill"], "specfleet_prompt_tokens_total") == prompt_tokens
    assert transfers(pool) == pulls + 1
    assert rejected(urls["decode"], "missing") - before["missing"] == 1
    assert rejected(urls["decode"], "mismatch") - before["mismatch"] == 2

    # A streamed chat request through the same path: the same text as the aggregated engine's.
    chat = {"messages": [{"role": "user", "content": "Name three colours, please."}], **GREEDY}
    picked, raw = asyncio.run(epp_pick(urls, "/v1/chat/completions", {**chat, "stream": True}))
    want_text = httpx.post(f"{urls['aggregated']}/v1/chat/completions", json=chat, timeout=60).json()
    with httpx.stream(
        "POST",
        f"http://{picked[DESTINATION_KEY]}/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json", **{k: picked[k] for k in (PREFILLER_HEADER, SIGNATURE)}},
        timeout=60,
    ) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == want_text["choices"][0]["message"]["content"]
    assert transfers(pool) == pulls + 2
    wait_no_held_blocks(pool)


def test_failures_run_aggregated_or_answer_with_the_reason(pool):
    urls = pool["urls"]
    body = {"prompt": "One two three four five six seven", **GREEDY}
    want = httpx.post(f"{urls['aggregated']}/v1/completions", json=body, timeout=60).json()["choices"][0][
        "text"
    ]
    pulls = transfers(pool)

    def send(url: str, value: str, request: dict[str, Any] = body) -> httpx.Response:
        """As the picker would send it: the header signed with the key (the failures below are not the
        signature's)."""
        raw = json.dumps(request).encode()
        signed = {PREFILLER_HEADER: value, SIGNATURE: prefill_signature.sign(KEY, value, raw)}
        return httpx.post(
            f"{url}/v1/completions",
            content=raw,
            headers={"content-type": "application/json", **signed},
            timeout=60,
        )

    # A prefill engine that is gone: the decode engine runs the request itself, as the router's path does.
    gone = send(urls["decode"], f"127.0.0.1:{free_port()}")
    assert gone.status_code == 200 and gone.json()["choices"][0]["text"] == want
    assert transfers(pool) == pulls

    # A host outside the flag's networks, or not host:port: a 400 naming the header, nothing sent.
    for value, rule in (("10.1.2.3:8000", "networks (127.0.0.0/8)"), ("http://127.0.0.1:80/x", "host:port")):
        refused = send(urls["decode"], value)
        assert refused.status_code == 400
        assert (
            refused.json()["error"]["param"] == PREFILLER_HEADER
            and rule in refused.json()["error"]["message"]
        )

    # The prefill engine's own refusal (its context is shorter than the decode engine's) is the answer.
    long_prompt = {**body, "prompt": " ".join(["word"] * (PREFILL_MAX_LEN + 20))}
    refused = send(urls["decode"], address(urls["prefill"]), long_prompt)
    assert refused.status_code == 400
    assert (
        f"the prefill engine {address(urls['prefill'])} refused the request"
        in refused.json()["error"]["message"]
    )
    assert refused.json()["error"]["code"] == "context_length_exceeded"

    # An engine started without --accept-remote-prefill ignores the header: aggregated, the prefill engine idle.
    prompt_tokens = counter(urls["prefill"], "specfleet_prompt_tokens_total")
    ignored = send(urls["aggregated"], address(urls["prefill"]))
    assert ignored.status_code == 200 and ignored.json()["choices"][0]["text"] == want
    assert counter(urls["prefill"], "specfleet_prompt_tokens_total") == prompt_tokens
    assert transfers(pool) == pulls
    wait_no_held_blocks(pool)


def test_a_hold_the_decode_engine_does_not_take_is_released_at_once(pool):
    """The submission after the leg fails (the decode engine's own refusal): the hold goes back now, not at
    the prefill engine's hold timeout."""
    made = httpx.post(
        f"{pool['urls']['prefill']}/v1/completions",
        json=prefill_leg.prefill_body({"prompt": "Once upon a time there was a", **GREEDY}),
        timeout=30,
    )
    params = made.json()["kv_transfer_params"]
    assert held_blocks(pool) == params["num_blocks"] >= 2

    async def refused_submission() -> None:
        with pytest.raises(RuntimeError), remote_prefill.released_unless_taken(params):
            raise RuntimeError("the decode engine's queue is full")
        await asyncio.sleep(0)  # the release runs in the loop's executor

    asyncio.run(refused_submission())
    wait_no_held_blocks(pool, timeout_s=20)  # released, not left to the 60 s timeout (20 s: a loaded host)
