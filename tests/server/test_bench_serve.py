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
