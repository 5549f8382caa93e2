"""Prefill/decode disaggregation over HTTP: real uvicorn servers for a prefill and a decode engine behind the
router (real aiohttp, its endpoint set with the two roles), the official openai client in front. The client sees one normal response (JSON and
SSE) equal to an aggregated engine's; a dead decode engine and a client gone before the decode both give
the prefill engine's held blocks back."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import free_port, stream_completion
from role_servers import pd_endpoints, served_roles
from specfleet.engine.config import EngineConfig
from specfleet.engine.core.client import EngineCoreClient
from specfleet.router import disaggregation
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router, serve

COMMON = dict(block_size=4, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=64)
GREEDY = {"temperature": 0.0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


def _serve_router(router: Router) -> tuple[Any, str]:
    """The router on its own event loop in a thread, as `specfleet router` runs it; (stop, url)."""
    import asyncio

    loop, port, started = asyncio.new_event_loop(), free_port(), threading.Event()
    runner: list[Any] = []

    async def start() -> None:
        runner.append(await serve(router, "127.0.0.1", port))
        router.endpoints_changed()
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return stop, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fleet(tiny_llama) -> Iterator[dict[str, Any]]:
    from specfleet.engine.server.app import build_state

    # Each server with its engine core in its own process, as `specfleet serve` runs them.
    engines = {
        role: EngineCoreClient(EngineConfig(model=tiny_llama, kv_role=role, **COMMON), log_level="warning")
        for role in ("prefill", "decode")
    }
    engines["aggregated"] = EngineCoreClient(EngineConfig(model=tiny_llama, **COMMON), log_level="warning")
    states = {role: build_state(engine) for role, engine in engines.items()}
    with served_roles(states, engines) as urls:
        endpoints = pd_endpoints(urls)
        router = Router(endpoints, make_policy("least-loaded"), max_retries=0)
        stop, urls["proxy"] = _serve_router(router)
        yield {"urls": urls, "states": states, "engines": engines, "endpoints": endpoints}
        stop()


def _blocks(state: Any) -> int:
    """KV blocks in use in the server's engine core (it returns a finished hold's blocks between steps)."""
    return state.async_engine.call_sync("kv_blocks_in_use")


def _wait_no_blocks(state: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _blocks(state) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _blocks(state) == 0


def _finished(state: Any) -> float:
    """Requests the server has finished (its specfleet_request_success counter, all reasons)."""
    return sum(
        sample.value
        for metric in state.metrics.success.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


def _wait_finished(state: Any, count: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _finished(state) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _finished(state) >= count


def _client(url: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_sees_the_aggregated_answer_json_and_stream(fleet):
    urls = fleet["urls"]
    pd, agg = _client(urls["proxy"]), _client(urls["aggregated"])
    model = agg.models.list().data[0].id
    for prompt in ("The quick brown fox jumps over", "One two three four five six seven eight nine ten"):
        want = agg.completions.create(model=model, prompt=prompt, **GREEDY)
        got = pd.completions.create(model=model, prompt=prompt, **GREEDY)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens == 10
        assert got.choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Name three colours, please."}]
    want = agg.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0].message.content
    chunks = pd.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # Each request really went through a prefill engine and a KV transfer.
    assert fleet["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"] >= 3
    _wait_no_blocks(fleet["states"]["prefill"])
    _wait_no_blocks(fleet["states"]["decode"])


def test_dead_decode_engine_fails_cleanly_and_frees_the_prefill_hold(fleet):
    urls, endpoints = fleet["urls"], fleet["endpoints"]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a decode engine that died
    endpoints.set_state(urls["decode"], ready=False)
    endpoints.set_state(dead, ready=True, role="decode")
    try:
        response = httpx.post(
            f"{urls['proxy']}/v1/completions",
            timeout=30,
            json={"prompt": "Once upon a time there was", "max_tokens": 8, "temperature": 0},
        )
        assert response.status_code == 502 and "no engine could take" in response.json()["error"]["message"]
        # released, not left to the 60 s timeout: 20 s leaves a loaded host the release's round trip and
        # the core's next step
        _wait_no_blocks(fleet["states"]["prefill"], timeout_s=20)
    finally:
        endpoints.remove(dead)
        endpoints.set_state(urls["decode"], ready=True)


def test_prefill_engine_refusal_reaches_the_client_and_prefill_is_not_a_decode_target(fleet):
    urls = fleet["urls"]
    response = httpx.post(
        f"{urls['proxy']}/v1/completions",
        timeout=30,
        json={"prompt": "hello there", "max_tokens": 4, "temperature": -1},
    )
    assert response.status_code == 400  # the prefill engine's answer, not a retry or an aggregated run
    assert [e.url for e in fleet["endpoints"].routable()] == [urls["decode"]]
    assert [e.url for e in fleet["endpoints"].prefill_routable()] == [urls["prefill"]]


def test_client_gone_before_the_decode_releases_the_hold(fleet):
    """What the router does when the client left during the prefill: the hold goes at once."""
    urls = fleet["urls"]
    response = httpx.post(
        f"{urls['prefill']}/v1/completions",
        timeout=30,
        json={
            "prompt": "Once upon a time there was a",
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    assert response.status_code == 200
    params = response.json()["kv_transfer_params"]
    assert params["num_blocks"] >= 2 and _blocks(fleet["states"]["prefill"]) == params["num_blocks"]
    disaggregation.release(params)
    _wait_no_blocks(fleet["states"]["prefill"], timeout_s=20)  # released, well before the 60 s timeout


@pytest.mark.parametrize("leaves", ["during the prefill", "at the first streamed token"])
def test_a_client_that_drops_its_connection_mid_request_leaks_no_blocks_on_either_engine(fleet, leaves):
    # A real client socket through the router: it sends a streaming request and closes the connection
    # right away (the router's handler is cancelled while it waits for the prefill engine) or once the
    # decode engine's first token arrived (the router's write fails, it drops the decode engine's
    # connection, which aborts). Either way both engines get every block back well before the prefill
    # engine's hold would time out (kv_transfer_timeout_s, 60 s).
    urls, states = fleet["urls"], fleet["states"]
    host, port = urls["proxy"].removeprefix("http://").split(":")
    request = {"prompt": " ".join(["word"] * 120), "temperature": 0, "ignore_eos": True}  # ~120 tokens
    # The same prompt once to the end: the router then has a pooled connection to the prefill engine and
    # that engine the prompt in its prefix cache, so the prefill of the request below ends (and holds the
    # blocks) before the engine could notice that the router's connection closed.
    warm = httpx.post(f"{urls['proxy']}/v1/completions", json={**request, "max_tokens": 2}, timeout=60)
    assert warm.status_code == 200
    _wait_no_blocks(states["prefill"])
    body = json.dumps({**request, "max_tokens": 120, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    pulls = fleet["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"]
    prefilled = _finished(states["prefill"])
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        if leaves == "at the first streamed token":
            got = b""
            while b"data: " not in got:
                chunk = sock.recv(4096)
                assert chunk, got
                got += chunk
            assert b"[DONE]" not in got  # it leaves mid-stream
    # The prefill ends after the client left: until then the engine holds no blocks yet, which is not
    # the release this test is about.
    _wait_finished(states["prefill"], prefilled + 1)
    _wait_no_blocks(states["prefill"], timeout_s=20)  # well before the hold's 60 s timeout
    _wait_no_blocks(states["decode"], timeout_s=20)
    if leaves == "at the first streamed token":  # the KV had moved: the decode engine pulled it
        assert fleet["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"] == pulls + 1


def test_bad_kv_transfer_params_are_a_400_naming_the_field(fleet):
    response = httpx.post(
        f"{fleet['urls']['decode']}/v1/completions",
        timeout=30,
        json={"prompt": "hello there", "max_tokens": 4, "kv_transfer_params": {"transfer_id": "x"}},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params"


def _innocent_stream(url: str, results: list[Any], first: threading.Event, max_tokens: int = 60) -> None:
    """A streaming completion on `url`, to the end: (status, completion tokens, finish_reason); `first` is
    set at its first chunk."""
    body = {"prompt": "A long story about", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        results.append(stream_completion(url, body, on_chunk=first.set))
    except Exception as exc:  # recorded, asserted by the caller
        results.append((None, 0, repr(exc)))
    first.set()


@pytest.mark.parametrize(
    ("params", "named"),
    [
        # The repro: counts as JSON floats for a 2-token prompt at block size 4 (they compare equal
        # to the prompt's 2 tokens and 1 block, and then broke the connector's slicing: a dead core).
        ({"num_tokens": 2.0, "num_blocks": 1.0, "first_token_id": 9}, "kv_transfer_params.num_tokens"),
        ({"num_tokens": 2, "num_blocks": 1, "first_token_id": 10**6}, "kv_transfer_params.first_token_id"),
    ],
)
def test_malformed_kv_transfer_params_are_a_400_while_an_innocent_stream_completes(fleet, params, named):
    url = fleet["urls"]["decode"]
    results: list[Any] = []
    first = threading.Event()
    innocent = threading.Thread(target=_innocent_stream, args=(url, results, first))
    innocent.start()
    assert first.wait(30)
    bad = {"remote_host": "127.0.0.1", "remote_port": 1, "transfer_id": "x", **params}
    response = httpx.post(
        f"{url}/v1/completions",
        timeout=30,
        json={"prompt": [5, 6], "max_tokens": 4, "kv_transfer_params": bad},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and named in error["message"]
    innocent.join(60)
    assert results == [(200, 60, "length")]
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    _wait_no_blocks(fleet["states"]["decode"])


def _completion_logprobs(url: str, body: dict[str, Any]) -> tuple[list[str], list[float], list[dict]]:
    """(tokens, token_logprobs, top_logprobs) of a completion, JSON or streamed (joined over chunks)."""
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        lp = response.json()["choices"][0]["logprobs"]
        return lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp:
                    tokens += lp["tokens"]
                    values += lp["token_logprobs"]
                    tops += lp["top_logprobs"]
    return tokens, values, tops


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_through_prefill_decode_equal_aggregated(fleet, stream):
    urls = fleet["urls"]
    body = {
        "prompt": "The quick brown fox jumps over",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 3,
        "stream": stream,
    }
    pulls = fleet["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"]
    want = _completion_logprobs(urls["aggregated"], body)
    got = _completion_logprobs(urls["proxy"], body)
    assert fleet["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"] == pulls + 1
    assert len(got[0]) == len(want[0]) == 10
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)
    for g, w in zip(got[2], want[2]):
        assert list(g) == list(w) and list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)
    # Chat: logprobs + top_logprobs, streamed, one entry per token.
    chat = {
        "messages": [{"role": "user", "content": "Name three colours, please."}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    entries = []
    for url in (urls["aggregated"], urls["proxy"]):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert response.status_code == 200, response.text
        entries.append(response.json()["choices"][0]["logprobs"]["content"])
    assert len(entries[1]) == len(entries[0]) == 8
    for g, w in zip(*entries):
        assert g["token"] == w["token"] and g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
    _wait_no_blocks(fleet["states"]["prefill"])


@pytest.mark.parametrize("min_tokens", [2, 5, 10])
def test_min_tokens_through_prefill_decode_equal_aggregated(fleet, min_tokens):
    urls = fleet["urls"]
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "min_tokens": min_tokens}
    pulls = fleet["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"]
    want = httpx.post(f"{urls['aggregated']}/v1/completions", json=body, timeout=60)
    got = httpx.post(f"{urls['proxy']}/v1/completions", json=body, timeout=60)
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert got.json()["usage"]["completion_tokens"] >= min_tokens
    assert fleet["engines"]["decode"].call_sync("kv_transfer_stats")["transfers"] == pulls + 1
    one = disaggregation.prefill_body({**body, "stream": True})
    assert one["min_tokens"] == 1 and one["max_tokens"] == 1 and one["stream"] is False


def test_which_requests_take_the_two_engine_path():
    assert disaggregation.covered({"prompt": "hi", "max_tokens": 8})
    assert disaggregation.covered({"messages": [], "max_completion_tokens": 8})
    assert not disaggregation.covered({"prompt": "hi", "max_tokens": 1})  # the prefill's token is the answer
    assert not disaggregation.covered({"prompt": "hi", "max_tokens": 8, "n": 2})
    assert not disaggregation.covered({"prompt": ["a", "b"], "max_tokens": 8})
    assert disaggregation.covered({"prompt": [1, 2, 3], "max_tokens": 8})  # token ids: one prompt


def test_spec_disaggregation_roles_and_serve_flags():
    from specfleet.engine.server.cli import build_parser, engine_config_kwargs
    from specfleet.operator.spec import InferenceServiceSpec

    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"source": "bundled://smollm2-135m-instruct"},
            "disaggregation": {"prefill": {"replicas": 2}, "decode": {}},
        }
    )
    assert (spec.disaggregation.prefill.replicas, spec.disaggregation.decode.replicas) == (2, 1)
    with pytest.raises(ValueError, match="replicas"):
        InferenceServiceSpec.model_validate(
            {
                "model": {"source": "bundled://smollm2-135m-instruct"},
                "disaggregation": {"prefill": {"replicas": 0}},
            }
        )
    kwargs = engine_config_kwargs(
        build_parser().parse_args(["--kv-role", "decode", "--kv-transfer-timeout-s", "5"])
    )
    assert (kwargs["kv_role"], kwargs["kv_transfer_timeout_s"]) == ("decode", 5.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-role", "middle"])
