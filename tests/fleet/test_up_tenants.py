"""`specfleet up -f svc.yaml --tenants tenants.yaml`: one InferenceService of real engines (the tiny llama,
the bundled model's tokenizer and layout) behind the gateway with tenants, driven by the official openai
client: a wrong key is a 401, a tenant's priority class reaches engines that schedule by priority, a stream
is charged its usage without the client seeing it, a tenant over its requests per minute gets a 429 with
OpenAI's headers, and a key taken out of the tenants file stops working within one --discovery-interval;
SIGINT stops everything cleanly."""

from __future__ import annotations

import copy
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import OutputWatch, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml").read_text())
KEYS = {"chat": "sk-chat-0123456789abcdef", "nightly": "sk-nightly-0123456789abcdef"}
ROTATED = "sk-nightly-rotated-0123456789abcdef"
INTERVAL_S = 0.5  # how often the tenants file is read again


def service(source: str) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(EXAMPLE)
    doc["metadata"] = {"name": "llm"}
    doc["spec"]["replicas"] = 1
    doc["spec"]["model"] = {"source": source, "dtype": "float32", "maxModelLen": 256}
    doc["spec"]["routing"] = {"policy": "round-robin"}
    return doc


def test_up_with_a_tenants_file_checks_keys_quotas_and_priorities(tiny_llama: str, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    (tmp_path / "llm.yaml").write_text(yaml.safe_dump(service(tiny_llama)))
    tenants = {
        "tenants": [
            {
                "name": "chat",
                "keys": [KEYS["chat"]],
                "models": ["llm"],
                "priority": "interactive",
                "tpm": 5000,
            },
            {"name": "nightly", "keys": [KEYS["nightly"]], "rpm": 2, "priority": "batch"},
        ]
    }
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    port = free_port()
    out = OutputWatch.start(
        "-m",
        "specfleet.fleet.local",
        "-f",
        str(tmp_path / "llm.yaml"),
        "--tenants",
        str(tmp_path / "tenants.yaml"),
        "--port",
        str(port),
        "--no-tune",
        "--engine-arg=--kv-cache-gib=0.05",
        "--engine-arg=--scheduling-policy=priority",
        "--discovery-interval",
        str(INTERVAL_S),
    )
    proc = out.proc
    try:
        out.wait_for(f"at http://127.0.0.1:{port}/v1 (gateway over 1 services", 240)

        def client(key: str) -> Any:
            return openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60
            )

        with pytest.raises(openai.AuthenticationError):
            client("sk-nobody-0123456789abcdef").models.list()
        chat = client(KEYS["chat"])
        assert [m.id for m in chat.models.list().data] == ["llm"]
        stream = chat.chat.completions.create(
            model="llm", max_tokens=3, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        chunks = list(stream)
        assert chunks and all(c.usage is None for c in chunks)  # asked of the engine, not shown
        raw = chat.completions.with_raw_response.create(model="llm", prompt="up", max_tokens=2)
        used = raw.parse().usage
        assert used is not None and raw.headers["x-ratelimit-limit-tokens"] == "5000"
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 5000  # charged at admission

        nightly = client(KEYS["nightly"])
        for _ in range(2):
            assert nightly.completions.create(model="llm", prompt="up", max_tokens=1).choices
        with pytest.raises(openai.RateLimitError) as over:
            nightly.completions.create(model="llm", prompt="up", max_tokens=1)
        assert over.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(over.value.response.headers["Retry-After"]) >= 1

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
        assert 'specfleet_gateway_tenant_requests_total{result="rate_limited",tenant="nightly"} 1.0' in text
        assert 'specfleet_gateway_tenant_requests_total{result="unauthorized",tenant="unknown"} 1.0' in text
        (charged,) = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('specfleet_gateway_tenant_tokens_total{result="ok",tenant="chat"}')
        ]
        assert (
            charged > used.total_tokens
        )  # the stream's usage too, read off the stream the client did not see

        # the tenants file is read again: a key taken out is a 401 within one interval, its successor works
        tenants["tenants"][1]["keys"] = [ROTATED]
        (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
        deadline = time.monotonic() + INTERVAL_S + 5
        while True:
            try:
                nightly.models.list()
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "the revoked key still works"
            time.sleep(0.1)
        assert [m.id for m in client(ROTATED).models.list().data] == ["llm"]

        proc.send_signal(signal.SIGINT)
        out.wait_for("stopped; engine exit codes", 60)
        assert proc.wait(30) == 0, out.tail()
    finally:
        out.kill()
