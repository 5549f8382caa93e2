"""`specfleet bench serve`: measure any OpenAI-compatible server the way vLLM's benchmark_serving does.

Poisson arrivals (`--request-rate R`) or a closed loop (`--max-concurrency C`), a built-in deterministic
prompt mix, streaming completions. Prints a table, writes JSON and a PNG of the latency distributions,
and ends stdout with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

TOPICS = [
    "the ocean",
    "a lighthouse keeper",
    "prime numbers",
    "the history of tea",
    "volcanoes",
    "a robot chef",
    "the Roman empire",
    "photosynthesis",
    "a chess tournament",
    "migrating birds",
    "the moon landing",
    "sourdough bread",
    "black holes",
    "a mountain village",
    "jazz music",
    "the printing press",
]
TEMPLATES = [
    "Write a short story about {t}.",
    "Explain {t} to a ten-year-old.",
    "List five surprising facts about {t}.",
    "Write a poem about {t}.",
    "Summarise what you know about {t} in a few paragraphs.",
    "Describe {t} from three points of view.",
]
CONTEXT = (
    "Background notes: the reader is curious, patient and enjoys concrete details, numbers, and short "
    "examples. Keep the tone friendly and precise. "
)


@dataclass
class BenchRequest:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    sent_s: float = 0.0  # perf_counter when sent (the trace's arrival times are relative to the first)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def prompt_mix(n: int, seed: int, min_out: int, max_out: int) -> list[BenchRequest]:
    """Deterministic for a seed: a template, a topic, 0-8 context paragraphs and an output length each."""
    rng = random.Random(seed)
    mix = []
    for _ in range(n):
        prompt = CONTEXT * rng.choice([0, 0, 1, 2, 4, 8]) + rng.choice(TEMPLATES).format(t=rng.choice(TOPICS))
        mix.append(BenchRequest(prompt, rng.randint(min_out, max_out)))
    return mix


def parse_slo(items: list[str]) -> dict[str, float]:
    slo = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "itl", "e2e") or not value:
            raise argparse.ArgumentTypeError(f"--slo {item!r}: use ttft:MS, tpot:MS, itl:MS or e2e:MS")
        slo[name] = float(value) / 1000.0
    return slo


async def send(client: httpx.AsyncClient, args: argparse.Namespace, model: str, req: BenchRequest) -> Result:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        path = "/v1/completions"
    if args.ignore_eos:
        body["ignore_eos"] = True
    result, start = Result(ok=False), time.perf_counter()
    result.sent_s = start
    last = start
    chunks = 0
    try:
        async with _stream_reusing_safely(client, args.url.rstrip("/") + path, body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                for choice in data.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if text:
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        chunks, last = chunks + 1, now
                usage = data.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        result.error = "" if result.ok else "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


@asynccontextmanager
async def _stream_reusing_safely(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> AsyncIterator[httpx.Response]:
    """POST and stream, once more on a fresh connection if a pooled keep-alive connection was closed by the
    server before it answered anything: llama-server (cpp-httplib) closes each connection after a fixed
    number of requests, and the client can pick it from the pool just then ("Server disconnected without
    sending a response"). Nothing was processed, so sending again is safe; a drop after the response
    started is reported as the request's failure."""
    for attempt in (1, 2):
        answered = False
        try:
            async with client.stream("POST", url, json=body) as resp:
                answered = True
                yield resp
                return
        except httpx.RemoteProtocolError as exc:
            if answered or attempt == 2 or "without sending a response" not in str(exc):
                raise


async def run(args: argparse.Namespace, model: str, mix: list[BenchRequest]) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed)
    bar = tqdm(total=len(mix), desc="bench serve", unit="req", file=sys.stderr, disable=args.no_progress)

    async def one(client: httpx.AsyncClient, req: BenchRequest) -> Result:
        if semaphore is None:
            result = await send(client, args, model, req)
        else:
            async with semaphore:
                result = await send(client, args, model, req)
        bar.update(1)
        return result

    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=_auth(args)) as client:
        start = time.perf_counter()
        tasks = []
        for req in mix:
            tasks.append(asyncio.ensure_future(one(client, req)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def summarize(results: list[Result], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration, 3),
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "total_output_tokens": out_tokens,
    }
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [g for r in done for g in r.itls],
        "e2e": [r.e2e for r in done],
    }
    for name, values in series.items():
        arr = np.asarray(values, dtype=float) * 1000.0
        for stat, fn in (("mean", np.mean), ("p50", np.median)):
            summary[f"{stat}_{name}_ms"] = float(fn(arr)) if arr.size else None
        for q in (90, 95, 99):
            summary[f"p{q}_{name}_ms"] = float(np.percentile(arr, q)) if arr.size else None

    def meets(r: Result) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e, "itl": max(r.itls, default=0.0)}
        return all(values[k] <= limit for k, limit in slo.items())

    good = [r for r in done if meets(r)]
    summary["slo"] = {k: v * 1000.0 for k, v in slo.items()}
    summary["goodput"] = len(good) / duration  # requests/s meeting every SLO (vLLM's definition)
    summary["goodput_tokens"] = sum(r.output_tokens for r in good) / duration
    summary["slo_attainment"] = len(good) / len(results) if results else 0.0
    summary["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return summary


def table(summary: dict[str, Any]) -> str:
    rows = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Goodput (req/s)", summary["goodput"]),
        ("Goodput (tok/s)", summary["goodput_tokens"]),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "p50", "p90", "p95", "p99"):
            rows.append((f"{stat.upper()} {name.upper()} (ms)", summary[f"{stat}_{name}_ms"]))
    lines = ["=" * 50]
    for label, value in rows:
        shown = "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
        lines.append(f"{label:<38}{shown:>12}")
    return "\n".join(lines + ["=" * 50])


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft for r in done],
        "TPOT": [r.tpot for r in done if r.tpot is not None],
        "ITL": [g for r in done for g in r.itls],
        "E2E latency": [r.e2e for r in done],
    }
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        ms = np.asarray(values, dtype=float) * 1000.0
        if ms.size:
            ax.hist(ms, bins=min(40, max(5, ms.size // 2)), color="#3b7dd8", alpha=0.85)
            for q, style in ((50, "-"), (95, "--"), (99, ":")):
                ax.axvline(np.percentile(ms, q), color="k", linestyle=style, linewidth=1, label=f"p{q}")
            ax.legend(fontsize=7)
        ax.set_title(name)
        ax.set_xlabel("ms")
    axes[0].set_ylabel("count")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def context_tokens(done: list[tuple[Result, BenchRequest]]) -> float:
    """Tokens of one CONTEXT paragraph on the server's tokenizer, from the usage it reported: the median of
    (tokens_j - tokens_i) / (n_j - n_i) over requests with the same question and n_i != n_j paragraphs
    (exact where paragraphs tokenize alike); with no such pair, the run's tokens per character."""
    by_question: dict[str, list[tuple[int, int]]] = {}
    for r, req in done:
        n = req.prompt.count(CONTEXT)
        by_question.setdefault(req.prompt[n * len(CONTEXT) :], []).append((n, r.prompt_tokens))
    slopes = [
        (tb - ta) / (nb - na)
        for rows in by_question.values()
        for i, (na, ta) in enumerate(rows)
        for nb, tb in rows[i + 1 :]
        if nb != na
    ]
    if slopes:
        return float(np.median(slopes))
    chars = sum(len(req.prompt) for _, req in done)
    return len(CONTEXT) * sum(r.prompt_tokens for r, _ in done) / max(chars, 1)


def write_trace(results: list[Result], mix: list[BenchRequest], path: str) -> None:
    """The run as a `specfleet simulate` trace: one JSONL line per completed request. A prompt with n
    context paragraphs starts with them, so every such request is in one prefix group (0) with
    `prefix_tokens` = n paragraphs' tokens (`context_tokens`, rounded down): two of them share the shorter
    run of paragraphs, in the simulator (a group's shared ids are by position) as on the server. What every
    prompt shares ahead of the paragraphs (a BOS token, a chat template's header: a block or so) is not
    recorded."""
    from specfleet.sim.workload import SimRequest, save_trace

    done = [(r, req) for r, req in zip(results, mix) if r.ok and r.prompt_tokens and r.output_tokens]
    t0 = min((r.sent_s for r, _ in done), default=0.0)
    per_context = context_tokens(done) if done else 0.0

    def request(r: Result, req: BenchRequest) -> SimRequest:
        n = req.prompt.count(CONTEXT)
        shared = min(int(per_context * n), r.prompt_tokens - 1)
        group = 0 if shared > 0 else None
        return SimRequest(round(r.sent_s - t0, 6), r.prompt_tokens, r.output_tokens, group, max(shared, 0))

    save_trace(sorted((request(r, req) for r, req in done), key=lambda x: x.arrival_s), path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench serve", description=__doc__.splitlines()[0])
    p.add_argument(
        "--url",
        required=True,
        help="server base URL, e.g. http://127.0.0.1:8000 (`specfleet bench llamacpp` runs llama.cpp's "
        "server against specfleet's configs)",
    )
    load = p.add_argument_group("load (default: all requests at once)")
    load.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals, requests/s")
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="closed loop with C requests in flight"
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--min-output-len", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early (default sends ignore_eos so output lengths are fixed)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo", nargs="*", default=[], metavar="NAME:MS", help="e.g. ttft:500 tpot:50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-dir", default="bench-results", help="where the JSON and PNG go")
    p.add_argument("--label", default=None, help="name for the result files and the plot title")
    p.add_argument(
        "--trace-out",
        default=None,
        metavar="FILE.jsonl",
        help="record the run as a simulator trace (arrival, prompt and output tokens, the shared context "
        "paragraphs as a prefix; specfleet simulate)",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        slo = parse_slo(args.slo)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.num_prompts < 1 or not 1 <= args.min_output_len <= args.max_output_len:
        parser.error("need --num-prompts >= 1 and 1 <= --min-output-len <= --max-output-len")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency={args.max_concurrency} must be >= 1")
    if args.request_rate <= 0:
        parser.error(f"--request-rate={args.request_rate} must be > 0")
    model = args.model
    if model is None:
        models = httpx.get(args.url.rstrip("/") + "/v1/models", headers=_auth(args), timeout=30).json()
        model = models["data"][0]["id"]
    mix = prompt_mix(args.num_prompts, args.seed, args.min_output_len, args.max_output_len)
    results, duration = asyncio.run(run(args, model, mix))
    summary = summarize(results, duration, slo)
    load = (f"concurrency {args.max_concurrency}" if args.max_concurrency else "") + (
        f" rate {args.request_rate:g}/s" if math.isfinite(args.request_rate) else ""
    )
    label = args.label or f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
    summary.update(
        {
            "model": model,
            "url": args.url,
            "num_prompts": args.num_prompts,
            "endpoint": args.endpoint,
            "max_concurrency": args.max_concurrency,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        }
    )
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{label}.json", out_dir / f"{label}.png"
    plot(
        results,
        png_path,
        f"{model} @ {args.url} ({load.strip() or 'all at once'}, {args.num_prompts} prompts)",
    )
    summary.update({"json": str(json_path), "png": str(png_path)})
    json_path.write_text(json.dumps({**summary, "requests": [asdict(r) for r in results]}, indent=1))
    if args.trace_out:
        write_trace(results, mix, args.trace_out)
    print(table(summary))
    print(json.dumps(summary, separators=(",", ":")))
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
