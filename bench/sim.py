"""`specfleet bench sim`: the simulator against real local fleets, on the same workloads, side by side.

For each configuration (1 and 2 engines, speculation off and on, light and heavy Poisson loads, a
prefix-heavy and a chat workload, and a shifting load under the tuner) a real `specfleet up` fleet of the
bundled model serves a trace (token-id prompts of the trace's lengths, `ignore_eos` so outputs have the
trace's lengths), then the simulator runs the same trace with a profile measured right before and right
after that configuration's real run (`sim_profiles.py`), the speculative acceptance the real engines
reported, and the request overhead measured on the real fleet. Prints per-config errors and one JSON line
with the worst of each over the configurations.

This machine is shared and noisy: the host's speed moves between runs minutes apart, so each
configuration is priced by the steps measured on both sides of its own run, and `profile_scale` (the real
engines' steps against that profile) says how well it held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from specfleet.bench import stoppable
from specfleet.bench.sim_profiles import FULL_GRID, QUICK_GRID, ProfileSeries
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator import load_inference_service
from specfleet.sim.acceptance import classes_from_metrics
from specfleet.sim.fleet import SimFleet
from specfleet.sim.measure import Profiler
from specfleet.sim.profile import AcceptanceClass, Profile, proposal_continue
from specfleet.sim.report import request_rows
from specfleet.sim.report import summarize as sim_summarize
from specfleet.sim.workload import Lengths, SimRequest, Synthetic

MODEL = "bundled://smollm2-135m-instruct"
KV_GIB = 0.25  # small, so that the heavy loads meet the cache's limits in both worlds


@dataclass(frozen=True)
class Config:
    name: str
    replicas: int
    method: str  # none | ngram
    k: int
    workload: Synthetic
    copy: bool = False  # prompts that repeat a pattern, so n-gram proposals are accepted
    tune: bool = False


def configs(seconds: float) -> list[Config]:
    chat = Synthetic(duration_s=seconds, prompt=Lengths("uniform", 16, 96), output=Lengths("uniform", 16, 64))
    prefix = replace(
        chat, prompt=Lengths("uniform", 288, 320), prefix_groups=3, prefix_tokens=256, prefix_share=1.0
    )
    return [
        Config("chat-1e-light", 1, "none", 0, replace(chat, rates=((0.0, 1.0),), seed=1)),
        Config("chat-1e-heavy", 1, "none", 0, replace(chat, rates=((0.0, 3.0),), seed=2)),
        Config("chat-2e-heavy", 2, "none", 0, replace(chat, rates=((0.0, 5.0),), seed=3)),
        Config("prefix-1e", 1, "none", 0, replace(prefix, rates=((0.0, 1.5),), seed=4)),
        Config("copy-1e-spec", 1, "ngram", 4, replace(chat, rates=((0.0, 1.0),), seed=5), copy=True),
        Config(
            "shift-1e-tuner",
            1,
            "ngram",
            0,
            replace(chat, rates=((0.0, 0.5), (seconds / 3, 4.0), (2 * seconds / 3, 0.5)), seed=6),
            copy=True,
            tune=True,
        ),
    ]


def isvc_doc(c: Config, interval_s: float) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": MODEL, "dtype": "float32", "maxModelLen": 1024},
        "engine": {"drainTimeoutSeconds": 5},
        "batching": {"maxNumSeqs": 32, "maxNumBatchedTokens": 512},
        "speculative": {"method": c.method, "numSpeculativeTokens": c.k},
        "replicas": c.replicas,
        "resources": {"gpus": 0},
        "slo": {"ttftP95Ms": 3000, "tpotP95Ms": 300},
    }
    if c.tune:
        spec["autotune"] = {
            "enabled": True,
            "intervalSeconds": max(5, round(interval_s)),
            "bounds": {
                "numSpeculativeTokens": [0, 4],
                "maxNumSeqs": [4, 32],
                "maxNumBatchedTokens": [256, 512],
            },
        }
    return {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": c.name},
        "spec": spec,
    }


def real_prompt(r: SimRequest, index: int, copy: bool, vocab: int = 49000) -> list[int]:
    """Token ids with the trace's structure: a group's prefix shared, the rest unique to the request."""
    shared = r.prefix_tokens if r.prefix_group is not None else 0
    head = [random.Random(1000 + (r.prefix_group or 0)).randrange(100, vocab) for _ in range(shared)]
    rng = random.Random(index * 7 + 3)
    rest = r.prompt_tokens - shared
    if copy:
        pattern = [rng.randrange(100, vocab) for _ in range(12)]
        tail = (pattern * (rest // 12 + 1))[:rest]
    else:
        tail = [rng.randrange(100, vocab) for _ in range(rest)]
    return head + tail


async def replay(url: str, requests: list[SimRequest], copy: bool) -> list[dict[str, float]]:
    """Open loop: each request sent at its arrival time; streamed; TTFT, e2e, output tokens."""
    out: list[dict[str, float]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, r: SimRequest) -> None:
            delay = r.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "model": "smollm2-135m-instruct",
                "prompt": real_prompt(r, i, copy),
                "max_tokens": r.output_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            first, tokens = None, 0
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {response.status_code} {await response.aread()!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
                    elif first is None and chunk.get("choices"):
                        first = time.perf_counter()
            end = time.perf_counter()
            out.append(
                {
                    "arrival_s": start - t0,
                    "ttft_s": (first or end) - start,
                    "e2e_s": end - start,
                    "output_tokens": tokens,
                    "finish_s": end - t0,
                }
            )

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return out


def pct(values: list[float], q: float) -> float:
    """The `q`th percentile as the nearest rank, on both sides of the comparison (`figures`, `_simulate`): on a
    few dozen requests an interpolated one lands between two requests, and where they lie far apart (the one
    that queued behind another's prompt and the one that did not) it is neither (issue 41: prefix-1e's
    simulated TTFT p95 halfway from 806 to 1198 ms, 23.5 % off the real 811, 0.6 % as the nearest rank)."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def figures(rows: list[dict[str, float]]) -> dict[str, float]:
    ttft = [r["ttft_s"] for r in rows]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in rows if r["output_tokens"] > 1]
    span = max(r["finish_s"] for r in rows) - min(r["arrival_s"] for r in rows)
    return {
        "throughput": sum(r["output_tokens"] for r in rows) / span,
        "ttft_p50": pct(ttft, 50),
        "ttft_p95": pct(ttft, 95),
        "tpot_p50": pct(tpot, 50),
        "tpot_p95": pct(tpot, 95),
        "requests": len(rows),
    }


@dataclass(frozen=True)
class Acceptance:
    """What the real engines' /metrics said of the proposer on the trace, as the simulator takes it."""

    per_pos: tuple[float, ...]  # P(position i accepted | a draft): simulated verified and shadow drafts
    share: float  # verified drafts per sequence-step (the shadow's per lookup where none was verified)
    length: float  # draft tokens per verified draft (shadow drafts' lengths are not exported: taken as full)
    verified_k: int  # positions the verified drafts reached (0: none verified)
    source: str  # "verified", "verified+shadow" (positions past verified_k from the shadow), "shadow" or ""
    shadow_per_pos: tuple[float, ...] = ()  # the shadow drafts' own P(position i accepted | a draft)
    shadow_share: float | None = None  # shadow lookups that found a draft (None: no lookup scored)


def continued(verified: tuple[float, ...], shadow: tuple[float, ...]) -> tuple[float, ...]:
    """The verified positions, continued past the k they were verified at by the shadow drafts' ratios
    P(i accepted | i - 1 accepted) (scored up to the engine's ceiling for k while k was 0): what a larger
    k would have accepted on this traffic, where extrapolating the last verified ratio guessed it (bench sim,
    2026-12-06: verified 0.8, 0.775 at k = 2 went on at 0.97 a position, the shadow drafts' positions 3 and 4
    fell to a tenth of that, and the simulated tuner chose k = 4 where the real one chose k = 2)."""
    if not verified:
        return shadow
    out = list(verified)
    for i in range(len(verified), len(shadow)):
        if shadow[i - 1] > 0:
            out.append(out[-1] * shadow[i] / shadow[i - 1])
        elif out[-1] > 0:
            break  # the shadow drafts never reached a position the verified ones did: no ratio to go on with
        else:
            out.append(0.0)
    return tuple(out)


async def metrics_texts(urls: list[str]) -> list[str]:
    """The engines' /metrics texts."""
    async with httpx.AsyncClient(timeout=10) as client:
        return [(await client.get(f"{url}/metrics")).text for url in urls]


async def scrape_acceptance(urls: list[str]) -> Acceptance:
    """Per-position acceptance, the share of decoding sequence-steps that got a proposal and the draft
    tokens per draft, from /metrics: the verified drafts', continued past their k by the engines' shadow
    drafts (n-gram lookups scored while verifying none: the same proposer on the same traffic, per lookup),
    or where none was verified (k stayed 0) the shadow drafts' alone; and the shadow drafts' own figures,
    which the real tuner read while k was 0 and the simulated engines' shadow drafts report."""
    from specfleet.tuner.snapshot import PER_POSITION, parse_metrics

    drafts = draft_tokens = steps_seqs = shadow_drafts = lookups = 0.0
    per_pos: dict[int, float] = {}
    shadow_pos: dict[int, float] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for url in urls:
            snap = parse_metrics((await client.get(f"{url}/metrics")).text, 0.0)
            drafts += snap.counters.get("spec_decode_drafts", 0.0)
            draft_tokens += snap.counters.get("spec_decode_draft_tokens", 0.0)
            steps_seqs += snap.sums.get("batch_size", 0.0)
            shadow_drafts += snap.counters.get("spec_decode_shadow_drafts", 0.0)
            lookups += snap.counters.get("spec_decode_shadow_lookups", 0.0)
            for pos, v in snap.per_pos[PER_POSITION[0]].items():
                per_pos[pos] = per_pos.get(pos, 0.0) + v
            for pos, v in snap.per_pos[PER_POSITION[1]].items():
                shadow_pos[pos] = shadow_pos.get(pos, 0.0) + v
    shadow = (
        tuple(shadow_pos.get(i, 0.0) / shadow_drafts for i in range(max(shadow_pos) + 1))
        if shadow_drafts and shadow_pos
        else ()
    )
    shadow_share = min(1.0, shadow_drafts / lookups) if lookups else None
    if drafts and per_pos:
        verified = tuple(per_pos.get(i, 0.0) / drafts for i in range(max(per_pos) + 1))
        positions = continued(verified, shadow)
        return Acceptance(
            positions,
            min(1.0, drafts / max(steps_seqs, 1)),
            draft_tokens / drafts,
            len(verified),
            "verified+shadow" if len(positions) > len(verified) else "verified",
            shadow,
            shadow_share,
        )
    if shadow:
        return Acceptance(shadow, shadow_share or 0.0, float(len(shadow)), 0, "shadow", shadow, shadow_share)
    return Acceptance((), 1.0, 0.0, 0, "", shadow, shadow_share)


@dataclass
class StepMix:
    """What an engine's steps held over a run, from the counters and histograms /metrics exports."""

    steps: float = 0.0
    seconds: float = 0.0  # of `Engine.step()`: the core's, without the server's work beside it
    sequences: float = 0.0  # sequence-steps (the batch-size histogram's sum)
    prompt_tokens: float = 0.0  # prompt tokens computed
    draft_tokens: float = 0.0
    drafts: float = 0.0  # sequence-steps that verified proposals
    # the engines' own view of their requests' first tokens (their API servers': from a request's arrival
    # there), so that a client TTFT can be split into the engines' part and the path to and from them
    requests: float = 0.0
    ttft_seconds: float = 0.0
    queue_seconds: float = 0.0  # arrival to first scheduling
    # of those steps, the ones that computed no prompt token (decode and verification only), as the engines
    # export them apart (0 from an engine that does not: one calibration factor for every step then)
    decode_steps: float = 0.0
    decode_seconds: float = 0.0
    decode_sequences: float = 0.0
    decode_draft_tokens: float = 0.0
    decode_drafts: float = 0.0
    # the engine cores' seconds between back-to-back steps, outside them (`specfleet_step_gap_seconds`)
    gap_seconds: float = 0.0

    def add(self, counters: dict[str, float], sums: dict[str, float], counts: dict[str, float]) -> None:
        self.steps += counts.get("step_duration_seconds", 0.0)
        self.seconds += sums.get("step_duration_seconds", 0.0)
        self.sequences += sums.get("batch_size", 0.0)
        self.prompt_tokens += counters.get("prompt_tokens", 0.0)
        self.draft_tokens += counters.get("spec_decode_draft_tokens", 0.0)
        self.drafts += counters.get("spec_decode_drafts", 0.0)
        self.requests += counts.get("time_to_first_token_seconds", 0.0)
        self.ttft_seconds += sums.get("time_to_first_token_seconds", 0.0)
        self.queue_seconds += sums.get("request_queue_time_seconds", 0.0)
        self.decode_steps += counts.get("decode_step_duration_seconds", 0.0)
        self.decode_seconds += sums.get("decode_step_duration_seconds", 0.0)
        self.decode_sequences += counters.get("decode_step_sequences", 0.0)
        self.decode_draft_tokens += counters.get("decode_step_draft_tokens", 0.0)
        self.decode_drafts += counters.get("decode_step_drafts", 0.0)
        self.gap_seconds += counters.get("step_gap_seconds", 0.0)

    def decode(self) -> StepMix:
        """The steps that computed no prompt token (none where the engines did not export them apart)."""
        return StepMix(
            self.decode_steps,
            self.decode_seconds,
            self.decode_sequences,
            0.0,
            self.decode_draft_tokens,
            self.decode_drafts,
        )

    def prefill(self) -> StepMix:
        """The steps that computed prompt tokens (every step where decode steps were not exported apart)."""
        return StepMix(
            self.steps - self.decode_steps,
            self.seconds - self.decode_seconds,
            self.sequences - self.decode_sequences,
            self.prompt_tokens,
            self.draft_tokens - self.decode_draft_tokens,
            self.drafts - self.decode_drafts,
        )

    def gap_per_step(self) -> float:
        """The engine cores' mean seconds between back-to-back steps (0 from engines that do not export it)."""
        return self.gap_seconds / self.steps if self.steps else 0.0

    def ttft_ms(self) -> dict[str, float]:
        """The engines' mean TTFT and queue time over the requests they finished."""
        n = max(self.requests, 1.0)
        return {
            "engine_ttft_ms_mean": round(1000 * self.ttft_seconds / n, 1),
            "engine_queue_ms_mean": round(1000 * self.queue_seconds / n, 1),
        }

    def since(self, earlier: StepMix) -> StepMix:
        """The steps between two reads of the same engines."""
        return StepMix(*(a - b for a, b in zip(astuple(self), astuple(earlier))))

    def speed(self, profile: Profile) -> float:
        """Measured over predicted mean step, the prediction at this mix's mean step (the profile's model
        costs only): above 1, the steps ran slower than the profile says for the same work."""
        if not self.steps:
            return 1.0
        n = self.steps
        d = self.draft_tokens / n
        predicted = profile.core_s(self.sequences / n + d, self.prompt_tokens / n, 0.0, d, self.drafts / n)
        return (self.seconds / n) / predicted if predicted > 0 else 1.0


def step_mix_record(real: StepMix, sim: StepMix) -> dict[str, dict[str, float]]:
    """Both worlds' step mixes for the JSON, every field (`StepMix(**record["real"])` reads one back)."""
    return {"real": asdict(real), "sim": asdict(sim)}


async def real_mix(urls: list[str]) -> StepMix:
    """The real engines' steps over the run, from their /metrics."""
    from specfleet.tuner.snapshot import parse_metrics

    mix = StepMix()
    async with httpx.AsyncClient(timeout=10) as client:
        for url in urls:
            snap = parse_metrics((await client.get(f"{url}/metrics")).text, 0.0)
            mix.add(snap.counters, snap.sums, snap.counts)
    return mix


def sim_mix(fleet: SimFleet) -> StepMix:
    """The simulated engines' steps, the same figures from their metrics (their step histograms hold the
    core's seconds, as the engine's own does: the server's work is beside it)."""
    mix = StepMix()
    for e in fleet.engines:
        h = e.metrics.histograms
        mix.add(
            e.metrics.counters,
            {name: hist.sum for name, hist in h.items()},
            {name: float(hist.count) for name, hist in h.items()},
        )
    return mix


def rescaled(profile: Profile, factor: float, prefill_factor: float | None = None) -> Profile:
    """The profile's model costs times `factor` (the machine ran that much slower or faster than when the
    profile was measured), its per-prompt-token cost times `prefill_factor` (default `factor`); the serving
    overheads, measured in the run itself, unchanged."""
    return profile.with_(
        knots=tuple((d, s * factor) for d, s in profile.knots),
        prefill_s_per_token=profile.prefill_s_per_token
        * (factor if prefill_factor is None else prefill_factor),
        context_s_per_token=profile.context_s_per_token * factor,
        draft_s_per_token=profile.draft_s_per_token * factor,
        verify_s_per_seq=profile.verify_s_per_seq * factor,
    )


BURST = 8  # concurrent requests of the batch measurement: a batch the light and heavy loads both reach
PACED = 1.1  # a TPOT this much above the core's mean step: the server set the pace (below: noise, the core
# loop's own work around `Engine.step()`)


async def overheads(
    url: str, engine_urls: list[str], profile: Profile
) -> tuple[float, float, float, dict[str, float]]:
    """The serving path's costs the profile does not hold, from streamed requests (8-token prompt, 17 tokens
    out), read as the simulator models them: a two-stage pipeline (`Profile.period_s`), the API server's
    work on a step's output (`step_overhead_s + stream_overhead_s * streams`) beside the core's next step,
    a token reaching its client when the server has sent it. A stream's TPOT is then the longer of the
    core's step and the server's work, so the server's work is observable only where it set the pace:
    each phase (5 lone requests one after another, then `BURST` at once) sets the clients' median TPOT
    against the engines' own mean `Engine.step()` and mean batch over the phase (their /metrics
    histograms: the machine's speed at that moment, not the profile's; with two engines the burst splits),
    and `server_work` turns the two into per-step and per-stream costs. Per request: the mean TTFT of 5
    lone one-token requests (their only step the prefill) minus the engines' own mean step over them and
    the server's work on the first token: the path outside the core (HTTP, router, the API server, the
    request's and the first token's way between the server and the core; server work hidden behind the
    core only delays each token, and lands here). The profile's prediction for that prefill stood in for the
    engines' step before and was longer than the whole TTFT: the overhead read 0 in every configuration of
    the 2026-12-06 quiet runs, and the simulated TTFTs lacked the path. Also returns what the phases
    measured."""

    async def one(client: httpx.AsyncClient, i: int, max_tokens: int = 17) -> tuple[float, float]:
        body = {
            "model": "smollm2-135m-instruct",
            "prompt": [200 + i * 10 + j for j in range(8)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        start = time.perf_counter()
        first = None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: ") and line != "data: [DONE]":
                    first = time.perf_counter()
        end = time.perf_counter()
        first = first or end
        return first - start, (end - first) / max(max_tokens - 1, 1)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        before_first = await real_mix(engine_urls)
        firsts = [await one(client, 200 + i, max_tokens=1) for i in range(5)]
        before = await real_mix(engine_urls)
        lone = [await one(client, i) for i in range(5)]
        between = await real_mix(engine_urls)
        burst = await asyncio.gather(*(one(client, 100 + i) for i in range(BURST)))
        after = await real_mix(engine_urls)

    def phase(rows: list[tuple[float, float]], mix: StepMix) -> tuple[float, float, float]:
        """The clients' median TPOT, the engines' mean core step and mean batch over the phase."""
        tpot = statistics.median(t for _, t in rows)
        core = mix.seconds / mix.steps if mix.steps else 0.0
        batch = mix.sequences / mix.steps if mix.steps else 1.0
        return tpot, core, batch

    tpot1, core1, batch1 = lone_phase = phase(lone, between.since(before))
    tpotb, coreb, batchb = burst_phase = phase(list(burst), after.since(between))
    step, stream = server_work(lone_phase, burst_phase)
    prefill = before.since(before_first)  # the one-token requests' steps: their prefills, one each
    prefill_s = prefill.seconds / prefill.steps if prefill.steps else profile.core_s(0, 8, 0)
    # the mean, as the steps' (each request's TTFT holds its own step; a median against a mean could fall
    # below it when one prefill step stalled on a loaded host, and the path outside the core read negative)
    first_ttft = statistics.fmean(ttft for ttft, _ in firsts)
    request = first_ttft - prefill_s - (step + stream)
    seen = {
        "first_ttft_ms": round(first_ttft * 1000, 1),
        "first_core_step_ms": round(prefill_s * 1000, 1),
        "profile_first_step_ms": round(profile.core_s(0, 8, 0) * 1000, 1),
        "lone_tpot_ms": round(tpot1 * 1000, 1),
        "lone_core_step_ms": round(core1 * 1000, 1),
        "burst_tpot_ms": round(tpotb * 1000, 1),
        "burst_core_step_ms": round(coreb * 1000, 1),
        "burst_batch": round(batchb, 2),
    }
    return max(0.0, request), step, stream, seen


def server_work(lone: tuple[float, float, float], burst: tuple[float, float, float]) -> tuple[float, float]:
    """`step_overhead_s` and `stream_overhead_s` from two phases' (client TPOT, core's mean step, mean
    batch), under the pipeline: a phase whose TPOT is more than `PACED` times the core's step was paced by
    the server, whose work per step is then that TPOT; in the other the server's work was hidden (0)."""
    (tpot1, core1, batch1), (tpotb, coreb, batchb) = lone, burst
    server1 = tpot1 if tpot1 > PACED * core1 else 0.0
    serverb = tpotb if tpotb > PACED * coreb else 0.0
    if server1 and serverb and batchb > batch1:  # both phases server-bound: the line through both
        stream = max(0.0, (serverb - server1) / (batchb - batch1))
        return max(0.0, server1 - batch1 * stream), stream
    if serverb:  # the lone request's server work was hidden: all of the burst's is taken as per stream
        return 0.0, serverb / batchb
    return server1, 0.0  # hidden at the burst's batch: nothing per stream is observable


def decisions(ticks: list[Any]) -> list[str]:
    return [t.decision.config.short() for t in ticks if t.decision.changed and t.decision.config]


def _rounded(values: tuple[float, ...]) -> list[float]:
    return [round(v, 3) for v in values]


def tuner_trace(ticks: list[Any]) -> list[dict[str, Any]]:
    """What each interval's policy was fed and what it decided, in either world (times from the first tick):
    the figures a decision rests on (load, step, verified and shadow acceptance with their shares), so two
    decision sequences that differ can be read side by side."""
    if not ticks:
        return []
    t0 = ticks[0].observation.time
    out = []
    for t in ticks:
        o = t.observation
        out.append(
            {
                "t": round(o.time - t0, 1),
                "config": o.config.short() if o.config else None,
                "demand": None if o.demand is None else round(o.demand, 2),
                "batch": None if o.batch_size is None else round(o.batch_size, 2),
                "step_ms": None if o.step_duration_s is None else round(1000 * o.step_duration_s, 1),
                "accepted_per_pos": _rounded(o.accepted_per_pos),
                "proposal_share": None if o.proposal_share is None else round(o.proposal_share, 3),
                "shadow_accepted_per_pos": _rounded(o.shadow_accepted_per_pos),
                "shadow_share": None if o.shadow_share is None else round(o.shadow_share, 3),
                "shadow_lookups_per_s": round(o.shadow_lookup_rate or 0.0, 1),
                "kind": t.decision.kind,
                "reason": t.decision.reason,
            }
        )
    return out


async def _simulate(
    c: Config,
    isvc: Any,
    p: Profile,
    args: argparse.Namespace,
    requests: list[Any],
    acceptance: tuple[float, ...],
) -> tuple[dict[str, float], Any, SimFleet]:
    """The trace through a simulated fleet of `p`: its figures in the real run's units, the run, the fleet."""
    sim_fleet = SimFleet(
        isvc, p, tune=c.tune, interval_s=args.interval, window_s=args.window, accepted_per_pos=acceptance
    )
    run = await asyncio.to_thread(sim_fleet.run, requests)  # its tuner needs an event loop of its own
    s = sim_summarize(run, p, {})
    rows = request_rows(run)  # the percentiles as the real side's (`pct`), not the report's interpolated ones
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    return (
        {
            "throughput": s["output_throughput"],
            "ttft_p50": pct(ttft, 50),
            "ttft_p95": pct(ttft, 95),
            "tpot_p50": pct(tpot, 50),
            "tpot_p95": pct(tpot, 95),
            "requests": s["completed"],
        },
        run,
        sim_fleet,
    )


SCALE_BAND = 0.1  # a calibration factor further than this from 1 is explained in the output (issue 41)


def scale_note(real_speed: float, sim_speed: float, host_cpu: dict[str, float] | None = None) -> str:
    """Why the calibration factor left 1 +- SCALE_BAND: which world's steps left the profile's prediction,
    and what else kept the host's cores busy meanwhile (`HostCpu`)."""
    parts = []
    if abs(real_speed - 1) > SCALE_BAND:
        others = (host_cpu or {}).get("others_cores")
        seen = (
            f": other processes kept {others:.2f} of the {len(os.sched_getaffinity(0))} cores busy during the trace"
            if others is not None
            else ""
        )
        parts.append(
            f"the real engines' steps took {real_speed:.2f}x the profile's prediction for their work "
            f"(the machine's speed changed since the profile: other load on a shared host{seen})"
        )
    if abs(sim_speed - 1) > SCALE_BAND:
        parts.append(
            f"the simulated steps took {sim_speed:.2f}x the prediction at their own mean mix (the prediction "
            "leaves out the context the steps attended to, which /metrics does not export, and the mean step "
            "is not the step of the mean mix where the curve bends)"
        )
    return "; ".join(parts) or "both within the band, their ratio outside it"


def _row(arrival_s: float, ttft_s: float, e2e_s: float, tokens: float) -> list[float]:
    return [round(arrival_s, 4), round(ttft_s, 4), round(e2e_s, 4), tokens]


def _mean_ms(values: Iterable[float]) -> float:
    seen = list(values)
    return round(1000 * sum(seen) / max(len(seen), 1), 1)


def _errors(sim: dict[str, float], real: dict[str, float]) -> dict[str, float]:
    """The simulation's error against the real run, in percent of the real figure."""
    return {
        f"{m}_error_pct": round(100 * abs(sim[m] - real[m]) / real[m], 1)
        for m in ("throughput", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95")
    }


def calibration(
    real: StepMix, sim: StepMix, profile: Profile, host_cpu: dict[str, float] | None = None
) -> tuple[tuple[float, float], dict[str, Any]]:
    """The calibration factors (the decode costs', the per-prompt-token cost's) and their record.
    Calibrated, the profile's model costs are rescaled by how much slower (or faster) the real engines' own
    `Engine.step()` ran over the trace than the profile predicts for the work their steps held (/metrics:
    steps, their seconds, sequences, prompt and draft tokens, sequences verifying), relative to the same
    ratio in the simulation: the machine's speed during the run, measured by the engine, not fitted to the
    latencies being compared. The steps that computed no prompt token set the decode costs' factor, and
    the ones that did the prompt token's, given the decode part of theirs at its own factor (`split_scale`):
    one factor for both traded TTFT for TPOT where the profile priced decode 1.1-1.35x slower than the
    engines ran it and prefill right (issue 41). `profile_scale` stays the one factor over every step."""
    real_speed, sim_speed = real.speed(profile), sim.speed(profile)
    factor = real_speed / sim_speed
    decode, prefill = split_scale(real, sim, profile, factor)
    return (decode, prefill), {
        "real_step_ms": round(1000 * real.seconds / max(real.steps, 1), 1),
        "profile_scale": round(factor, 3),
        "profile_scale_decode": round(decode, 3),
        "profile_scale_prefill": round(prefill, 3),
        # each world's mean step over the profile's prediction at its mean mix, whose ratio is the factor
        "profile_scale_parts": {"real": round(real_speed, 3), "sim": round(sim_speed, 3)},
        **(
            {}
            if abs(factor - 1) <= SCALE_BAND
            else {"profile_scale_note": scale_note(real_speed, sim_speed, host_cpu)}
        ),
    }


async def tick_with_the_trace(fleet: LocalFleet, interval_s: float, done: asyncio.Event) -> None:
    """The real tuner's intervals at the trace's start and every `interval_s` after it, on a fixed schedule,
    until the first one after the trace's last request finished (`done`): the simulated fleet's, whose
    simulated time starts with the trace. The fleet's own loop ticked from whenever it happened to wake
    (bench sim, 2026-12-06: over 1 s into the trace, then 0.4-0.5 s later each interval), so the two tuners'
    windows held different requests: the real one decided k = 4 at its second tick, on a request that had
    finished, where the simulated one's second tick came before the trace's first arrival (6.1 s)."""
    t0 = time.perf_counter()
    n = 0
    while True:
        await fleet.tick()
        if done.is_set():
            return
        n += 1
        await asyncio.sleep(max(0.0, t0 + n * interval_s - time.perf_counter()))


@dataclass
class _RealRun:
    """What one configuration's real fleet measured, for its simulation and its JSON."""

    rows: list[dict[str, float]]
    startup_s: float
    overheads: tuple[float, float, float]  # request, step and stream overheads (s)
    seen: dict[str, Any]  # the overhead phases' own figures
    steps: StepMix  # the engines' steps over the trace
    host_cpu: dict[str, float]
    accepted: Acceptance
    # the finished requests' classes of acceptance (a configuration whose k the tuner holds still): each
    # simulated request draws one
    classes: tuple[AcceptanceClass, ...]
    decisions: list[str]
    trace: list[dict[str, Any]]


async def _run_real(
    c: Config, isvc: Any, requests: list[SimRequest], profile: Profile, args: argparse.Namespace
) -> _RealRun:
    """The configuration's trace on a real local fleet: its overheads, then the trace (with the tuner on a
    fixed schedule from the trace's start when the configuration is tuned), then the engines' counters."""
    fleet = LocalFleet(
        isvc,
        port=0,
        tune=False,  # the tuner of a tuned configuration starts with the trace, below
        interval_s=args.interval,
        window_s=args.window,
        engine_extra_args=["--kv-cache-gib", str(KV_GIB), "--log-level", "warning"],
        cpus_per_engine=args.cpus_per_engine,
    )
    started = time.perf_counter()
    await fleet.start()
    startup_s = time.perf_counter() - started
    try:
        request_overhead, step_overhead, stream_overhead, seen = await overheads(
            fleet.url, fleet.engine_urls, profile
        )
        # the trace's steps only: the overhead phases' lone and burst steps (and the warm-up) are not in the
        # simulation, and counted in made the calibration compare a different mix (bench sim, 2026-12-03:
        # factors 0.61-0.92 on a quiet host, every calibrated figure worse than the uncalibrated one)
        before = await real_mix(fleet.engine_urls)
        texts_before = await metrics_texts(fleet.engine_urls)  # the classes count the trace's requests only
        cpu_before = HostCpu.read()
        done = asyncio.Event()
        ticker = None
        if c.tune:  # a fresh tuner whose first tick (the scrape base) is the trace's start
            fleet.tuner = fleet.new_tuner()
            ticker = asyncio.create_task(tick_with_the_trace(fleet, args.interval, done))
        rows = await replay(fleet.url, requests, c.copy)
        host_cpu = cpu.since(cpu_before) if (cpu := HostCpu.read()) is not None else {}
        done.set()
        if ticker is not None:
            await ticker
        return _RealRun(
            rows=rows,
            startup_s=startup_s,
            overheads=(request_overhead, step_overhead, stream_overhead),
            seen=seen,
            accepted=await scrape_acceptance(fleet.engine_urls),
            # classes measured at one k: a tuned configuration's k moves, and its requests keep one distribution
            classes=classes_from_metrics(await metrics_texts(fleet.engine_urls), c.k, texts_before)
            if c.k and not c.tune
            else (),
            steps=(await real_mix(fleet.engine_urls)).since(before),
            host_cpu=host_cpu,
            decisions=decisions(fleet.ticks),
            trace=tuner_trace(fleet.ticks),
        )
    finally:
        await fleet.stop(drain_timeout_s=2)


def _acceptance_record(accepted: Acceptance, classes: tuple[AcceptanceClass, ...]) -> dict[str, Any]:
    """The JSON's record of the speculation the real engines did: acceptance per position, per request class,
    where it was read, the proposal share and the shadow drafts'."""
    return {
        "acceptance": [round(a, 3) for a in accepted.per_pos],
        "acceptance_classes": [
            {
                "requests": round(c.requests),
                "share": round(c.share, 3),
                "acceptance": [round(a, 3) for a in c.accepted_per_pos],
                "proposal_continue": round(c.proposal_continue, 3),
            }
            for c in classes
        ],
        "acceptance_from": accepted.source,
        "proposal_share": round(accepted.share, 3),
        "draft_tokens_per_draft": round(accepted.length, 2),
        "shadow_acceptance": [round(a, 3) for a in accepted.shadow_per_pos],
        "shadow_share": None if accepted.shadow_share is None else round(accepted.shadow_share, 3),
    }


def _request_records(
    rows: list[dict[str, float]], run: Any, real_steps: StepMix, sim_steps: StepMix
) -> dict[str, Any]:
    """Where the requests' time went in both worlds: `ttft_parts`, the clients' mean TTFT against the engines'
    own (the rest is the HTTP path: client, router, the engines' API servers before the request reaches
    them), and `request_rows`, each request in trace order (arrival, TTFT, e2e in s, output tokens), for
    reading a percentile's error back to the requests behind it."""
    return {
        "ttft_parts": {
            "real": {"client_ttft_ms_mean": _mean_ms(r["ttft_s"] for r in rows), **real_steps.ttft_ms()},
            "sim": {
                "client_ttft_ms_mean": _mean_ms(
                    x.first_token_s - x.arrival_s for x in run.records if x.first_token_s is not None
                ),
                **sim_steps.ttft_ms(),
            },
        },
        "request_rows": {
            "real": [
                _row(r["arrival_s"], r["ttft_s"], r["e2e_s"], r["output_tokens"])
                for r in sorted(rows, key=lambda r: r["arrival_s"])
            ],
            "sim": [
                _row(
                    x.arrival_s,
                    (x.first_token_s or x.arrival_s) - x.arrival_s,
                    x.finish_s - x.arrival_s,
                    x.output_tokens,
                )
                for x in sorted(run.records, key=lambda x: x.index)
                if x.finish_s is not None
            ],
        },
    }


async def run_config(c: Config, series: ProfileSeries, args: argparse.Namespace) -> dict[str, Any]:
    requests = list(c.workload.requests())
    isvc = load_inference_service(isvc_doc(c, args.interval))
    measured = await _run_real(c, isvc, requests, series.before(), args)
    profile, profile_record = series.around()  # measured again now: fitted to both sides of the run
    rows, startup_s, seen, host_cpu = measured.rows, measured.startup_s, measured.seen, measured.host_cpu
    request_overhead, step_overhead, stream_overhead = measured.overheads
    accepted, real_steps = measured.accepted, measured.steps
    real_decisions, real_trace = measured.decisions, measured.trace
    real = figures(rows)
    tuned = profile.with_(
        request_overhead_s=request_overhead,
        step_overhead_s=step_overhead,
        stream_overhead_s=stream_overhead,
        proposal_share=accepted.share,
        proposal_continue=proposal_continue(accepted.length, accepted.verified_k or len(accepted.per_pos)),
        shadow_share=accepted.shadow_share,
        shadow_accepted_per_pos=accepted.shadow_per_pos,
        startup_s=startup_s,
    )
    classes = measured.classes
    if classes:
        tuned = tuned.with_(acceptance_classes=classes, accepted_per_pos=accepted.per_pos)
    # with classes the acceptance given to the fleet stays with the profile: a given one stands for every request
    acceptance = () if classes else accepted.per_pos

    # As measured: the profile of the steps timed right before and right after the real run.
    raw_sim, raw_run, raw_fleet = await _simulate(c, isvc, tuned, args, requests, acceptance)
    (factor, prefill_factor), scale = calibration(real_steps, sim_mix(raw_fleet), tuned, host_cpu)
    sim, run, calibrated = await _simulate(
        c, isvc, rescaled(tuned, factor, prefill_factor), args, requests, acceptance
    )
    errors = _errors(sim, real)
    result = {
        "config": c.name,
        "requests": len(requests),
        "real": real,
        "sim": sim,
        **errors,
        "uncalibrated": {"sim": raw_sim, **_errors(raw_sim, real)},
        **scale,
        "profile": profile_record,
        "startup_s": round(startup_s, 1),
        "request_overhead_ms": round(request_overhead * 1000, 1),
        "step_overhead_ms": round(step_overhead * 1000, 1),
        "stream_overhead_ms": round(stream_overhead * 1000, 1),
        # the real engine cores' time between back-to-back steps (`specfleet_step_gap_seconds`), not priced: why
        # in docs/results/2026-12-07-bench-sim.md
        "step_gap_ms": round(real_steps.gap_per_step() * 1000, 2),
        "overhead_phases": seen,
        # what calibration read: the real engines' steps and the uncalibrated simulation's (`StepMix`), so a
        # saved run can be calibrated again offline in another form
        "step_mix": step_mix_record(real_steps, sim_mix(raw_fleet)),
        "host_cpu": host_cpu,  # over the trace: cores busy in all, the bench's (fleet, router, client), others'
        **_acceptance_record(accepted, classes),
        **_request_records(rows, run, real_steps, sim_mix(calibrated)),
    }
    if c.tune:
        result["tuner_real"] = real_decisions
        result["tuner_sim"] = [d["config"] for d in run.decisions if d["config"]]
        result["tuner_same_sequence"] = result["tuner_real"] == result["tuner_sim"]
        result["tuner_trace"] = {"real": real_trace, "sim": tuner_trace(run.ticks)}
    print(
        f"bench sim {c.name}: "
        + " ".join(f"{k}={v}" for k, v in errors.items())
        + f" (profile x{factor:.2f} decode, x{prefill_factor:.2f} prefill; uncalibrated: "
        + " ".join(f"{k}={v}" for k, v in _errors(raw_sim, real).items())
        + ")",
        flush=True,
    )
    return result


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    # One thread per engine, in the profile and in every fleet: on this shared machine OpenMP's spinning
    # threads made a 2-thread engine's median step 1643 ms against 140 ms with one (load average 13).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    series = ProfileSeries(MODEL, block_size=16)
    if args.profile:  # a profile from an earlier run, for every configuration (iteration only)
        series.fixed = Profile.load(args.profile)
    else:  # measured now and again after every configuration (sim_profiles.py); verification at k = 4
        series.grid = QUICK_GRID if args.quick else FULL_GRID
        series.profiler = Profiler(MODEL, "ngram", max(series.grid.ks), KV_GIB)
        series.measure()
    profile = series.before()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    profile.save(Path(args.out_dir) / "sim-profile.json")  # at once: `--profile` reuses it if the run is cut
    load_at_start = os.getloadavg()
    seconds = 20.0 if args.quick else args.seconds
    chosen = [c for c in configs(seconds) if not args.only or c.name in args.only]
    results = []
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for c in chosen:  # each configuration's figures are kept as they come: a long run may be cut short
        results.append(await run_config(c, series, args))
        with open(Path(args.out_dir) / "sim-configs.jsonl", "a") as f:
            f.write(json.dumps(results[-1]) + "\n")
    worst = {key: max(r[key] for r in results) for key in results[0] if key.endswith("_error_pct")}
    raw = {key: max(r["uncalibrated"][key] for r in results) for key in worst}
    tuner = next((r for r in results if "tuner_real" in r), None)
    return {
        **worst,
        "tuner_decisions_real": tuner["tuner_real"] if tuner else None,
        "tuner_decisions_sim": tuner["tuner_sim"] if tuner else None,
        "tuner_same_sequence": tuner["tuner_same_sequence"] if tuner else None,
        "uncalibrated": raw,
        "host": host_record(args, load_at_start),
        "profile_measure_s": [round(m.seconds, 1) for m in series.measurements],
        "configs": results,
        "profile": profile.to_json(),
    }


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time


def _proc_stats() -> dict[int, tuple[int, float]]:
    """Every process on the host: pid -> (parent pid, its user + system CPU seconds), from /proc."""
    out: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


@dataclass(frozen=True)
class HostCpu:
    """One read of the host's CPU seconds: busy in all, and of those the bench's own processes' (this one,
    which runs the router, the client and the tuner, and every process below it: the engines' servers and
    cores), so that what other processes took from the cores over a configuration is on record."""

    wall: float
    busy: float
    ours: float

    @classmethod
    def read(cls) -> HostCpu | None:
        try:
            cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return None  # not Linux: nothing to say
        jiffies = [int(x) for x in cpu[:8]]
        idle = jiffies[3] + jiffies[4]  # idle and iowait
        stats = _proc_stats()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in stats.items():
            children.setdefault(parent, []).append(pid)
        ours, todo = 0.0, [os.getpid()]
        while todo:
            pid = todo.pop()
            ours += stats.get(pid, (0, 0.0))[1]
            todo += children.get(pid, [])
        return cls(time.perf_counter(), (sum(jiffies) - idle) / CLOCK_TICKS, ours)

    def since(self, earlier: HostCpu | None) -> dict[str, float]:
        """Cores busy over the time between two reads (in all, the bench's, the others'): a neighbour's
        share of a 2-core host shows as `others_cores` > 0, and slows the real engines' steps alone."""
        if earlier is None:
            return {}
        wall = max(self.wall - earlier.wall, 1e-9)
        busy, ours = (self.busy - earlier.busy) / wall, (self.ours - earlier.ours) / wall
        return {
            "busy_cores": round(busy, 2),
            "bench_cores": round(ours, 2),
            "others_cores": round(max(0.0, busy - ours), 2),
        }


def host_record(args: argparse.Namespace, load_at_start: tuple[float, float, float]) -> dict[str, Any]:
    """The machine the figures come from: its CPU, the cores this process may use, how the engines held
    them, and its load averages (1, 5, 15 min) when the configurations started and ended (the profile's
    measurement before them): on a shared host, the neighbours' share of the cores."""
    model = ""
    try:
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "threads_per_engine": args.threads,
        "cpus_per_engine": args.cpus_per_engine,
        "load_average_start": [round(x, 2) for x in load_at_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench sim", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=45.0, help="seconds of arrivals per configuration")
    p.add_argument(
        "--quick",
        action="store_true",
        help="20 s of arrivals per configuration and a smaller profile grid (under 10 minutes here)",
    )
    p.add_argument(
        "--interval", type=float, default=5.0, help="tuner interval (s) of the shifting-load config"
    )
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--only", nargs="*", default=None, help="run only these configurations")
    p.add_argument(
        "--profile", default=None, help="reuse this profile instead of measuring one (iteration only)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (and in the profile)")
    p.add_argument(
        "--cpus-per-engine",
        type=int,
        default=None,
        help="pin each real engine to this many cores of its own (`specfleet up --cpus-per-engine`)",
    )
    p.add_argument("--out-dir", default="bench/results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = stoppable.run(bench(args))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim.json").write_text(json.dumps(result, indent=1))
    Profile.from_json(result["profile"]).save(out / "sim-profile.json")
    print(f"wrote {out / 'sim.json'}", file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k not in ("configs", "profile")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def split_scale(real: StepMix, sim: StepMix, profile: Profile, factor: float) -> tuple[float, float]:
    """The decode costs' factor from the steps that computed no prompt token (real over simulated, each
    over the profile's prediction at its mean mix), and the prompt token's from the others: the factor that
    brings the simulated prefill-bearing step at its mean mix to its own real-over-simulated ratio once its
    decode part is at the decode factor. Where either world lacks one kind of step (an engine that did not
    export decode steps apart), or the prefill-bearing steps predict no prompt cost, `factor` stands in."""
    real_decode, sim_decode = real.decode(), sim.decode()
    if not (real_decode.steps and sim_decode.steps):
        return factor, factor
    decode = real_decode.speed(profile) / sim_decode.speed(profile)
    real_prefill, sim_prefill = real.prefill(), sim.prefill()
    n = sim_prefill.steps
    if not (real_prefill.steps >= 1 and n >= 1 and sim_prefill.prompt_tokens):
        return decode, factor
    whole = real_prefill.speed(profile) / sim_prefill.speed(profile)
    d = sim_prefill.draft_tokens / n
    total = profile.core_s(
        sim_prefill.sequences / n + d, sim_prefill.prompt_tokens / n, 0.0, d, sim_prefill.drafts / n
    )
    prompt = profile.prefill_s_per_token * sim_prefill.prompt_tokens / n
    if prompt <= 0:
        return decode, factor
    # whole * total = decode * (total - prompt) + prefill * prompt; a factor below a tenth of the whole's is
    # a decode part priced above the whole step: kept at that floor rather than made negative
    return decode, max(0.1 * whole, (whole * total - decode * (total - prompt)) / prompt)
