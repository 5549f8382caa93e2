"""`specfleet bench route --phases eviction`: the prefix policy with a working set larger than the fleet's KV
cache, routed on the engines' KV events against the router's estimate (issue 40 item 3).

The fleet: two engines of `--eviction-kv-blocks` KV blocks each. The tenants: as many as it takes for their
system prompts alone to fill `--eviction-pressure` times the fleet's blocks (`size_workload`), so the
engines evict. Their popularity is skewed (`--eviction-skew`: a Zipf exponent over the tenants, as
multi-tenant traffic is): a popular tenant's requests, more than one engine may take under the load cap
(router/policies.py `load_cap`, which binds only with more requests in flight than engines, hence
`--eviction-concurrency` 4), spill to the other engine, so its prefix gets cached on both, and each engine
then evicts it on its own schedule. That is the state the exact index is for: the estimate (per engine, an
LRU of the blocks the router sent there, router/prefix.py, which sees no eviction) still believes both
copies and breaks the tie on load; the index knows which engine still holds it. With two requests in
flight on two engines the cap never binds (ceil(1.25 x 2 / 2) = 2), every tenant stays on its ring home in
both modes, and the modes cannot pick differently: the phase's earlier design (two in flight, every
tenant equally popular) sent every request to the same engine in both modes.

Rounds alternate the modes ABBA (`--eviction-rounds`, events first), each on a fresh fleet (cold caches)
whose engines publish KV events and whose router subscribes in both modes (the same work both times): the
events rounds route on the exact index (LocalFleet `kv_events="route"`), the estimate rounds on the
policy's estimate (its `exact` hook detached, the shipped default otherwise). Each decision is also taken
on the other index, on the same state, by `route_decisions.ShadowedPolicy`, which records where the picks
part and what each engine really held.

The requests are streamed text completions of each conversation as a transcript (the system prompt, then
`User:` / `Assistant:` turns; `--eviction-turns`, default 1: a later turn follows its session's engine in
either mode and would only dilute the comparison), not chat completions: the router hashes a chat
request's messages in a flattening of its own (router/proxy.py `prompt_text`), not the model's chat
template, so its blocks would never meet those the engines' events name; a completion's text is tokenized
alike on both sides.

Per round: the index's hit rate as the router counts it (`specfleet_router_prefix_blocks_total`, matched
over prompt blocks), the engines' measured prefix-cache hit rate (`specfleet_prefix_cache_hits / _queries`,
in tokens), client TTFT p50/p95. The phase's figures, medians over each mode's rounds:
`index_vs_engine_hit_rate_gap` = index / engine - 1 on the events rounds (goal: within +-0.05) and
`ttft_p50_ratio_events_vs_estimate` (goal: <= 0.85).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx
from specfleet.bench.route_decisions import Decision, DecisionLog, ShadowedPolicy
from specfleet.bench.route_workload import (
    QUESTIONS,
    Turn,
    prefix_counters,
    stream_turn,
    system_prompt,
    warm_up,
)
from specfleet.fleet.supervisor import LocalFleet, local_tokenizer
from specfleet.operator import load_inference_service
from specfleet.router.policies import PrefixAffinity
from specfleet.router.proxy import Router

ENGINES = 2
# Issue 40 item 3's goals: the event-driven index's hit rate within 5% of the engines' measured one, and
# TTFT p50 at least 15% lower than on the estimate.
HIT_RATE_GAP_GOAL = 0.05
TTFT_P50_RATIO_GOAL = 0.85
# Conversations in flight that fill more than this share of an engine's cache leave too little for the
# prefixes between them: the engine then preempts running requests (and recomputes them) rather than evict
# cached prefixes, and the phase would measure that instead.
MAX_RUNNING_SHARE = 0.75
# System prompts measured to size the workload: their lengths vary by a few percent between tenants; 64
# cover that spread (438-474 tokens for SmolLM2's tokenizer at 14 rules).
PROBE_TENANTS = 64
TICKET = "(ticket 9999)"  # the longest ticket suffix conversations() appends to a question


@dataclass(frozen=True)
class EvictionSizing:
    tenants: int
    system_blocks: int  # full blocks of the shortest system prompt
    fleet_blocks: int  # KV blocks of all the engines together
    working_set_blocks: int  # tenants x system_blocks: the system prompts alone, past the fleet's cache
    running_blocks_per_engine: int  # the longest conversations one engine runs at once under the load cap


def size_workload(
    *,
    kv_blocks: int,
    block_size: int,
    system_tokens: int,
    longest_tokens: int,
    concurrency: int,
    pressure: float,
    max_model_len: int,
    engines: int = ENGINES,
    load_factor: float = PrefixAffinity.load_factor,
) -> EvictionSizing:
    """Enough tenants for their system prompts to fill `pressure` times the fleet's cache; refused (a
    ValueError naming the flag) when there would be no pressure or when the conversations in flight would
    crowd out the cached prefixes."""
    if kv_blocks < 1:
        raise ValueError(f"--eviction-kv-blocks={kv_blocks} must be >= 1")
    if kv_blocks * block_size < max_model_len:  # the engine refuses to start on such a cache
        raise ValueError(
            f"--eviction-kv-blocks={kv_blocks} holds fewer tokens than one sequence of the "
            f"InferenceService's maxModelLen={max_model_len}: give it >= {math.ceil(max_model_len / block_size)}"
            " blocks or lower spec.model.maxModelLen"
        )
    if concurrency < 1:
        raise ValueError(f"--eviction-concurrency={concurrency} must be >= 1")
    if not pressure > 1:
        raise ValueError(
            f"--eviction-pressure={pressure} must be > 1: the tenants' system prompts must exceed the "
            "fleet's KV cache for the engines to evict"
        )
    system_blocks = system_tokens // block_size
    if system_blocks < 1:
        raise ValueError(
            f"--system-sentences gives a {system_tokens}-token system prompt, under one {block_size}-token "
            "block: nothing to cache"
        )
    fleet_blocks = engines * kv_blocks
    tenants = math.ceil(pressure * fleet_blocks / system_blocks)
    # the load cap (router/policies.py load_cap) lets one engine run up to ceil(c * m / n) of m in flight
    per_engine = min(concurrency, math.ceil(load_factor * concurrency / engines))
    running = per_engine * math.ceil(longest_tokens / block_size)
    if running > MAX_RUNNING_SHARE * kv_blocks:
        raise ValueError(
            f"--eviction-kv-blocks={kv_blocks}: the {per_engine} conversations one engine may run at once "
            f"(--eviction-concurrency={concurrency} under the load cap) hold up to {running} blocks, more "
            f"than {MAX_RUNNING_SHARE} of its cache; give it >= {math.ceil(running / MAX_RUNNING_SHARE)} "
            "blocks or lower --eviction-concurrency"
        )
    return EvictionSizing(tenants, system_blocks, fleet_blocks, tenants * system_blocks, running)


def transcript(system: str, history: Sequence[tuple[str, str]], question: str) -> str:
    """A conversation as completion text: each turn extends the last one's prompt and reply."""
    turns = "".join(f"\nUser: {q}\nAssistant: {a}" for q, a in history)
    return f"{system}{turns}\nUser: {question}\nAssistant:"


def measure(encode: Callable[[str], list[int]], args: argparse.Namespace) -> tuple[int, int]:
    """(the shortest system prompt, the longest conversation) in tokens, from the model's tokenizer."""
    systems = [len(encode(system_prompt(t, args.system_sentences))) for t in range(PROBE_TENANTS)]
    turn = max(len(encode(f"\nUser: {q} {TICKET}\nAssistant:")) for q in QUESTIONS) + args.max_tokens
    return min(systems), max(systems) + args.eviction_turns * turn


def skewed_conversations(
    tenants: int, count: int, turns: int, skew: float, seed: int
) -> list[tuple[int, list[str]]]:
    """`count` conversations of `turns` user messages, each of a tenant drawn with weight 1 / rank^skew
    (Zipf; 0: all alike), deterministic."""
    if skew < 0:
        raise ValueError(f"--eviction-skew={skew} must be >= 0 (0: every tenant equally popular)")
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** skew for rank in range(tenants)]
    drawn = rng.choices(range(tenants), weights, k=count)
    return [
        (t, [rng.choice(QUESTIONS) + f" (ticket {rng.randint(1000, 9999)})" for _ in range(turns)])
        for t in drawn
    ]


Mode = Literal["events", "estimate"]


def round_modes(rounds: int) -> list[Mode]:
    """ABBA: events, estimate, estimate, events, ... so that a drift of the host's load through the run
    weighs on both modes alike."""
    if rounds < 2:
        raise ValueError(f"--eviction-rounds={rounds} must be >= 2 (one round of each mode at least)")
    return ["events" if i % 4 in (0, 3) else "estimate" for i in range(rounds)]


@dataclass
class EvictionRun:
    mode: Mode = "events"
    turns: list[Turn] = field(default_factory=list)
    keys: list[tuple[str, int]] = field(default_factory=list)  # each turn's (session, turn number)
    seconds: float = 0.0
    engine_hits: float = 0.0  # prompt tokens the engines found in their prefix caches
    engine_queries: float = 0.0  # prompt tokens they looked up
    prompt_blocks: float = 0.0  # the router's count of the prompts' full blocks
    matched_blocks: float = 0.0  # of those, the ones the chosen engine's index held
    block_size: int = 16
    events: dict[str, float] = field(default_factory=dict)  # the subscriber's totals
    log: DecisionLog = field(default_factory=DecisionLog)  # each decision, shadowed (route_decisions.py)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_figures(run: EvictionRun) -> dict[str, float | None]:
    ttfts = sorted(1000 * t.ttft for t in run.turns if t.ok)
    return {
        "index_hit_rate": _ratio(run.matched_blocks, run.prompt_blocks),
        "engine_hit_rate": _ratio(run.engine_hits, run.engine_queries),
        # the index's matched tokens over the engines' hits: the numerators alone, the denominators apart
        # (the router's full blocks against the engines' every prompt token)
        "index_vs_engine_hit_tokens": _ratio(run.matched_blocks * run.block_size, run.engine_hits),
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_ms": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None,
        "requests": len(run.turns),
        "failed": sum(not t.ok for t in run.turns),
        "seconds": run.seconds,
    }


def decided_turns(run: EvictionRun) -> list[tuple[Turn, Decision]]:
    """Each turn with its routing decision (the n-th decision of a session is its n-th turn's)."""
    by_session: dict[str | None, list[Decision]] = {}
    for decision in run.log.decisions:
        by_session.setdefault(decision.session, []).append(decision)
    out = []
    for turn, (session, number) in zip(run.turns, run.keys, strict=True):
        decisions = by_session.get(session, [])
        if number < len(decisions):
            out.append((turn, decisions[number]))
    return out


def mode_decisions(runs: Sequence[EvictionRun]) -> dict[str, Any]:
    """A mode's per-decision figures over its rounds, and its TTFT p50 where the two indexes' picks part."""
    log = DecisionLog([d for run in runs for d in run.log.decisions])
    differ = sorted(1000 * t.ttft for run in runs for t, d in decided_turns(run) if d.differ and t.ok)
    figures: dict[str, Any] = log.figures()
    figures["ttft_p50_ms_where_picks_differ"] = _round(statistics.median(differ) if differ else None)
    return figures


def eviction_figures(events: Sequence[EvictionRun], estimate: Sequence[EvictionRun]) -> dict[str, Any]:
    """The phase's JSON: the issue's two figures (medians over each mode's rounds), whether they meet its
    goals, each mode's median figures, the per-decision figures, each round's figures."""
    ev_rounds, es_rounds = [run_figures(r) for r in events], [run_figures(r) for r in estimate]
    ev = {k: _median([f[k] for f in ev_rounds]) for k in (ev_rounds or [{}])[0]}
    es = {k: _median([f[k] for f in es_rounds]) for k in (es_rounds or [{}])[0]}
    gaps = [_ratio(f["index_hit_rate"], f["engine_hit_rate"]) for f in ev_rounds]
    gap = _median([None if g is None else g - 1 for g in gaps])
    estimate_gaps = [_ratio(f["index_hit_rate"], f["engine_hit_rate"]) for f in es_rounds]
    estimate_gap = _median([None if g is None else g - 1 for g in estimate_gaps])
    ttft_ratio = _ratio(ev.get("ttft_p50_ms"), es.get("ttft_p50_ms"))
    return {
        "index_vs_engine_hit_rate_gap": _round(gap),
        "ttft_p50_ratio_events_vs_estimate": _round(ttft_ratio),
        "goals_met": {
            "hit_rate_gap": gap is not None and abs(gap) <= HIT_RATE_GAP_GOAL,
            "ttft_p50_ratio": ttft_ratio is not None and ttft_ratio <= TTFT_P50_RATIO_GOAL,
        },
        "estimate_index_vs_engine_hit_rate_gap": _round(estimate_gap),
        "events": {k: _round(v) for k, v in ev.items()},
        "estimate": {k: _round(v) for k, v in es.items()},
        "per_decision": {"events": mode_decisions(events), "estimate": mode_decisions(estimate)},
    }


def _router_counts(router: Router) -> tuple[float, float]:
    """The router's prompt and matched block counters (specfleet_router_prefix_blocks_total)."""
    values = {
        sample.labels["kind"]: sample.value
        for metric in router.metrics.prefix_blocks.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }
    return values.get("prompt", 0.0), values.get("matched", 0.0)


def _subscriber_totals(router: Router) -> dict[str, float]:
    if router.kv_feeds is None:
        return {}
    subscriber = router.kv_feeds.subscriber
    feeds = list(subscriber.feeds.values())
    with subscriber.lock:
        removed, skipped = subscriber.index.removed, subscriber.index.skipped
    return {
        "engines": len(feeds),
        "batches": sum(f.batches for f in feeds),
        "gaps": sum(f.gaps for f in feeds),
        "lost": sum(f.lost for f in feeds),
        "blocks_removed": removed,
        "blocks_skipped": skipped,
    }


def _shadow(fleet: LocalFleet, mode: Mode) -> ShadowedPolicy:
    """The fleet's prefix policy, shadowed; on the estimate's rounds its exact index detached (the
    subscriber goes on filling it: the shadow reads what the engines hold from it)."""
    policy, feeds = fleet.router.policy, fleet.router.kv_feeds
    assert isinstance(policy, PrefixAffinity) and feeds is not None  # kv_events="route" checks both
    if mode == "estimate":
        policy.exact = None
    shadow = ShadowedPolicy(policy, feeds.subscriber.match)
    fleet.router.policy = shadow
    return shadow


async def run_once(args: argparse.Namespace, mode: Mode, convs: list[tuple[int, list[str]]]) -> EvictionRun:
    doc = json.loads(json.dumps(args.isvc))
    doc["spec"]["replicas"] = ENGINES
    fleet = LocalFleet(
        load_inference_service(doc),
        tune=False,
        policy="prefix",
        engine_extra_args=[f"--num-kv-blocks={args.eviction_kv_blocks}"],
        say=lambda line: print(line, flush=True),
        cpus_per_engine=args.cpus_per_engine or None,
        kv_events="route",
    )
    print(f"[bench route] eviction, {mode}: starting {ENGINES} engines", flush=True)
    await fleet.start()
    run = EvictionRun(mode=mode, block_size=fleet.isvc.spec.engine.block_size)
    try:
        run.log = _shadow(fleet, mode).log
        await warm_up(fleet.engine_urls)
        hits0, queries0 = await prefix_counters(fleet.engine_urls)
        prompt0, matched0 = _router_counts(fleet.router)
        limits = httpx.Limits(max_connections=args.eviction_concurrency * 2)
        async with httpx.AsyncClient(base_url=fleet.url, timeout=600, limits=limits) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            queue = list(enumerate(convs))
            start = time.perf_counter()

            async def worker() -> None:
                while queue:
                    number, (tenant, questions) = queue.pop(0)
                    system = system_prompt(tenant, args.system_sentences)
                    history: list[tuple[str, str]] = []
                    for question in questions:
                        body = {
                            "model": model,
                            "prompt": transcript(system, history, question),
                            "max_tokens": args.max_tokens,
                        }
                        session = f"conv-{number}"
                        turn, reply = await stream_turn(client, "/v1/completions", body, session)
                        run.turns.append(turn)
                        run.keys.append((session, len(history)))
                        history.append((question, reply))

            await asyncio.gather(*(worker() for _ in range(args.eviction_concurrency)))
            run.seconds = time.perf_counter() - start
        hits1, queries1 = await prefix_counters(fleet.engine_urls)
        prompt1, matched1 = _router_counts(fleet.router)
        run.engine_hits, run.engine_queries = hits1 - hits0, queries1 - queries0
        run.prompt_blocks, run.matched_blocks = prompt1 - prompt0, matched1 - matched0
        run.events = _subscriber_totals(fleet.router)
    finally:
        await fleet.stop(drain_timeout_s=5)
    return run


# The phase's flags on `specfleet bench route`'s parser, as (--eviction-NAME, type, default, what it sets).
# 144 blocks of 16 tokens hold five of the ~450-token system prompts per engine; four conversations in flight
# (three on one engine at most under the load cap, of <= 34 blocks each at one turn) keep within
# MAX_RUNNING_SHARE of it, and are the fewest with which the cap binds on two engines (with two, each engine
# may always take both). 64 one-turn conversations a round take ~1 minute on two pinned cores; four rounds,
# with each round's fleet start, stay within ~8 minutes. Zipf 1: the usual shape of multi-tenant traffic
# (the top tenant ~1/4 of requests at ~22 tenants).
FLAGS: tuple[tuple[str, type, int | float, str], ...] = (
    ("kv-blocks", int, 144, "KV cache blocks per engine"),
    ("pressure", float, 2.0, "the tenants' system prompts over the fleet's KV cache (sets the tenants)"),
    ("conversations", int, 64, "conversations per round"),
    ("turns", int, 1, "turns per conversation (a later turn follows its session in either mode)"),
    ("skew", float, 1.0, "tenant popularity, Zipf exponent (0: every tenant equally popular)"),
    ("concurrency", int, 4, "conversations in flight"),
    ("rounds", int, 4, "rounds, alternating the modes ABBA from events, each on a fresh fleet"),
)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The phase's flags (FLAGS) on `specfleet bench route`'s parser."""
    for name, kind, default, what in FLAGS:
        p.add_argument(f"--eviction-{name}", type=kind, default=default, help=f"eviction phase: {what}")


def plan(args: argparse.Namespace) -> EvictionSizing:
    """The phase's workload for the InferenceService and flags, before any engine starts (a ValueError
    naming the flag when it cannot put the engines under pressure, or names no workload)."""
    round_modes(args.eviction_rounds)
    for flag, value in (
        ("--eviction-conversations", args.eviction_conversations),
        ("--eviction-turns", args.eviction_turns),
    ):
        if value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")
    if args.eviction_skew < 0:
        raise ValueError(
            f"--eviction-skew={args.eviction_skew} must be >= 0 (0: every tenant equally popular)"
        )
    isvc = load_inference_service(json.loads(json.dumps(args.isvc)))
    encode = local_tokenizer(isvc.spec.model.source)
    if encode is None:
        raise ValueError(
            f"the eviction phase needs the model's tokenizer.json (KV events name token blocks); "
            f"{isvc.spec.model.source!r} has none the router can read"
        )
    system_tokens, longest_tokens = measure(encode, args)
    return size_workload(
        kv_blocks=args.eviction_kv_blocks,
        block_size=isvc.spec.engine.block_size,
        system_tokens=system_tokens,
        longest_tokens=longest_tokens,
        concurrency=args.eviction_concurrency,
        pressure=args.eviction_pressure,
        max_model_len=isvc.spec.model.max_model_len,
    )


async def eviction_phase(args: argparse.Namespace, sizing: EvictionSizing) -> dict[str, Any]:
    print(f"[bench route] eviction workload: {json.dumps(asdict(sizing))}", flush=True)
    convs = skewed_conversations(
        sizing.tenants, args.eviction_conversations, args.eviction_turns, args.eviction_skew, args.seed
    )
    runs: list[EvictionRun] = []
    for number, mode in enumerate(round_modes(args.eviction_rounds)):
        runs.append(await run_once(args, mode, convs))
        figures = {k: _round(v) for k, v in run_figures(runs[-1]).items()}
        shadow = runs[-1].log.figures()
        print(
            f"[bench route] eviction round {number}, {mode}: {json.dumps(figures)} {json.dumps(shadow)}",
            flush=True,
        )
    out = eviction_figures([r for r in runs if r.mode == "events"], [r for r in runs if r.mode == "estimate"])
    out["rounds"] = [
        {
            "mode": run.mode,
            **{k: _round(v) for k, v in run_figures(run).items()},
            "per_decision": run.log.figures(),
            "subscriber": run.events,
        }
        for run in runs
    ]
    out["workload"] = {
        **asdict(sizing),
        "kv_blocks_per_engine": args.eviction_kv_blocks,
        "pressure": args.eviction_pressure,
        "conversations": args.eviction_conversations,
        "turns": args.eviction_turns,
        "skew": args.eviction_skew,
        "rounds": args.eviction_rounds,
        "concurrency": args.eviction_concurrency,
        "system_sentences": args.system_sentences,
        "max_tokens": args.max_tokens,
        "tenants_drawn": len({t for t, _ in convs}),
    }
    return out
