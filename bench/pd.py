"""`specfleet bench pd`: one prefill + one decode engine against two aggregated engines at equal cores.

Both setups are the local fleet's real parts: engine processes (`specfleet serve`, one CPU thread each, so
both setups use two cores) behind the router, which orchestrates the prefill/decode hand-off in the
disaggregated setup and balances by least outstanding requests in the aggregated one. The workload mixes
short chats that stream many tokens with long prompts that keep arriving (few output tokens each), the case
disaggregation is for: in an aggregated engine every long prefill step stalls the running streams.

Reports, per setup: decode TPOT p50/p99 of the short chats (seconds per output token after the first),
TTFT p50/p95 of both classes, output throughput, and for the disaggregated pair the KV transfer time per
block and the bytes moved per prompt token (measured after the run with a prefill and a decode engine in
this process, on prompts like the workload's long ones).
Writes JSON beside a PNG and ends stdout with the JSON on one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from specfleet.engine.python_child import python_command
from specfleet.fleet.supervisor import free_port
from specfleet.router.endpoints import EndpointSet
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router, serve

LONG_CONTEXT = (
    "Meeting notes. The team reviewed the quarterly plan, the hiring pipeline, the on-call rota, the "
    "latency budget of the search service and the migration of the billing database. "
)
CHATS = [
    "Write a short story about a lighthouse keeper.",
    "Explain photosynthesis to a child.",
    "List five facts about volcanoes.",
    "Write a poem about the moon.",
]


def _start_engine(model: str, role: str | None, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = python_command(
        "-m",
        "specfleet.engine",
        "--model",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--kv-cache-gib",
        "0.5",
        *extra,
        *([f"--kv-role={role}"] if role else []),
    )
    # One thread per engine: both setups then use two cores, whatever the machine has.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env
    ), f"http://127.0.0.1:{port}"


async def _wait_ready(urls: list[str], procs: list[subprocess.Popen], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        for url, proc in zip(urls, procs, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"engine {url} exited with {proc.returncode}")
                try:
                    if (await client.get(f"{url}/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {url} not ready after {timeout_s}s")
                await asyncio.sleep(0.5)


async def _one(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, kind: str
) -> dict[str, Any]:
    start = time.perf_counter()
    stamps: list[float] = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    ttft = stamps[0] - start if stamps else None
    tpot = (stamps[-1] - stamps[0]) / (max_tokens - 1) if len(stamps) > 1 and max_tokens > 1 else None
    return {"kind": kind, "ttft": ttft, "tpot": tpot, "tokens": max_tokens, "end": time.perf_counter()}


async def _workload(
    url: str, duration_s: float, chat_rate: float, long_rate: float, long_words: int, seed: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    words = LONG_CONTEXT.split()
    tasks = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        start = time.perf_counter()
        events = []
        for kind, rate in (("chat", chat_rate), ("long", long_rate)):
            t = rng.expovariate(rate)
            while t < duration_s:
                events.append((t, kind))
                t += rng.expovariate(rate)
        for i, (at, kind) in enumerate(sorted(events)):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if kind == "chat":
                tasks.append(asyncio.create_task(_one(client, url, CHATS[i % len(CHATS)], 48, kind)))
            else:  # a distinct long prompt each time, so no setup gets prefix hits the other does not
                prompt = (
                    f"Document {i}. " + " ".join(rng.choice(words) for _ in range(long_words)) + " Summary:"
                )
                tasks.append(asyncio.create_task(_one(client, url, prompt, 4, kind)))
        results = await asyncio.gather(*tasks)
        for r in results:
            r["end"] -= start
        return list(results)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    chats = [r for r in results if r["kind"] == "chat"]
    longs = [r for r in results if r["kind"] == "long"]
    tpot = [r["tpot"] for r in chats if r["tpot"] is not None]
    span = max(r["end"] for r in results)
    return {
        "requests": len(results),
        "chat_tpot_p50_ms": _ms(_pct(tpot, 50)),
        "chat_tpot_p99_ms": _ms(_pct(tpot, 99)),
        "chat_ttft_p50_ms": _ms(_pct([r["ttft"] for r in chats], 50)),
        "chat_ttft_p95_ms": _ms(_pct([r["ttft"] for r in chats], 95)),
        "long_ttft_p50_ms": _ms(_pct([r["ttft"] for r in longs], 50)),
        "long_ttft_p95_ms": _ms(_pct([r["ttft"] for r in longs], 95)),
        "output_tok_s": sum(r["tokens"] for r in results) / span,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def transfer_stats(model: str, long_words: int, repeats: int = 5) -> dict[str, Any]:
    """KV transfer cost measured on its own: a prefill and a decode engine in this process, ZeroMQ over
    loopback, long prompts as the workload's (the serving run's engines are separate processes)."""
    from specfleet.engine.kv_transfer.pair import generate_disaggregated
    from specfleet.engine.llm_engine import Engine
    from specfleet.engine.sampling_params import SamplingParams

    common: dict[str, Any] = dict(
        model=model, max_model_len=2048, kv_cache_gib=0.5, enable_prefix_caching=False
    )
    prefill, decode = Engine(kv_role="prefill", **common), Engine(kv_role="decode", **common)
    rng = random.Random(0)
    words = LONG_CONTEXT.split()
    try:
        for i in range(repeats):
            prompt = f"Document {i}. " + " ".join(rng.choice(words) for _ in range(long_words))
            ids = prefill.tokenizer.encode(prompt)
            generate_disaggregated(prefill, decode, [ids], SamplingParams(temperature=0, max_tokens=2))
        connector = decode.kv_connector
        assert connector is not None, "an engine with a kv_role has a KV connector"
        stats = connector.stats
        return {
            "transfers": stats.transfers,
            "blocks": stats.blocks_loaded,
            "ms_per_block": 1000 * stats.seconds / max(stats.blocks_loaded, 1),
            "bytes_per_token": connector.bytes_per_token,
            "mb_moved": stats.bytes_loaded / 1e6,
            "fallbacks": stats.fallbacks,
        }
    finally:
        prefill.close()


async def run_setup(name: str, model: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    roles: list[str | None] = ["prefill", "decode"] if name == "disaggregated" else [None, None]
    logs = [workdir / f"{name}-{i}.log" for i in range(2)]
    started = [
        _start_engine(model, role, log, args.engine_arg) for role, log in zip(roles, logs, strict=True)
    ]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    try:
        await _wait_ready(urls, procs)
        endpoints = EndpointSet()
        for url, role in zip(urls, roles, strict=True):
            endpoints.set_state(url, ready=True, role=role)
        router = Router(endpoints, make_policy("least-loaded"))
        port = free_port()
        runner = await serve(router, "127.0.0.1", port)
        router.endpoints_changed()
        url = f"http://127.0.0.1:{port}"
        await _workload(url, 5, 0.5, 0.2, 50, seed=1)  # warm up: fault in KV pages, build kernels
        results = await _workload(
            url, args.duration, args.chat_rate, args.long_rate, args.long_words, args.seed
        )
        await runner.cleanup()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    return {"setup": name, **summarize(results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specfleet bench pd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bundled://smollm2-135m-instruct")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per setup")
    parser.add_argument("--chat-rate", type=float, default=1.0, help="short streaming chats per second")
    parser.add_argument("--long-rate", type=float, default=0.3, help="long prompts per second")
    parser.add_argument(
        "--long-words", type=int, default=700, help="words per long prompt (~1.3 tokens each)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], help="extra `specfleet serve` argument")
    parser.add_argument("--out", default="bench/results/pd.json")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="specfleet-bench-pd-"))
    rows = []
    for name in ("aggregated", "disaggregated"):
        print(f"running {name} (logs in {workdir})", flush=True)
        rows.append(asyncio.run(run_setup(name, args.model, args, workdir)))
        print(json.dumps(rows[-1]), flush=True)
    rows[-1]["transfer"] = transfer_stats(args.model, args.long_words)
    print(json.dumps(rows[-1]["transfer"]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"config": vars(args), "rows": rows}
    out.write_text(json.dumps(result, indent=2))
    _plot(rows, out.with_suffix(".png"))
    print(json.dumps(result))
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        "chat_tpot_p50_ms",
        "chat_tpot_p99_ms",
        "chat_ttft_p50_ms",
        "chat_ttft_p95_ms",
        "long_ttft_p50_ms",
        "long_ttft_p95_ms",
    ]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    for i, row in enumerate(rows):
        ax.bar(
            [k + i * width for k in range(len(keys))],
            [row.get(k) or 0 for k in keys],
            width,
            label=row["setup"],
        )
    ax.set_xticks(
        [k + width / 2 for k in range(len(keys))], [k.replace("_ms", "") for k in keys], rotation=20
    )
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("1 prefill + 1 decode vs 2 aggregated engines (1 CPU thread each)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
