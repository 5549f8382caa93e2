"""The router as an InferencePool's endpoint picker: a real gRPC client plays Envoy's side of ext_proc (the
messages from envoy-data-plane's protos), engines are real HTTP servers found by the router's discovery
(their /ready probed), and the request goes on to the engine the picker named, as the gateway sends it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import grpc
import pytest
from envoy_data_plane.envoy.config.core.v3 import (
    HeaderMap,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    Metadata,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as Mode
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy_data_plane.google.protobuf import ListValue, Struct, Value
from specfleet.engine.kv_transfer import prefill_signature
from specfleet.router.discovery import probe_forever
from specfleet.router.endpoint_picker import (
    DESTINATION_KEY,
    EXT_PROC_SERVICE,
    PREFILLER_HEADER,
    SERVED_KEY,
    SIGNATURE_HEADER,
    SUBSET_KEY,
    _header_response,
    address,
)
from specfleet.router.endpoints import EndpointSet
from specfleet.router.ext_proc_server import serve_endpoint_picker
from specfleet.router.policies import make_policy
from specfleet.router.prefix import BlockHasher
from specfleet.router.proxy import Router

from .engines import FakeEngine

PROMPT = "You are a helpful assistant. " * 12  # a few blocks: the prefix policy's affinity applies
PROCESS = f"/{EXT_PROC_SERVICE}/Process"


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=60))


class Envoy:
    """Envoy's side of one ext_proc stream: send a message, read the answers it causes."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._outbox: asyncio.Queue[ProcessingRequest | None] = asyncio.Queue()
        call = channel.stream_stream(
            PROCESS,
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )
        self.call = call(self._messages())

    async def _messages(self) -> AsyncIterator[ProcessingRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def send(self, message: ProcessingRequest, answers: int) -> list[ProcessingResponse]:
        await self._outbox.put(message)
        return [await asyncio.wait_for(self.call.read(), 10) for _ in range(answers)]

    async def close(self) -> None:
        await self._outbox.put(None)


def headers(
    end: bool = False,
    subset: list[str] | None = None,
    mode: Mode = Mode.FULL_DUPLEX_STREAMED,
    without_waiting: bool = False,
    **extra: str,
) -> ProcessingRequest:
    values = [
        HeaderValue(key=k, raw_value=v.encode())
        for k, v in {":path": "/v1/completions", ":method": "POST", **extra}.items()
    ]
    metadata = None
    if subset is not None:
        hint = Value(list_value=ListValue(values=[Value(string_value=a) for a in subset]))
        metadata = Metadata(filter_metadata={"envoy.lb.subset_hint": Struct(fields={SUBSET_KEY: hint})})
    return ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end),
        metadata_context=metadata,
        protocol_config=ProtocolConfiguration(
            request_body_mode=mode,
            response_body_mode=mode,
            send_body_without_waiting_for_header_response=without_waiting,
        ),
    )


def set_headers(response: ProcessingResponse) -> dict[str, HeaderValueOption]:
    phase = response.request_headers or response.request_body
    return {option.header.key: option for option in phase.response.header_mutation.set_headers}


def picked(response: ProcessingResponse) -> str:
    """The pick, checked to be the same in the header and in the envoy.lb dynamic metadata."""
    header = set_headers(response)[DESTINATION_KEY].header.raw_value.decode()
    metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_KEY].string_value
    assert header == metadata
    return header


async def start(
    urls: list[str], policy: str = "prefix", prefill_key: bytes | None = None
) -> tuple[Router, grpc.aio.Server, grpc.aio.Channel, asyncio.Task[None]]:
    router = Router(EndpointSet(), make_policy(policy), BlockHasher(16, None, 0), max_retries=1)
    found = asyncio.Event()

    def on_change(states) -> None:  # the router's discovery of static endpoints (--endpoint): /ready probed
        router.endpoints_changed(router.endpoints.replace(states))
        found.set()

    discovery = asyncio.create_task(probe_forever(urls, on_change, interval_s=0.2))
    await found.wait()
    server, port = await serve_endpoint_picker(router, "127.0.0.1", 0, prefill_key)
    return router, server, grpc.aio.insecure_channel(f"127.0.0.1:{port}"), discovery


async def stop(
    server: grpc.aio.Server, channel: grpc.aio.Channel, discovery: asyncio.Task[None], *engines: FakeEngine
) -> None:
    discovery.cancel()
    await channel.close()
    await server.stop(0)
    for engine in engines:
        await engine.stop()


def test_duplex_streamed_conversation_picks_forwards_and_counts():
    """Envoy's FULL_DUPLEX_STREAMED (the extension's mode): the headers' answer waits for the body's last chunk,
    names a primary and a fallback, the body comes back unchanged in streamed chunks; the gateway sends it to
    the primary; the response's phases pass back; the engine's count of requests ends with the response."""

    async def test() -> None:
        engines = [await FakeEngine(n).start() for n in ("a", "b")]
        router, server, channel, discovery = await start([e.url for e in engines])
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 4}).encode()
        chunks = [body[:40], body[40:100], body[100:]]
        picks = []
        for _ in range(2):  # the same prompt twice: the prefix policy sends it where its blocks are
            envoy = Envoy(channel)
            assert await envoy.send(headers(), 0) == []  # held for the body
            assert await envoy.send(ProcessingRequest(request_body=HttpBody(body=chunks[0])), 0) == []
            assert await envoy.send(ProcessingRequest(request_body=HttpBody(body=chunks[1])), 0) == []
            first, echoed = await envoy.send(
                ProcessingRequest(request_body=HttpBody(body=chunks[2], end_of_stream=True)), 2
            )
            endpoints = picked(first).split(",")
            assert len(endpoints) == 2 and set(endpoints) == {address(e.url) for e in engines}
            streamed = echoed.request_body.response.body_mutation.streamed_response
            assert streamed.body == body and streamed.end_of_stream
            primary = router.endpoints.get(f"http://{endpoints[0]}")
            assert primary.outstanding == 1
            async with aiohttp.ClientSession() as session:  # the gateway sends the request to the primary
                async with session.post(f"http://{endpoints[0]}/v1/completions", data=body) as answer:
                    served = await answer.read()
            served_metadata = Metadata(
                filter_metadata={"envoy.lb": Struct(fields={SERVED_KEY: Value(string_value=endpoints[0])})}
            )
            (head,) = await envoy.send(
                ProcessingRequest(response_headers=HttpHeaders(), metadata_context=served_metadata), 1
            )
            assert head.response_headers is not None
            (tail,) = await envoy.send(
                ProcessingRequest(response_body=HttpBody(body=served, end_of_stream=True)), 1
            )
            assert tail.response_body.response.body_mutation.streamed_response.body == served
            assert primary.outstanding == 0
            await envoy.close()
            picks.append(endpoints[0])
        assert picks[0] == picks[1]
        (engine,) = [e for e in engines if address(e.url) == picks[0]]
        assert [r for r in engine.requests if r] == [body, body]  # besides the /ready probes
        await stop(server, channel, discovery, *engines)

    run(test)


def body_chunk(body: bytes, end: bool = False) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=end))


def test_buffered_and_streamed_modes_subset_hint_and_a_served_fallback():
    """BUFFERED: the headers pass on, the body's answer carries the pick; STREAMED whose headers wait for the
    body: the headers' answer, then one answer per chunk; the gateway's subset hint narrows the choice; a
    response the gateway says a fallback served counts on the fallback."""

    async def test() -> None:
        engines = [await FakeEngine(n).start() for n in ("a", "b", "c")]
        router, server, channel, discovery = await start([e.url for e in engines], "least-loaded")
        body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
        subset = [address(engines[1].url), address(engines[2].url)]

        envoy = Envoy(channel)
        (head,) = await envoy.send(headers(subset=subset, mode=Mode.BUFFERED), 1)
        assert head.request_headers.response.header_mutation is None  # no pick before the body
        (answer,) = await envoy.send(body_chunk(body, end=True), 1)
        primary, fallback = picked(answer).split(",")
        assert {primary, fallback} == set(subset)
        assert router.endpoints.get(f"http://{primary}").outstanding == 1
        served = Metadata(
            filter_metadata={"envoy.lb": Struct(fields={SERVED_KEY: Value(string_value=fallback)})}
        )
        (resp,) = await envoy.send(
            ProcessingRequest(response_headers=HttpHeaders(), metadata_context=served), 1
        )
        assert resp.response_headers is not None
        assert router.endpoints.get(f"http://{primary}").outstanding == 0
        assert router.endpoints.get(f"http://{fallback}").outstanding == 1
        (resp,) = await envoy.send(
            ProcessingRequest(response_body=HttpBody(body=b"{}", end_of_stream=True)), 1
        )
        assert resp.response_body.response.body_mutation is None  # BUFFERED response: passed on as it was
        assert router.endpoints.get(f"http://{fallback}").outstanding == 0
        await envoy.close()

        envoy = Envoy(channel)
        assert await envoy.send(headers(mode=Mode.STREAMED, without_waiting=True), 0) == []
        assert await envoy.send(body_chunk(body[:50]), 0) == []
        first, *chunks = await envoy.send(body_chunk(body[50:], end=True), 3)
        assert first.request_headers is not None and len(picked(first).split(",")) == 2
        assert [c.request_body.response.body_mutation for c in chunks] == [None, None]
        await envoy.close()
        await stop(server, channel, discovery, *engines)

    run(test)


def test_refusals_name_why_and_health_follows_discovery():
    """A body that is not JSON: 400; a subset hint naming no ready engine, or no engine ready at all: 503 with
    the reason; the gRPC health service: liveness always, readiness once discovery reported."""

    async def test() -> None:
        engine = await FakeEngine("a").start()
        router, server, channel, discovery = await start([engine.url])

        async def refusal(*messages: ProcessingRequest) -> tuple[int, str]:
            envoy = Envoy(channel)
            for message in messages[:-1]:
                await envoy.send(message, 0)
            (answer,) = await envoy.send(messages[-1], 1)
            await envoy.close()
            refused = answer.immediate_response
            assert refused.headers.set_headers[0].header.raw_value == b"application/json"
            return refused.status.code, json.loads(refused.body)["error"]["message"]

        status, message = await refusal(headers(), body_chunk(b"{not json", end=True))
        assert status == 400 and "not valid JSON" in message
        status, message = await refusal(headers(), body_chunk(b"[1, 2]", end=True))
        assert status == 400 and "JSON object" in message
        status, message = await refusal(headers(end=True, subset=["10.9.9.9:8000"]))
        assert status == 503 and "10.9.9.9:8000" in message

        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        for service in (b"liveness", b"readiness", EXT_PROC_SERVICE.encode()):
            assert await check(bytes([0x0A, len(service)]) + service) == bytes([0x08, 1])  # SERVING

        discovery.cancel()
        router.endpoints_changed(router.endpoints.replace({engine.url: (False, False)}))  # not ready
        status, message = await refusal(headers(end=True))
        assert status == 503 and "no engine" in message
        router.stopping = router.draining = True  # SIGTERM: readiness fails, liveness holds
        status, message = await refusal(headers(end=True))
        assert status == 503 and "stopping" in message
        assert await check(bytes([0x0A, 9]) + b"readiness") == bytes([0x08, 2])  # NOT_SERVING
        assert await check(b"") == bytes([0x08, 1])
        await stop(server, channel, discovery, engine)

    run(test)


def test_hand_encoded_answers_are_what_the_message_classes_encode():
    """The answers written as bytes (ext_proc_wire.py) against betterproto2's encoding of the same message."""
    from envoy_data_plane.envoy.service.ext_proc.v3 import (
        BodyMutation,
        BodyResponse,
        CommonResponse,
        StreamedBodyResponse,
    )
    from specfleet.router import ext_proc_wire as wire

    for phase, name in ((wire.REQUEST_BODY, "request_body"), (wire.RESPONSE_BODY, "response_body")):
        for chunk, end in ((b"data: {}\n\n", False), (b"x" * 70_000, True), (b"", True), (b"", False)):
            streamed = StreamedBodyResponse(body=chunk, end_of_stream=end)
            mutation = BodyMutation(streamed_response=streamed)
            message = ProcessingResponse(
                **{name: BodyResponse(response=CommonResponse(body_mutation=mutation))}
            )
            assert wire.streamed_body(phase, chunk, end) == message.SerializeToString()


def test_prefill_engines_are_named_to_the_decode_engine_in_llm_ds_header():
    """A pool with prefill engines: the destination and its fallbacks are decode engines only; a prefill
    engine (the fewest requests in flight) is named in x-prefiller-host-port, overwriting a client's value,
    and counted until the response ends; a request the two-engine path does not cover, or a pool whose
    prefill engines are not ready, gets no such header and a client's is removed. With a key, the named
    engine and the body are signed in x-specfleet-prefill-signature, over a client's own value; without a
    prefill engine, or without a key, a client's signature is removed."""
    key = b"the picker's and decode engines' shared key"

    async def test() -> None:
        decode = [await FakeEngine(n).start() for n in ("decode-a", "decode-b")]
        prefill = [await FakeEngine(n).start() for n in ("prefill-a", "prefill-b")]
        router, server, channel, discovery = await start(
            [e.url for e in decode + prefill], "least-loaded", key
        )
        for engine in prefill:
            router.endpoints.set_state(engine.url, role="prefill")
        for engine in decode:
            router.endpoints.set_state(engine.url, role="decode")
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 8}).encode()

        async def exchange(content: bytes) -> tuple[Envoy, ProcessingResponse]:
            envoy = Envoy(channel)  # a client that names a host of its own, which must not get through
            forged = {PREFILLER_HEADER: "attacker.example:80", SIGNATURE_HEADER: "v1:1:00"}
            assert await envoy.send(headers(**forged), 0) == []
            first, _echoed = await envoy.send(body_chunk(content, end=True), 2)
            return envoy, first

        envoys, prefillers = [], []
        for _ in range(2):  # two requests in flight: the second prefill goes to the other prefill engine
            envoy, first = await exchange(body)
            assert set(picked(first).split(",")) == {address(e.url) for e in decode}
            option = set_headers(first)[PREFILLER_HEADER]
            assert option.append_action == HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
            prefillers.append(option.header.raw_value.decode())
            signature = set_headers(first)[SIGNATURE_HEADER]
            assert signature.append_action == HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
            assert signature.header is not None
            signed = signature.header.raw_value.decode()
            prefill_signature.verify(key, signed, prefillers[-1], body)
            with pytest.raises(prefill_signature.Rejected):  # it names that engine, not another
                prefill_signature.verify(key, signed, "attacker.example:80", body)
            phase = first.request_headers or first.request_body
            assert phase is not None and phase.response is not None
            assert phase.response.header_mutation is not None
            assert phase.response.header_mutation.remove_headers == []
            envoys.append(envoy)
        assert sorted(prefillers) == sorted(address(e.url) for e in prefill)
        assert [router.endpoints.get(e.url).outstanding for e in prefill] == [1, 1]
        for envoy in envoys:  # the responses end: the prefill engines' counts end with them
            await envoy.send(ProcessingRequest(response_headers=HttpHeaders()), 1)
            await envoy.send(ProcessingRequest(response_body=HttpBody(body=b"{}", end_of_stream=True)), 1)
            await envoy.close()
        assert [router.endpoints.get(e.url).outstanding for e in prefill + decode] == [0, 0, 0, 0]

        two = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 8, "n": 2}).encode()
        envoy, first = await exchange(two)  # n > 1: the decode engine runs it aggregated
        phase = first.request_headers or first.request_body
        assert PREFILLER_HEADER not in set_headers(first) and SIGNATURE_HEADER not in set_headers(first)
        assert phase.response.header_mutation.remove_headers == [PREFILLER_HEADER, SIGNATURE_HEADER]
        await envoy.close()

        discovery.cancel()
        for engine in prefill:
            router.endpoints.set_state(engine.url, ready=False)
        envoy, first = await exchange(body)  # no prefill engine ready: aggregated on the decode engine
        phase = first.request_headers or first.request_body
        assert PREFILLER_HEADER not in set_headers(first) and SIGNATURE_HEADER not in set_headers(first)
        assert phase.response.header_mutation.remove_headers == [PREFILLER_HEADER, SIGNATURE_HEADER]
        assert picked(first).split(",")[0] in {address(e.url) for e in decode}
        await envoy.close()
        await stop(server, channel, discovery, *decode, *prefill)

    run(test)
    # A picker without a key names the engine unsigned (llm-d's sidecar, or engines narrowed by CIDRs) and
    # removes a client's signature all the same.
    common, _ = _header_response("10.0.0.1:8000", "10.0.0.2:8000", None)
    assert [o.header.key for o in common.header_mutation.set_headers] == [DESTINATION_KEY, PREFILLER_HEADER]
    assert common.header_mutation.remove_headers == [SIGNATURE_HEADER]


def test_the_pickers_key_file_needs_the_ext_proc_port_and_a_key(tmp_path, capsys):
    """Refused before the router serves anything: a key without a picker to sign with, or no usable key."""
    from specfleet.router.cli import main

    (tmp_path / "key").write_text("a key of more than sixteen bytes\n")
    assert main(["--endpoint", "http://127.0.0.1:1", "--remote-prefill-key-file", str(tmp_path / "key")]) == 2
    assert "--remote-prefill-key-file signs the endpoint picker's prefill header" in capsys.readouterr().err
    missing = ["--ext-proc-port", "9002", "--remote-prefill-key-file", str(tmp_path / "missing")]
    assert main(["--endpoint", "http://127.0.0.1:1", *missing]) == 2
    assert "cannot read the key" in capsys.readouterr().err
