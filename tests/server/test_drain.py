"""SIGTERM drains `python -m specfleet.engine`: /ready false, new requests 503, in-flight finish, exit 0."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import start_server, wait_for
from specfleet.engine.server.cli import build_parser, engine_config_kwargs

pytestmark = pytest.mark.slow
SECRET_PROMPT = "zebra-violet-unicorn says"


def test_cli_flags_map_onto_engine_config() -> None:
    args = build_parser().parse_args(
        [
            "--model",
            "file:///models/x",
            "--max-num-seqs",
            "12",
            "--max-num-batched-tokens",
            "512",
            "--block-size",
            "32",
            "--max-model-len",
            "4096",
            "--dtype",
            "bfloat16",
            "--speculative-method",
            "draft",
            "--num-speculative-tokens",
            "3",
            "--draft-model",
            "file:///models/d",
            "--no-prefix-caching",
            "--kv-cache-memory-fraction",
            "0.5",
            "--kv-cache-gib",
            "1.5",
        ]
    )
    kwargs = engine_config_kwargs(args)
    assert kwargs["model"] == "file:///models/x" and kwargs["max_num_seqs"] == 12
    assert kwargs["max_num_batched_tokens"] == 512 and kwargs["block_size"] == 32
    assert kwargs["max_model_len"] == 4096 and kwargs["dtype"] == "bfloat16"
    assert kwargs["speculative_method"] == "draft" and kwargs["num_speculative_tokens"] == 3
    assert kwargs["draft_model"] == "file:///models/d" and kwargs["enable_prefix_caching"] is False
    assert kwargs["kv_cache_memory_fraction"] == 0.5 and kwargs["kv_cache_gib"] == 1.5
    from specfleet.engine import EngineConfig

    EngineConfig(**kwargs)  # every flag is a real EngineConfig field


def _stream(url: str, results: list[Any], first_chunk: threading.Event, max_tokens: int) -> None:
    """Stream one completion; `first_chunk` is set at its first SSE chunk, or when it ended without one
    (a refusal or an error), so that a waiter never sits out its timeout on a stream that failed."""
    body = {
        "prompt": SECRET_PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    chunks: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    first_chunk.set()
        results.append((resp.status_code, chunks))
    except Exception as exc:  # recorded, asserted below
        results.append((None, [repr(exc)]))
    finally:
        first_chunk.set()


def _start(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`python -m specfleet.engine` on a free port, once /ready answers 200: (process, url, log path)."""
    log_path = tmp_path / "server.log"
    proc, url = start_server(log_path, *flags)
    return proc, url, log_path


def _serve_under_load(tmp_path: Path, drain_timeout: float, max_tokens: int) -> tuple[int, list[Any], str]:
    """Start `python -m specfleet.engine`, stream 4 requests, SIGTERM, check the drain window; return
    (exit code, per-stream (status, SSE payloads), log)."""
    proc, url, log_path = _start(tmp_path, "--drain-timeout", str(drain_timeout))
    results: list[Any] = []
    try:
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(url, results, ev, max_tokens)) for ev in started]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(120) and all(r[0] == 200 for r in results), f"a stream failed: {results}"
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn false"
            time.sleep(0.05)
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and int(late.headers["retry-after"]) > 0
        assert late.json()["error"]["code"] == "draining"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        for t in threads:
            t.join(120)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, results, log_path.read_text()


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path: Path) -> None:
    pytest.importorskip("specfleet.engine.llm_engine", reason="the engine core is not in the tree yet")
    code, results, log_text = _serve_under_load(tmp_path, drain_timeout=90, max_tokens=24)
    assert code == 0, log_text[-3000:]
    assert len(results) == 4
    for status, chunks in results:
        assert status == 200, chunks
        assert chunks[-1] == "[DONE]"
        assert '"finish_reason":"length"' in chunks[-2]
    request_lines = [line for line in log_text.splitlines() if "event=request " in line]
    assert len(request_lines) == 4 and all("finish_reason=length" in line for line in request_lines)
    assert SECRET_PROMPT not in log_text  # never the prompt in the logs
    assert "event=drain_done" in log_text


def test_drain_timeout_aborts_what_is_left_and_still_exits_0(tmp_path: Path) -> None:
    pytest.importorskip("specfleet.engine.llm_engine", reason="the engine core is not in the tree yet")
    code, results, log_text = _serve_under_load(tmp_path, drain_timeout=1, max_tokens=400)
    assert code == 0, log_text[-3000:]
    assert len(results) == 4
    for status, chunks in results:
        assert status == 200 and chunks[-1] == "[DONE]", chunks[-3:]
        assert not any('"finish_reason":"length"' in c for c in chunks)  # cut short, not finished
        assert '"finish_reason":"abort"' in chunks[-2]
    assert "event=drain_timeout aborted=4" in log_text
    assert sum("finish_reason=abort" in line for line in log_text.splitlines()) == 4


def test_sigterm_fails_readiness_before_refusing_requests(tmp_path: Path) -> None:
    """The pod's termination order (docs/operator.md, Rollouts): at SIGTERM /ready fails at once, yet a
    request that was routed before the endpoint went is still served during --shutdown-delay; only then do
    new requests get 503, while the one in flight is still streaming; exit 0.

    The in-flight stream asks for far more tokens than any machine decodes in the delay window and the drain
    timeout then cuts it, so the drain window is open when the late request arrives however fast the host
    is (with a stream that could finish inside the delay, the server had exited before the late request)."""
    pytest.importorskip("specfleet.engine.llm_engine", reason="the engine core is not in the tree yet")
    delay, drain_timeout = 5.0, 3.0
    room = ("--max-model-len", "4096", "--kv-cache-gib", "0.5")  # for the long stream: ~46 KB of KV a token
    proc, url, log_path = _start(
        tmp_path, *room, "--drain-timeout", str(drain_timeout), "--shutdown-delay", str(delay)
    )
    results: list[Any] = []
    try:
        started = threading.Event()
        stream = threading.Thread(target=_stream, args=(url, results, started, 4000))
        stream.start()
        assert started.wait(120) and not results, f"the stream did not start: {results}"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while httpx.get(f"{url}/ready", timeout=5).status_code != 503:
            assert time.monotonic() - sent < 1.0, "/ready did not fail at SIGTERM"
            time.sleep(0.02)
        assert httpx.get(f"{url}/ready", timeout=5).json()["reason"] == "draining"
        during = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert time.monotonic() - sent < delay, "the request in the delay window took too long to judge"
        assert during.status_code == 200, during.text
        # the delay's end, as the server logs it once it refuses: a fixed sleep past it lost to a server
        # whose loop a loaded host woke late, where the late request could land first
        wait_for("the drain to start", lambda: "event=drain_start" in log_path.read_text(), timeout=30)
        assert time.monotonic() - sent >= delay, "the drain started before the shutdown delay ended"
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        stream.join(120)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert code == 0, log_text[-3000:]
    assert results and results[0][0] == 200 and results[0][1][-1] == "[DONE]", results
    assert '"finish_reason":"abort"' in results[0][1][-2], results[0][1][-3:]
    assert (
        log_text.index("event=shutdown_delay")
        < log_text.index("event=drain_start")
        < log_text.index("event=drain_timeout aborted=1")
        < log_text.index("event=drain_done")
    )


def test_invalid_engine_flags_exit_2_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    from specfleet.engine.server.cli import main

    assert main(["serve", "--block-size", "3"]) == 2
    assert "block_size=3" in capsys.readouterr().err
