"""`specfleet bench route`: the routing policies side by side on a shared-prefix, multi-turn workload.

Each policy in turn (and one engine serving everything, as the reference for prefix hits) gets a fresh
local fleet (`specfleet up`'s, cold caches; the prefix policy on the engines' KV events, as routing.kvEvents
defaults) and the same requests: `--tenants` tenants, each with its own
long system prompt (a handbook of a few hundred tokens), `--conversations` chats per tenant of `--turns`
turns that resend their whole history; closed loop at `--concurrency` conversations in flight, greedy,
streaming chat completions. Per policy: prefix hit rate from the engines' own counters
(`specfleet_prefix_cache_hits / _queries`), TTFT p50/p95 and output throughput measured by the client.
The two-engine fleets get `--kv-cache-gib` each; the one-engine reference gets twice that (the same
memory), so its hit rate is what the whole fleet's cache could hold with perfect locality. Every engine
runs on one core of its own (`--cpus-per-engine 1`), as each replica of a GPU fleet has its own device.

`--phases eviction` (or `policies,eviction`) adds the eviction-pressure phase (bench/route_eviction.py):
the prefix policy on a two-engine fleet whose KV cache is small against the tenants' system prompts, in
rounds that alternate the engines' KV events and the router's estimate (ABBA), same requests; its figures
go under `eviction`.

Writes JSON (and, with the policies phase, a PNG) next to it; the last stdout line is the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from specfleet.bench import route_eviction, stoppable
from specfleet.bench import route_workload as workload
from specfleet.bench.route_workload import Turn, prefix_counters, stream_turn, system_prompt, warm_up
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator import load_inference_service
from specfleet.router.policies import POLICIES

REFERENCE = "one-engine"
PHASES = ("policies", "eviction")


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    decisions: dict[str, float] = field(default_factory=dict)


def conversations(args: argparse.Namespace) -> list[tuple[int, list[str]]]:
    return workload.conversations(args.tenants, args.conversations, args.turns, args.seed)


async def chat(
    client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int, session: str
) -> tuple[Turn, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    return await stream_turn(client, "/v1/chat/completions", body, session)


async def run_config(args: argparse.Namespace, name: str, replicas: int, policy: str, kv_gib: float) -> Run:
    doc = json.loads(json.dumps(args.isvc))
    doc["spec"]["replicas"] = replicas
    fleet = LocalFleet(
        load_inference_service(doc),
        tune=False,
        policy=policy,
        engine_extra_args=[f"--kv-cache-gib={kv_gib}"],
        say=lambda line: print(line, flush=True),
        cpus_per_engine=args.cpus_per_engine or None,
    )
    print(f"[bench route] {name}: starting {replicas} engine(s), policy {policy}", flush=True)
    await fleet.start()
    run = Run()
    try:
        await warm_up(fleet.engine_urls)
        hits0, queries0 = await prefix_counters(fleet.engine_urls)
        limits = httpx.Limits(max_connections=args.concurrency * 2)
        async with httpx.AsyncClient(base_url=fleet.url, timeout=600, limits=limits) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            queue = list(enumerate(conversations(args)))
            start = time.perf_counter()

            async def worker() -> None:
                while queue:
                    number, (tenant, questions) = queue.pop(0)
                    messages = [{"role": "system", "content": system_prompt(tenant, args.system_sentences)}]
                    for question in questions:
                        messages.append({"role": "user", "content": question})
                        turn, reply = await chat(client, model, messages, args.max_tokens, f"conv-{number}")
                        run.turns.append(turn)
                        messages.append({"role": "assistant", "content": reply})

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            run.seconds = time.perf_counter() - start
        hits1, queries1 = await prefix_counters(fleet.engine_urls)
        run.hits, run.queries = hits1 - hits0, queries1 - queries0
        for metric in fleet.router.metrics.decisions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):  # a counter's value (beside its _created time)
                    run.decisions[sample.labels["reason"]] = sample.value
    finally:
        await fleet.stop(drain_timeout_s=5)
    return run


def figures(run: Run) -> dict[str, float]:
    ok = [t for t in run.turns if t.ok]
    ttfts = sorted(t.ttft for t in ok)

    def pct(p: float) -> float:
        return 1000 * ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else float("nan")

    return {
        "prefix_hit_rate": run.hits / max(run.queries, 1.0),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p95_ms": pct(0.95),
        "throughput": sum(t.output_tokens for t in ok) / max(run.seconds, 1e-9),
        "requests": len(run.turns),
        "failed": len(run.turns) - len(ok),
        "seconds": run.seconds,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    out = await policies_phase(args) if "policies" in args.phases else {}
    if "eviction" in args.phases:
        out["eviction"] = await route_eviction.eviction_phase(args, args.eviction_sizing)
    return out


async def policies_phase(args: argparse.Namespace) -> dict[str, Any]:
    configs = [(REFERENCE, 1, "least-loaded", 2 * args.kv_cache_gib)] if args.reference else []
    configs += [(p, 2, p, args.kv_cache_gib) for p in args.policies]
    order = configs + list(reversed(configs))[: len(configs) if args.repeats > 1 else 0]
    runs: dict[str, list[dict[str, float]]] = {}
    decisions: dict[str, dict[str, float]] = {}
    for name, replicas, policy, kv in order:
        run = await run_config(args, name, replicas, policy, kv)
        runs.setdefault(name, []).append(figures(run))
        decisions[name] = run.decisions
        print(
            f"[bench route] {name}: {json.dumps({k: round(v, 3) for k, v in runs[name][-1].items()})}",
            flush=True,
        )
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    out: dict[str, Any] = {
        key: {name: round(m[key], 3) for name, m in med.items()}
        for key in ("prefix_hit_rate", "ttft_p50_ms", "ttft_p95_ms", "throughput")
    }
    if "prefix" in med and "round-robin" in med:
        out["ttft_p50_ratio_prefix_vs_round_robin"] = round(
            med["prefix"]["ttft_p50_ms"] / med["round-robin"]["ttft_p50_ms"], 3
        )
    if "prefix" in med and "least-loaded" in med:
        out["throughput_ratio_prefix_vs_least_loaded"] = round(
            med["prefix"]["throughput"] / med["least-loaded"]["throughput"], 3
        )
    if "prefix" in med and REFERENCE in med:
        out["prefix_hit_rate_vs_one_engine"] = round(
            med["prefix"]["prefix_hit_rate"] / max(med[REFERENCE]["prefix_hit_rate"], 1e-9), 3
        )
    out["router_decisions"] = decisions
    out["runs"] = runs
    out["workload"] = {
        k: getattr(args, k)
        for k in (
            "tenants",
            "conversations",
            "turns",
            "concurrency",
            "system_sentences",
            "max_tokens",
            "kv_cache_gib",
            "repeats",
        )
    }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        ("prefix_hit_rate", "prefix hit rate"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p95_ms", "TTFT p95 (ms)"),
        ("throughput", "output tok/s"),
    ]
    fig, axes = plt.subplots(1, len(keys), figsize=(14, 3.5))
    for ax, (key, label) in zip(axes, keys, strict=True):
        names = list(result[key])
        ax.bar(names, [result[key][n] for n in names], color=[f"C{i}" for i in range(len(names))])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench route", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "-f",
        "--file",
        default=str(Path(__file__).resolve().parents[1] / "examples" / "smollm2-cpu.yaml"),
        help="the InferenceService to run (its replicas are set per configuration)",
    )
    p.add_argument(
        "--policies",
        type=lambda s: s.split(","),
        default=["round-robin", "least-loaded", "prefix"],
        help=f"comma-separated, from {', '.join(POLICIES)}",
    )
    p.add_argument(
        "--no-reference", dest="reference", action="store_false", help="skip the one-engine reference"
    )
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--conversations", type=int, default=2, help="conversations per tenant")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    p.add_argument(
        "--system-sentences", type=int, default=14, help="handbook rules per system prompt (~28 tokens each)"
    )
    p.add_argument("--max-tokens", type=int, default=24)
    # One core of its own per engine, as each GPU replica has its own device: unpinned, two engines of two
    # threads each share two cores and every latency measures their contention (docs/router.md).
    p.add_argument(
        "--cpus-per-engine",
        type=int,
        default=1,
        help="cores pinned to each engine (specfleet up --cpus-per-engine); 0: every engine on every core",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=0.15,
        help="KV cache per engine of the two-engine fleets: sized to hold part of the tenants' prefixes, "
        "as a real fleet's caches hold part of its working set",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="2: a second pass in reverse order; medians reported"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-route.json")
    p.add_argument(
        "--phases",
        type=lambda s: s.split(","),
        default=["policies"],
        help=f"comma-separated, from {', '.join(PHASES)}: the policies side by side, the eviction pressure",
    )
    route_eviction.add_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        print(f"specfleet bench route: unknown policies {unknown}; choose from {', '.join(POLICIES)}")
        return 2
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown or not args.phases:
        print(f"specfleet bench route: --phases {args.phases}: choose from {', '.join(PHASES)}")
        return 2
    import yaml

    args.isvc = yaml.safe_load(Path(args.file).read_text())
    if "eviction" in args.phases:  # sized before any engine starts: a flag it refuses fails at once
        try:
            args.eviction_sizing = route_eviction.plan(args)
        except ValueError as error:
            print(f"specfleet bench route: {error}")
            return 2
    result = stoppable.run(bench(args))
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2))
    if "policies" in args.phases:
        plot(result, out.with_suffix(".png"))
    summary = {k: v for k, v in result.items() if k not in ("runs", "router_decisions")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
