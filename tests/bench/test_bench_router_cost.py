"""`specfleet bench router`: its load generator finds the end of every response however the bytes arrive
and refuses a stream that lost events; the fake engine streams over a real socket; the whole bench (nginx,
the router, the fake engine) runs end to end at a tiny size and ends with the ratios."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from specfleet.bench.proxy_load import (
    CHUNKS,
    BadResponse,
    Connection,
    ResponseReader,
    completion_request,
    content_length,
    sse_chunks,
    start_upstream,
)
from specfleet.bench.router_cost import main, nginx_config
from specfleet.engine.python_child import python_command

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def feed_in_pieces(data: bytes, size: int) -> tuple[ResponseReader, list[bool]]:
    reader = ResponseReader()
    return reader, [reader.feed(data[i : i + size]) for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 64, 100_000])
def test_the_end_of_a_chunked_stream_is_found_at_its_last_byte_only(size: int) -> None:
    data = HEAD + b"".join(sse_chunks())
    reader, done = feed_in_pieces(data, size)
    assert done[-1] and not any(done[:-1])
    reader.check(CHUNKS)


def test_a_content_length_response_ends_at_its_length() -> None:
    body = b"data: [DONE]\n\n"
    reader, done = feed_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), 5)
    assert done[-1] and not any(done[:-1])
    reader.check(1)


def test_a_stream_that_lost_events_or_failed_is_refused() -> None:
    chunks = sse_chunks()
    reader, _ = feed_in_pieces(HEAD + b"".join(chunks[:10] + chunks[-1:]), 50)
    with pytest.raises(BadResponse, match="10 events arrived, 64 were sent"):
        reader.check(CHUNKS)
    reader, _ = feed_in_pieces(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n", 50)
    with pytest.raises(BadResponse, match="502"):
        reader.check(CHUNKS)
    with pytest.raises(BadResponse, match="neither chunked nor Content-Length"):
        ResponseReader().feed(b"HTTP/1.0 200 OK\r\n\r\n")


def test_request_heads_give_their_body_length() -> None:
    assert content_length(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 42") == 42
    assert content_length(b"GET /ready HTTP/1.1\r\nHost: x") == 0
    with pytest.raises(ValueError, match="Content-Length bodies only"):
        content_length(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked")


def test_the_fake_engine_streams_every_event_on_a_keep_alive_connection() -> None:
    async def run() -> list[float]:
        server, port = await start_upstream()
        conn = Connection("127.0.0.1", port, completion_request("127.0.0.1", port, "hi"))
        try:
            return [await conn.request() for _ in range(3)]  # one connection, three checked responses
        finally:
            conn.close()
            server.close()

    latencies = asyncio.run(run())
    assert len(latencies) == 3 and all(t > 0 for t in latencies)


def test_the_fake_engine_sends_usage_as_the_engine_does_when_asked() -> None:
    """A stream that asks for `include_usage` gets `"usage":null` in every chunk and a usage event before
    `[DONE]`, which the gateway's usage tap reads and strips back to the events the client expects."""
    from specfleet.router.usage_tap import UsageTap

    plain, usage = b"".join(sse_chunks()), b"".join(sse_chunks(usage=True))
    assert plain.count(b"data: ") == CHUNKS and usage.count(b"data: ") == CHUNKS + 1
    assert usage.count(b'"usage":null') == CHUNKS - 1
    tap = UsageTap(stream=True, strip=True)
    events = b"".join(tap.feed(piece) for piece in usage.split(b"\r\n")[1::2]) + tap.flush()
    assert events.count(b"data: ") == CHUNKS and b'"usage"' not in events and tap.total_tokens() == CHUNKS + 7

    async def run() -> tuple[bytes, bytes]:
        server, port = await start_upstream()
        answers = []
        try:
            for options in ("", ', "stream_options": {"include_usage": true}'):
                body = b'{"model": "bench", "stream": true%s}' % options.encode()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                answers.append(await reader.readuntil(b"0\r\n\r\n"))
                writer.close()
        finally:
            server.close()
        return answers[0], answers[1]

    without, asked = asyncio.run(run())
    assert b'"usage"' not in without and asked.count(b'"usage":{') == 1


def test_nginx_proxies_as_the_router_buffers() -> None:
    conf = nginx_config(Path("/tmp/x"), 8001, 9001)
    for directive in (
        "daemon off;",
        "worker_processes 1;",
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "server 127.0.0.1:9001;",
        "listen 127.0.0.1:8001;",
        "pid /tmp/x/nginx.pid;",
    ):
        assert directive in conf


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("/usr/sbin/nginx") is None, reason="Debian's nginx is not installed")
def test_the_bench_runs_end_to_end_and_ends_with_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench-router.json"
    router_src = str(Path(__file__).parents[2] / "router")  # the launcher for another version, on this one
    argv = ["--requests", "20", "--rounds", "2", "--ladder", "1,2", "--seconds", "0.3", "--out", str(out)]
    argv += ["--router-src", router_src]
    proc = subprocess.run(
        python_command("-m", "specfleet.cli.main", "bench", "router", *argv),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["added_p50_ratio_vs_nginx"] > 0 and summary["request_rate_ratio_vs_nginx"] > 0
    for target in ("direct", "nginx", "router"):
        assert summary[target]["max_rps"] > 0 and summary[target]["latency_p50_ms"] > 0
    assert summary["router"]["cpu_us_per_request"] > 0 and summary["cpu_per_request_ratio_vs_nginx"] > 0
    assert summary["workload"]["router_src"] == router_src
    assert json.loads(out.read_text())["rates"]["router"][-1]["concurrency"] == 2
    assert out.with_suffix(".png").stat().st_size > 0


def test_bad_arguments_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--ladder", "4,0"])
    assert exit_.value.code == 2 and "--ladder='4,0'" in capsys.readouterr().err
    assert main(["--seconds", "0"]) == 2 and "--seconds=0.0 must be > 0" in capsys.readouterr().err
    assert main(["--max-resumes", "-1"]) == 2 and "--max-resumes=-1 must be >= 0" in capsys.readouterr().err
    assert main(["--router-src", "/nonexistent"]) == 2
    assert "--router-src=/nonexistent holds no router" in capsys.readouterr().err
