"""`specfleet up -f examples/smollm2-cpu.yaml`: one endpoint answers the official openai client, and
SIGINT drains and stops every engine cleanly."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from helpers import OutputWatch, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml"


def test_local_fleet_serves_openai_client_and_stops_cleanly() -> None:
    openai = pytest.importorskip("openai")
    port = free_port()
    out = OutputWatch.start(
        "-m",
        "specfleet.fleet.local",
        "-f",
        str(EXAMPLE),
        "--port",
        str(port),
        "--tune",
        "--interval",
        "5",
        "--engine-arg=--kv-cache-gib=0.25",
    )
    proc = out.proc
    try:
        out.wait_for("serving bundled://smollm2-135m-instruct", 180)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        models = client.models.list()
        assert models.data, "GET /v1/models through the endpoint returned no model"
        chat = client.chat.completions.create(
            model=models.data[0].id, max_tokens=8, messages=[{"role": "user", "content": "Say hello"}]
        )
        assert chat.choices[0].message.content
        stream = client.chat.completions.create(
            model=models.data[0].id,
            max_tokens=8,
            stream=True,
            messages=[{"role": "user", "content": "Count to three"}],
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len(pieces) >= 2 and "".join(pieces)
        out.wait_for("[tuner]", 30)  # the tuner runs and prints its decisions
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, out.tail()
        out.wait_for("stopped; engine exit codes [0]", 5)
    finally:
        out.kill()
