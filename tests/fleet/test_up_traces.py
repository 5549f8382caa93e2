"""One request's trace through the gateway of `specfleet up -f a.yaml -f b.yaml --tenants FILE
--otlp-traces-endpoint URL`: real engine processes (the tiny llama) and the gateway export over OTLP/HTTP to
an in-process receiver that decodes the protobuf; the official openai client sends a W3C `traceparent` with
a tenant's key. The receiver must hold, under the client's span, one router SERVER span naming the model,
the service that answered and the tenant, its `route` and `engine_request` children, and below the hop the
engine's `llm_request` with its queue, prefill and decode; the same prompt again shows its prefix-cache hit."""

from __future__ import annotations

import copy
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import OutputWatch, free_port
from otlp_receiver import Span, children, one, otlp_receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml").read_text())
KEY = "team-a-key-0123456789"
CLIENT_SPAN = "00f067aa0ba902b7"
# three 16-token blocks at least, so that the second request finds the first's full blocks cached
PROMPT = " ".join(f"word{i}" for i in range(40))


def service(name: str, source: str) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(EXAMPLE)
    doc["metadata"] = {"name": name}
    doc["spec"]["model"] = {"source": source, "dtype": "float32", "maxModelLen": 256}
    doc["spec"]["routing"] = {"weight": 100, "aliases": [], "policy": "round-robin"}
    return doc


def _trace_id(n: int) -> str:
    return f"{n:032x}"


def _complete(spans: list[Span], trace_id: str) -> bool:
    ours = [s for s in spans if s.trace_id == trace_id]
    # the engine's spans and the router's leave from different processes, each on its own batch schedule
    return any(s.name == "llm_request" for s in ours) and any(
        s.kind == "SERVER" and s.service == "specfleet-router" for s in ours
    )


def test_a_request_through_the_gateway_is_one_trace_with_model_service_tenant_and_cache_hits(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    openai = pytest.importorskip("openai")
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(service(f"llm-{name}", tiny_llama)))
    (tmp_path / "tenants.yaml").write_text(
        yaml.safe_dump({"tenants": [{"name": "team-a", "keys": [KEY], "models": ["llm-a", "llm-b"]}]})
    )
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # the SDK's batch delay (default 5 s), in ms
    port = free_port()
    with otlp_receiver() as receiver:
        out = OutputWatch.start(
            "-m",
            "specfleet.fleet.local",
            "-f",
            str(tmp_path / "a.yaml"),
            "-f",
            str(tmp_path / "b.yaml"),
            "--tenants",
            str(tmp_path / "tenants.yaml"),
            "--port",
            str(port),
            "--no-tune",
            "--otlp-traces-endpoint",
            receiver.url,  # a bare address: /v1/traces is added
            "--engine-arg=--kv-cache-gib=0.05",
        )
        try:
            out.wait_for(f"at http://127.0.0.1:{port}/v1 (gateway over 2 services", 240)
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60
            )
            answers = [
                client.completions.create(
                    model="llm-b",
                    prompt=PROMPT,
                    max_tokens=4,
                    extra_headers={"traceparent": f"00-{_trace_id(n)}-{CLIENT_SPAN}-01"},
                )
                for n in (1, 2)
            ]
            spans = receiver.wait_for(lambda s: all(_complete(s, _trace_id(n)) for n in (1, 2)))
            assert not receiver.errors

            cached = []
            for n, answer in zip((1, 2), answers, strict=True):
                ours = [s for s in spans if s.trace_id == _trace_id(n)]
                request = one(ours, kind="SERVER", service="specfleet-router")
                assert request.name == "POST /v1/completions" and request.parent_id == CLIENT_SPAN
                assert request.attributes["gen_ai.request.model"] == "llm-b"
                assert request.attributes["specfleet.service"] == "default/llm-b"
                assert request.attributes["specfleet.tenant"] == "team-a"
                assert request.attributes["http.response.status_code"] == 200
                route, hop = children(ours, request)
                assert (route.name, hop.name, hop.kind) == ("route", "engine_request", "CLIENT")
                assert route.attributes["specfleet.engine"] == hop.attributes["specfleet.engine"]
                engine = one(children(ours, hop), name="llm_request")
                assert engine.service == "specfleet-engine" and engine.kind == "SERVER"
                # the gateway rewrote the name the client asked for to the one the engines serve
                assert (
                    request.attributes["gen_ai.response.model"] == engine.attributes["gen_ai.request.model"]
                )
                assert [s.name for s in children(ours, engine)] == ["queue", "prefill", "decode"]
                assert engine.attributes["gen_ai.response.id"] == answer.id
                assert answer.usage is not None
                assert engine.attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
                assert engine.attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
                cached.append(engine.attributes["gen_ai.usage.cache_read.input_tokens"])
                assert cached[-1] == answer.usage.prompt_tokens_details.cached_tokens
            assert cached[0] == 0 and cached[1] >= 32  # the second found the first's full blocks

            out.proc.send_signal(signal.SIGINT)
            out.wait_for("stopped; engine exit codes", 60)
            assert out.proc.wait(30) == 0, out.tail()
        finally:
            out.kill()
