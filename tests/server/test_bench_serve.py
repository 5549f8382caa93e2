"""`specfleet bench serve` against the real test server: table, JSON last line, PNG beside the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from specfleet.bench import serve as bench_serve

pytestmark = pytest.mark.slow


def test_prompt_mix_is_deterministic() -> None:
    a = bench_serve.prompt_mix(20, seed=7, min_out=4, max_out=9)
    assert a == bench_serve.prompt_mix(20, seed=7, min_out=4, max_out=9)
    assert a != bench_serve.prompt_mix(20, seed=8, min_out=4, max_out=9)
    assert all(4 <= r.max_tokens <= 9 for r in a) and len({r.prompt for r in a}) > 5


@pytest.mark.parametrize("load", [["--max-concurrency", "3"], ["--request-rate", "20"]])
def test_bench_serve_reports_latencies(
    server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], load: list[str]
) -> None:
    code = bench_serve.main(
        [
            "serve",
            "--url",
            server.url,
            "--num-prompts",
            "5",
            *load,
            "--min-output-len",
            "3",
            "--max-output-len",
            "5",
            "--slo",
            "ttft:60000",
            "tpot:60000",
            "--result-dir",
            str(tmp_path),
            "--label",
            "run",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert "TTFT" in "\n".join(out[:-1])
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert summary["output_throughput"] > 0 and summary["request_throughput"] > 0
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < summary[f"p50_{name}_ms"] <= summary[f"p99_{name}_ms"]
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # generous SLO: all good
    assert summary["total_output_tokens"] >= 15  # ignore_eos: every request runs to its length
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "run.json").read_text())["completed"] == 5


def test_bench_serve_rejects_bad_slo(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench_serve.main(["--url", "http://127.0.0.1:9", "--slo", "latency:5", "--result-dir", str(tmp_path)])


class _ClosingServer:
    """A raw HTTP/1.1 server over a real socket that, per connection, reads one request and then either
    closes without a byte (`drop`) or streams a one-chunk SSE answer, or starts that answer and cuts it."""

    def __init__(self, plan: list[str]) -> None:
        import socket
        import threading

        self.plan, self.requests = list(plan), 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        chunk = json.dumps({"choices": [{"delta": {"content": "hi"}}]})
        while self.plan:
            conn, _ = self.sock.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":")[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                while len(body) < length:
                    body += conn.recv(65536)
                self.requests += 1
                what = self.plan.pop(0)
                if what == "drop":
                    continue
                events = f"data: {chunk}\n\n" + ("data: [DONE]\n\n" if what == "answer" else "")
                headers = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                if what == "answer":
                    conn.sendall(f"{headers}content-length: {len(events)}\r\n\r\n{events}".encode())
                else:  # "cut": promises more than it sends, then closes
                    conn.sendall(f"{headers}content-length: 1000\r\n\r\n{events}".encode())


def _args(url: str) -> Any:
    import argparse

    return argparse.Namespace(url=url, endpoint="chat", temperature=0.0, ignore_eos=False)


def test_a_keep_alive_connection_closed_before_any_answer_is_sent_again() -> None:
    """llama-server closes a connection after a fixed number of requests; a request that drew that
    connection from the pool got "Server disconnected without sending a response" and counted as failed."""
    import asyncio

    import httpx

    server = _ClosingServer(["drop", "answer"])

    async def go() -> Any:
        async with httpx.AsyncClient(timeout=10) as client:
            return await bench_serve.send(
                client, _args(server.url), "m", bench_serve.BenchRequest("hello", 4)
            )

    result = asyncio.run(go())
    assert result.ok and server.requests == 2, result


def test_an_answer_cut_after_it_started_is_a_failure_not_sent_again() -> None:
    import asyncio

    import httpx

    server = _ClosingServer(["cut", "answer"])

    async def go() -> Any:
        async with httpx.AsyncClient(timeout=10) as client:
            return await bench_serve.send(
                client, _args(server.url), "m", bench_serve.BenchRequest("hello", 4)
            )

    result = asyncio.run(go())
    assert not result.ok and "RemoteProtocolError" in result.error and server.requests == 1, result
