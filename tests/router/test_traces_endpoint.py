"""Where spans go (engine/tracing.py `traces_endpoint`, shared by `specfleet serve`, `specfleet router` and
`specfleet up`): vLLM's `--otlp-traces-endpoint`, else OpenTelemetry's variables, else nowhere; anything
this project cannot send to (gRPC, a URL that is not http) refused at start with the name of what to fix."""

from __future__ import annotations

import pytest
from specfleet.engine.tracing import traces_endpoint
from specfleet.router import cli as router_cli
from specfleet.router.tracing import RouterTracer

OTEL = (
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
)


def test_nothing_is_set_so_there_are_no_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL:
        monkeypatch.delenv(name, raising=False)
    assert traces_endpoint(None) is None
    args = router_cli.build_parser().parse_args(["--endpoint", "http://127.0.0.1:1"])
    assert router_cli.build_tracer(args) is None  # no provider, no exporter, no thread


@pytest.mark.parametrize(
    ("flag", "env", "url"),
    [
        ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
        ("http://collector:4318/", {}, "http://collector:4318/v1/traces"),
        ("https://collector/otlp/v1/traces", {}, "https://collector/otlp/v1/traces"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom"}, "http://c:4318/custom"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
        (
            None,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x",
            },
            "http://t/x",
        ),
        (
            "http://flag:4318",
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318"},
            "http://flag:4318/v1/traces",
        ),
        (
            None,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            "http://c:4318/v1/traces",
        ),
        ("http://flag:4318", {"OTEL_SDK_DISABLED": "true"}, None),
    ],
)
def test_the_flag_then_the_variables_name_the_collector(
    flag: str | None, env: dict[str, str], url: str | None
) -> None:
    assert traces_endpoint(flag, env) == url


@pytest.mark.parametrize(
    ("flag", "env", "named"),
    [
        ("grpc://collector:4317", {}, "--otlp-traces-endpoint"),
        ("collector:4318", {}, "--otlp-traces-endpoint"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        (
            "http://c:4318",
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ],
)
def test_what_cannot_be_sent_to_is_refused_naming_what_to_fix(
    flag: str | None, env: dict[str, str], named: str
) -> None:
    with pytest.raises(ValueError, match=named) as refused:
        traces_endpoint(flag, env)
    assert "4318" in str(refused.value)  # says which port to use instead


def test_the_router_refuses_a_grpc_collector_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    code = router_cli.main(["--endpoint", "http://127.0.0.1:1", "--otlp-traces-endpoint", "grpc://c:4317"])
    assert code == 2
    assert (
        "specfleet router: --otlp-traces-endpoint='grpc://c:4317' must be an http://"
        in capsys.readouterr().err
    )


def test_specfleet_up_refuses_a_grpc_collector_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specfleet.fleet import local

    code = local.main(["-f", "examples/smollm2-cpu.yaml", "--otlp-traces-endpoint", "grpc://c:4317"])
    assert code == 2
    assert "--otlp-traces-endpoint='grpc://c:4317'" in capsys.readouterr().err


def test_the_router_s_hop_replaces_the_client_s_context_with_its_own() -> None:
    """The engine's span must hang under the router's hop, not beside it under the client's span."""
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider

    tracer = RouterTracer(TracerProvider())
    client = {"Traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "x-other": "1"}
    sent: list[dict[str, str]] = []

    async def send(headers: dict[str, str]) -> None:
        sent.append(headers)

    asyncio.run(tracer.hop("engine_request", client, send, {}))
    (headers,) = sent
    assert [k for k in headers if k.lower() == "traceparent"] == ["traceparent"]
    assert headers["x-other"] == "1" and "00f067aa0ba902b7" not in headers["traceparent"]


def test_the_routers_of_one_process_share_one_tracer_per_collector_until_the_last_stops() -> None:
    """`specfleet up -f a.yaml -f b.yaml` runs the gateway and a Router per service in one process: a
    request's SERVER span (the gateway's) and its route and engine_request spans (the service's) must leave
    through one batch queue, and the first service to stop must not drop the spans of the ones still up."""
    from otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        url = f"{receiver.url}/v1/traces"
        first, second = RouterTracer.from_endpoint(url), RouterTracer.from_endpoint(url)
        elsewhere = RouterTracer.from_endpoint(f"{receiver.url}/other/v1/traces")
        assert first is second and elsewhere is not first
        elsewhere.shutdown()
        first.shutdown()  # one service stopped; the other still sends
        second.tracer.start_span("after the first stopped").end()
        second.shutdown()  # the last user: flushed and stopped
        spans = receiver.wait_for(lambda s: any(x.name == "after the first stopped" for x in s), 10)
        assert [s.service for s in spans] == ["specfleet-router"]
        again = RouterTracer.from_endpoint(url)
        assert again is not first  # a stopped provider is never handed out again
        again.shutdown()
