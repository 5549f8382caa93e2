"""One request's trace across a prefill/decode pair: real uvicorn servers for a prefill and a decode engine
(each with its engine core process) behind the router (real aiohttp), all exporting over OTLP/HTTP to an
in-process receiver that decodes the protobuf; the official openai client sends a W3C `traceparent`. The
receiver must hold one tree under the client's span: the router's request, its prefill leg with the
prefill engine's `llm_request` (queue, prefill) below it, the route, and the decode leg with the decode
engine's `llm_request` (queue, kv_transfer, decode), the two engines' spans naming the same transfer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import free_port
from otlp_receiver import Receiver, Span, children, one, otlp_receiver
from role_servers import pd_endpoints, served_roles
from specfleet.engine.config import EngineConfig
from specfleet.engine.core.client import EngineCoreClient
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router, serve
from specfleet.router.tracing import RouterTracer

COMMON = dict(block_size=4, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=64)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def traced(tiny_llama) -> Iterator[dict[str, Any]]:
    from specfleet.engine.server.app import build_state

    with otlp_receiver() as receiver:
        engines = {
            role: EngineCoreClient(
                EngineConfig(model=tiny_llama, kv_role=role, **COMMON), log_level="warning"
            )
            for role in ("prefill", "decode")
        }
        traces = f"{receiver.url}/v1/traces"
        states = {role: build_state(engine, otlp_traces_endpoint=traces) for role, engine in engines.items()}
        with served_roles(states, engines) as urls:
            yield from _routed(receiver, urls, engines)


def _routed(receiver: Any, urls: dict[str, str], engines: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The traced router in front of the served engines, on a loop of its own, until the module ends."""
    tracer = RouterTracer.from_endpoint(f"{receiver.url}/v1/traces")
    router = Router(pd_endpoints(urls), make_policy("least-loaded"), max_retries=0, tracer=tracer)
    loop, port = asyncio.new_event_loop(), free_port()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(serve(router, "127.0.0.1", port), loop).result(30)
    loop.call_soon_threadsafe(router.endpoints_changed)
    try:
        yield {"receiver": receiver, "router": f"http://127.0.0.1:{port}", "engines": engines}
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        tracer.shutdown()


def _tree_done(spans: list[Span]) -> bool:
    ours = [s for s in spans if s.trace_id == TRACE_ID]
    return sum(s.name == "llm_request" for s in ours) == 2 and any(
        s.kind == "SERVER" and s.name.startswith("POST") for s in ours
    )


def test_one_request_through_a_pd_pair_is_one_trace_under_the_clients_span(traced) -> None:
    openai = pytest.importorskip("openai")
    receiver: Receiver = traced["receiver"]
    client = openai.OpenAI(base_url=f"{traced['router']}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(
        model=client.models.list().data[0].id,
        prompt="The quick brown fox jumps over the lazy dog",
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "trace-me"},
    )
    answer = raw.parse()
    spans = [s for s in receiver.wait_for(_tree_done) if s.trace_id == TRACE_ID]
    assert not receiver.errors

    request = one(spans, kind="SERVER", name="POST /v1/completions")
    assert request.parent_id == CLIENT_SPAN and request.service == "specfleet-router"
    assert request.attributes["gen_ai.request.id"] == "trace-me"
    assert request.attributes["http.response.status_code"] == 200
    assert [s.name for s in children(spans, request)] == ["prefill_request", "route", "engine_request"]
    prefill_leg, route, decode_leg = children(spans, request)
    assert prefill_leg.kind == decode_leg.kind == "CLIENT"
    assert route.attributes["specfleet.engine"] == decode_leg.attributes["specfleet.engine"]
    transfer_id = prefill_leg.attributes["specfleet.kv.transfer_id"]

    prefill = one(children(spans, prefill_leg), name="llm_request")
    decode = one(children(spans, decode_leg), name="llm_request")
    assert prefill.service == decode.service == "specfleet-engine" and prefill.kind == "SERVER"
    assert prefill.attributes["specfleet.kv.role"] == "prefill"
    assert decode.attributes["specfleet.kv.role"] == "decode"
    assert prefill.attributes["specfleet.kv.transfer_id"] == decode.attributes["specfleet.kv.transfer_id"]
    assert decode.attributes["specfleet.kv.transfer_id"] == transfer_id
    assert [s.name for s in children(spans, prefill)] == ["queue", "prefill"]
    assert [s.name for s in children(spans, decode)] == ["queue", "kv_transfer", "decode"]

    usage = answer.usage
    assert usage is not None
    for span in (prefill, decode):
        assert span.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert span.attributes["gen_ai.request.model"] == answer.model
    assert prefill.attributes["gen_ai.usage.output_tokens"] == 1
    assert decode.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == MAX_TOKENS
    assert decode.attributes["gen_ai.response.id"] == answer.id == "cmpl-trace-me"
    assert decode_leg.attributes["gen_ai.response.id"] == raw.headers["x-request-id"] == "trace-me"
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]

    pull = one(children(spans, decode), name="kv_transfer")
    blocks = -(-usage.prompt_tokens // COMMON["block_size"])
    assert (
        pull.attributes["specfleet.kv.blocks_loaded"] + pull.attributes["specfleet.kv.blocks_skipped"]
        == blocks
    )
    assert pull.attributes["specfleet.kv.bytes"] > 0 and pull.attributes["specfleet.kv.fallback"] is False
    assert decode.attributes["gen_ai.latency.kv_cache_transfer_time"] == pytest.approx(pull.seconds, abs=1e-3)

    # every child lies within its parent, and the legs run in order: prefill, route, decode
    for parent in (request, prefill_leg, decode_leg, prefill, decode):
        for child in children(spans, parent):
            assert parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns + 1_000_000, child
    assert prefill_leg.end_ns <= route.start_ns <= decode_leg.start_ns
