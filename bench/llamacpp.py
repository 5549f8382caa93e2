"""`specfleet bench llamacpp`: llama.cpp's own server and specfleet side by side, one after the other, on
the same prompts.

llama.cpp's `llama-server` (built and started by bench/anchors/llama_server.sh: the llama.cpp vendored in
the pinned llama-cpp-python sdist, `-t 2 -np 32 -c 16384`, the bundled GGUF) runs first, then
`specfleet serve --max-num-seqs 32` in each config: fp32, int8, gguf, gguf + n-gram (k=4). Each server is
measured closed-loop at concurrency 1, 8 and 32 with `bench serve`'s own client (streaming chat
completions, fixed output length with ignore_eos) over the built-in prompt sets (bench/prompts.py: chat and
input-grounded prompts, cycled to the count each concurrency needs).

Ends stdout with one JSON line: per server and concurrency the output throughput and TPOT p50, and per
specfleet config `tpot_p50_ratio_c1` (specfleet over llama.cpp: lower is better), `throughput_ratio_c8`
and `throughput_ratio_c32` (specfleet over llama.cpp: higher is better). Not part of CI: it needs the
llama-server build (about 8 minutes on 2 cores, cached outside the repo).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from specfleet.bench.prompts import chat_prompts, grounded_prompts
from specfleet.bench.serve import BenchRequest, run, summarize
from specfleet.engine.python_child import python_command
from specfleet.fleet.supervisor import free_port

BUNDLED = "bundled://smollm2-135m-instruct"
SCRIPT = Path(__file__).with_name("anchors") / "llama_server.sh"
CONCURRENCY = (1, 8, 32)
OUTPUT_TOKENS = 64  # the comparison: 64 streamed tokens per request
# specfleet config name -> extra `specfleet serve` flags.
CONFIGS: dict[str, list[str]] = {
    "fp32": [],
    "int8": ["--quantization", "int8"],
    "gguf": ["--quantization", "gguf"],
    "gguf+ngram": [
        "--quantization",
        "gguf",
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "4",
    ],
}


PROMPT_SETS = ("mix", "chat", "grounded")


def requests_for(concurrency: int, quick: bool, prompts: str = "mix") -> list[BenchRequest]:
    """Prompts for one concurrency: enough for the closed loop to stay full (3 rounds, 2 with --quick), at
    least 16 (4 with --quick) so that c=1 has a stable median. `prompts`: chat and grounded interleaved
    (mix), or one set (n-gram's target is stated on the grounded set, whose answers copy their input)."""
    if prompts not in PROMPT_SETS:
        raise ValueError(f"prompts={prompts!r} is not one of {PROMPT_SETS}")
    chat, grounded = chat_prompts(), grounded_prompts()
    pool = {
        "mix": [p for pair in zip(chat, grounded) for p in pair],
        "chat": chat,
        "grounded": grounded,
    }[prompts]
    n = max(4 if quick else 16, (2 if quick else 3) * concurrency)
    return [BenchRequest(pool[i % len(pool)], OUTPUT_TOKENS) for i in range(n)]


def client_args(url: str, concurrency: int) -> argparse.Namespace:
    """The namespace `bench serve`'s client reads: closed loop, streaming chat, greedy, fixed lengths."""
    return argparse.Namespace(
        url=url,
        max_concurrency=concurrency,
        request_rate=float("inf"),
        seed=0,
        no_progress=True,
        timeout=600.0,
        api_key=None,
        endpoint="chat",
        temperature=0.0,
        ignore_eos=True,
    )


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "throughput_tok_s": round(summary["output_throughput"], 2),
        "tpot_p50_ms": None if summary["p50_tpot_ms"] is None else round(summary["p50_tpot_ms"], 2),
        "ttft_p50_ms": None if summary["p50_ttft_ms"] is None else round(summary["p50_ttft_ms"], 2),
        "completed": summary["completed"],
        "failed": summary["failed"],
        **({"errors": summary["errors"]} if summary.get("errors") else {}),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def compare(
    llama: dict[int, dict[str, Any]], specfleet: dict[str, dict[int, dict[str, Any]]]
) -> dict[str, Any]:
    """The ratios the issue's targets are stated in, per specfleet config, from each server's `figures`."""
    out: dict[str, Any] = {}
    for name, by_c in specfleet.items():
        row: dict[str, Any] = {}
        if 1 in by_c and 1 in llama:
            row["tpot_p50_ratio_c1"] = _ratio(by_c[1]["tpot_p50_ms"], llama[1]["tpot_p50_ms"])
        for c in sorted(by_c):
            if c != 1 and c in llama:
                row[f"throughput_ratio_c{c}"] = _ratio(
                    by_c[c]["throughput_tok_s"], llama[c]["throughput_tok_s"]
                )
        out[name] = row
    return out


async def _wait_ready(url: str, path: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server for {url} exited with {proc.returncode} before it was ready")
            try:
                if (await client.get(url + path)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)


async def served_model(url: str) -> str:
    """The model id the server answers to (`/v1/models`, as an OpenAI client finds it): specfleet serves
    `bundled://smollm2-135m-instruct` as `smollm2-135m-instruct` and refuses other names with a 404."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


async def measure(
    url: str, quick: bool, concurrency: tuple[int, ...], prompts: str = "mix"
) -> dict[int, dict[str, Any]]:
    """One warm-up request, then each concurrency in turn against one running server."""
    model = await served_model(url)
    warm, _ = await run(client_args(url, 1), model, requests_for(1, True)[:1])
    if not all(r.ok for r in warm):  # a server that refuses the request refuses all: say why, once
        raise RuntimeError(f"{url} refused the warm-up request: {warm[0].error}")
    out = {}
    for c in concurrency:
        results, duration = await run(client_args(url, c), model, requests_for(c, quick, prompts))
        out[c] = figures(summarize(results, duration, {}))
        print(f"  c={c}: {out[c]}", file=sys.stderr, flush=True)
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_server(
    name: str,
    argv: list[str],
    ready_path: str,
    port: int,
    log_dir: Path,
    quick: bool,
    concurrency: tuple[int, ...],
    prompts: str,
) -> dict[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{port}"
    log = (log_dir / f"{name}.log").open("wb")
    print(f"{name}: {' '.join(argv)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    )
    try:
        asyncio.run(_wait_ready(url, ready_path, proc, timeout_s=900))
        return asyncio.run(measure(url, quick, concurrency, prompts))
    finally:
        _stop(proc)
        log.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfleet bench llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer prompts per concurrency (2 rounds, at least 4)"
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"specfleet configs, a subset of {','.join(CONFIGS)}"
    )
    parser.add_argument(
        "--concurrency", default=",".join(map(str, CONCURRENCY)), help="closed-loop concurrencies"
    )
    parser.add_argument(
        "--prompts",
        choices=PROMPT_SETS,
        default="mix",
        help="chat and grounded prompts interleaved, or one set (the n-gram target: grounded)",
    )
    parser.add_argument(
        "--model",
        default=BUNDLED,
        help="specfleet's model (llama.cpp serves the bundled GGUF "
        "unless GGUF= is set for bench/anchors/llama_server.sh)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=Path("bench-results") / "llamacpp", help="server logs"
    )
    parser.add_argument(
        "--llama-cpp-url",
        default=None,
        help="measure this running llama-server instead of starting bench/anchors/llama_server.sh",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: {unknown} not among {list(CONFIGS)}")
    try:
        concurrency = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        parser.error(f"--concurrency={args.concurrency!r} must be comma-separated integers")
    if min(concurrency) < 1 or max(concurrency) > 32:
        parser.error(f"--concurrency={args.concurrency!r}: each must be in 1..32 (the servers' 32 slots)")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()

    if args.llama_cpp_url:  # a llama-server already running (started by hand, or on another port)
        llama = asyncio.run(measure(args.llama_cpp_url.rstrip("/"), args.quick, concurrency, args.prompts))
    else:
        port = free_port()
        llama = bench_server(
            "llama.cpp",
            ["bash", str(SCRIPT), "serve", str(port)],
            "/health",
            port,
            args.log_dir,
            args.quick,
            concurrency,
            args.prompts,
        )
    specfleet = {}
    for name in configs:
        port = free_port()
        cmd = python_command(
            "-m",
            "specfleet.engine",
            "--model",
            args.model,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--max-num-seqs",
            "32",
            *CONFIGS[name],
        )
        specfleet[name] = bench_server(
            name, cmd, "/ready", port, args.log_dir, args.quick, concurrency, args.prompts
        )
    result = {
        "bench": "llamacpp",
        "quick": args.quick,
        "prompts": args.prompts,
        "output_tokens": OUTPUT_TOKENS,
        "concurrency": concurrency,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "llama_cpp": llama,
        "specfleet": specfleet,
        "ratios": compare(llama, specfleet),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
