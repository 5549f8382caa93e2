"""Profiles: what one engine step costs, as a function of what the scheduler put in it.

    core_s = D(decode_tokens) + prefill_s_per_token * prefill_tokens + context_s_per_token * context_tokens
             + draft_s_per_token * draft_tokens + verify_s_per_seq * verify_seqs
    server_s = step_overhead_s + stream_overhead_s * streams

`decode_tokens` are the tokens of sequences past their prompt (one each, plus k verified proposals),
`D` a piecewise-linear curve through knots (the memory-bound floor, then the compute-bound slope: the
knee the tuner's step-cost model fits as `c0`, `c1`), `prefill_tokens` prompt (or recomputed) tokens,
`context_tokens` the KV tokens the batch attends to, `draft_tokens` proposals made this step (a draft
model's cost; n-gram lookup is free), `verify_seqs` the sequences that verify proposals in the step (each
adds the rows of its proposals to the sampler's verification and its multi-token query to attention, a
cost per sequence beyond its tokens' that `specfleet profile` measures at each k). Like Vidur's execution-time predictor, one regression over a grid
measured on the engine itself; unlike it, at the whole-step level (the engine's own `Engine.step()` time,
scheduling and sampling included), since the grid is measured with the engine.

`core_s` is the engine core's step; `server_s` is the API server's work on a step's output (`streams`:
the sequences that emit a token in it, each a detokenised SSE chunk). The two run in separate processes
(docs/engine_core.md), so a step's seconds are a two-stage pipeline, not a sum (`period_s`; why, and the
runs that showed it: docs/decisions/014-sim-serving-pipeline.md).

Two kinds: `measured` (`specfleet profile`, least squares over the grid) and `roofline` (an estimate for
hardware not at hand from memory bandwidth and FLOP/s; labelled `estimate: true` in the file and in every
report that uses it). A profile's costs are for one engine of `tp` tensor-parallel ranks: a measured one
covers the degree it was timed at only; a roofline one keeps the inputs it was derived from
(`RooflineInputs`), so `sim.roofline.at_tp` derives it again at another degree. A profile also carries the KV capacity in blocks, the speculative acceptance per
position and the share of steps that carry a proposal, and the front end's per-request overhead.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

# Decode-token knots of the curve: powers of two, which the measured grid hits exactly.
DEFAULT_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class StepPoint:
    """One measured step (or the mean of several alike)."""

    decode_tokens: float
    prefill_tokens: float
    context_tokens: float
    draft_tokens: float
    seconds: float
    verify_seqs: float = 0.0  # sequences that verified proposals in the step (0 in files before it was kept)
    # what the measuring process did meanwhile (`specfleet profile`, sim/measure.py; None in files before it
    # was kept, and in points not measured): the CPU time of the thread that ran `Engine.step()` and of the
    # whole process, each the same statistic over the steps as `seconds`, and the cores other processes
    # kept busy over the point's timed steps (sim/host_cpu.py): `seconds` well above `cpu_s` is waiting
    cpu_s: float | None = None
    process_cpu_s: float | None = None
    others_cores: float | None = None


@dataclass(frozen=True)
class LoraPoint:
    """One measured decode step with LoRA adapters (`specfleet profile --lora-rank`, sim/lora_measure.py)."""

    adapters: int  # distinct adapters the step's sequences run on (0: every sequence on the base)
    batch: int  # decoding sequences, all on an adapter when `adapters` > 0
    seconds: float  # the median step


@dataclass(frozen=True)
class RooflineInputs:
    """What a roofline profile was derived from (table names and assumed shares), to derive it at another TP."""

    hardware: str  # a key of sim.roofline.HARDWARE
    model: str  # a key of sim.roofline.MODELS
    bandwidth_efficiency: float
    flops_efficiency: float
    step_overhead_s: float


@dataclass(frozen=True)
class AcceptanceClass:
    """Requests that accepted alike on the engine (one class of engine/spec_decode/request_classes.py): a
    simulated request is dealt its class once, each as often as its `requests` (sim/request_draws.py), and
    speculates by the class's figures."""

    requests: float  # the class's weight: finished requests the engine counted in it
    share: float  # drafts per decoding step of its requests
    accepted_per_pos: tuple[float, ...]  # P(position i accepted | a draft) of its requests
    proposal_continue: float = 1.0  # as `Profile.proposal_continue`, from its draft tokens per draft

    def __post_init__(self) -> None:
        if not self.requests > 0:
            raise ValueError(f"acceptance class requests={self.requests!r} must be > 0")
        if not 0.0 <= self.share <= 1.0 or any(not 0.0 <= a <= 1.0 for a in self.accepted_per_pos):
            raise ValueError("acceptance class share and accepted_per_pos must lie in [0, 1]")
        if not 0.0 < self.proposal_continue <= 1.0:
            raise ValueError(f"acceptance class proposal_continue={self.proposal_continue} must be in (0, 1]")


def acceptance_classes(
    classes: Sequence[tuple[float, float, float, float, Sequence[float]]], k: int
) -> tuple[AcceptanceClass, ...]:
    """The simulator's classes from the engine's per-class counters (requests, decoding steps, drafts, draft
    tokens, accepted tokens per position), drafted at most `k` tokens: classes with no request left out."""
    out = []
    for requests, steps, drafts, draft_tokens, per_pos in classes:
        if not requests:
            continue
        out.append(
            AcceptanceClass(
                float(requests),
                min(1.0, drafts / steps) if steps else 0.0,
                tuple(n / drafts for n in per_pos) if drafts else (),
                proposal_continue(draft_tokens / drafts, k) if drafts else 1.0,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Profile:
    name: str
    kind: str  # measured | roofline
    estimate: bool  # True: not measured on the hardware it describes
    knots: tuple[tuple[float, float], ...]  # (decode tokens, seconds) of D, increasing tokens
    prefill_s_per_token: float = 0.0
    context_s_per_token: float = 0.0
    draft_s_per_token: float = 0.0
    verify_s_per_seq: float = 0.0  # per sequence verifying proposals, beyond its tokens' cost in D
    num_kv_blocks: int = 4096
    block_size: int = 16
    accepted_per_pos: tuple[float, ...] = ()  # P(position i accepted | a draft)
    proposal_share: float = 1.0  # share of decoding sequence-steps that get a proposal (n-gram: < 1)
    # P(a proposal holds position i + 1 | it holds position i) below the k asked: an n-gram match can have
    # fewer tokens after it than k (bench sim's copy workload: 3.0 tokens a draft at k = 4); 1: always k
    proposal_continue: float = 1.0
    # share of the engine's shadow lookups (n-gram lookups scored while it verifies no drafts) that find a
    # draft: per lookup, as the engine counts them, not per sequence-step; None: `proposal_share`
    shadow_share: float | None = None
    # P(position i accepted | a shadow draft), as the engine's shadow drafts report it (scored up to the
    # ceiling for k, each to its lookup's length); (): the verified drafts' `accepted_per_pos`
    shadow_accepted_per_pos: tuple[float, ...] = ()
    # speculation per request (engine/spec_decode/request_classes.py): each simulated request draws one class
    # and takes its share, proposal lengths and acceptance in place of the three above; (): every request
    # the same (files before it load so)
    acceptance_classes: tuple[AcceptanceClass, ...] = ()
    request_overhead_s: float = 0.0  # added to every request's TTFT and end (HTTP, proxy, tokenizer)
    # The API server's work on each step's output (`server_s`), in its own process beside the core: it
    # overlaps the core's next step (`period_s`). Per step: the serving loop's work outside `Engine.step()`
    step_overhead_s: float = 0.0
    # per sequence that streams a token in a step: the per-chunk work (detokenise, the SSE chunk, the
    # HTTP write), which grows with the batch where the per-step work does not
    stream_overhead_s: float = 0.0
    startup_s: float = (
        0.0  # a new replica's pod start to ready (process, imports, weights): autoscaling's delay
    )
    hardware: str = ""
    model: str = ""
    notes: str = ""
    points: tuple[StepPoint, ...] = field(default=(), repr=False)
    tp: int = 1  # tensor-parallel ranks of the engine these costs are for (one GPU each)
    roofline: RooflineInputs | None = None  # a roofline profile's inputs (None: measured, or an older file)
    # LoRA (`lora_s`): what a step's adapters add, per token of a sequence on an adapter and per distinct
    # adapter in the step, at rank `lora_rank` (0: not measured, and a step's adapters cost nothing more;
    # files before these fields load so), fitted from `lora_points`
    lora_s_per_token: float = 0.0
    lora_s_per_adapter: float = 0.0
    lora_rank: int = 0
    lora_points: tuple[LoraPoint, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("measured", "roofline"):
            raise ValueError(f"profile kind={self.kind!r} must be measured or roofline")
        if len(self.knots) < 1 or any(b[0] <= a[0] for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError("profile knots must be (tokens, seconds) pairs with increasing tokens")
        if (
            any(s < 0 for _, s in self.knots)
            or min(
                self.prefill_s_per_token,
                self.context_s_per_token,
                self.draft_s_per_token,
                self.verify_s_per_seq,
                self.step_overhead_s,
                self.stream_overhead_s,
                self.request_overhead_s,
                self.lora_s_per_token,
                self.lora_s_per_adapter,
                self.lora_rank,
            )
            < 0
        ):
            raise ValueError("profile costs must be >= 0")
        if self.num_kv_blocks < 1 or self.block_size < 1:
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks} and block_size={self.block_size} must be >= 1"
            )
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"profile tp={self.tp!r} must be an integer >= 1")
        if not self.startup_s >= 0:
            raise ValueError(f"startup_s={self.startup_s} must be >= 0 seconds")
        if (
            any(not 0.0 <= a <= 1.0 for a in (*self.accepted_per_pos, *self.shadow_accepted_per_pos))
            or not 0.0 <= self.proposal_share <= 1.0
            or not 0.0 < self.proposal_continue <= 1.0
            or (self.shadow_share is not None and not 0.0 <= self.shadow_share <= 1.0)
        ):
            raise ValueError(
                "accepted_per_pos, shadow_accepted_per_pos, proposal_share and shadow_share must lie in [0, 1], "
                "proposal_continue in (0, 1]"
            )

    # -- the model ---------------------------------------------------------------------------------
    def decode_s(self, tokens: float) -> float:
        """D(tokens): interpolated between knots, the last segment's slope beyond them, the first knot below."""
        xs, ys = self._curve
        if tokens <= xs[0] or len(xs) == 1:
            return ys[0]
        j = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def core_s(
        self,
        decode_tokens: float,
        prefill_tokens: float = 0.0,
        context_tokens: float = 0.0,
        draft_tokens: float = 0.0,
        verify_seqs: float = 0.0,
    ) -> float:
        """The engine core's seconds for one step (`Engine.step()`: scheduling, the model, sampling): what
        the engine's own step-duration histogram measures."""
        return (
            self.decode_s(decode_tokens)
            + self.prefill_s_per_token * prefill_tokens
            + self.context_s_per_token * context_tokens
            + self.draft_s_per_token * draft_tokens
            + self.verify_s_per_seq * verify_seqs
        )

    def lora_s(self, tokens: float, adapters: int) -> float:
        """The seconds a step's LoRA adapters add to its `core_s`: `tokens` of its sequences on an adapter (a
        decode's one, a verification's k + 1, a prompt chunk's) over `adapters` distinct adapters."""
        if adapters <= 0:
            return 0.0
        return self.lora_s_per_token * tokens + self.lora_s_per_adapter * adapters

    def server_s(self, streams: float) -> float:
        """The API server's seconds for one step's output: `step_overhead_s`, plus `stream_overhead_s` per
        sequence that emits a token in the step (its chunk detokenised, framed as SSE and written)."""
        return self.step_overhead_s + self.stream_overhead_s * streams

    @staticmethod
    def period_s(core_s: float, server_behind_s: float) -> float:
        """A step's seconds in the two-stage pipeline of the engine core and the API server.

        The core runs step N while the server works on step N-1's output, and hands step N's output over
        only when the server has finished N-1's (the core is at most one step ahead of the server). So
        step N, started at `start`, ends at `max(start + core_s(N), server_free)`, where `server_free` is
        when the server finishes step N-1's output; the server then works on step N's output, and its
        tokens reach their clients at `end + server_s(N)`. Back to back, `server_behind_s` is
        `server_s(N-1)`:

            step period = max(core_s(this step), server_s(previous step's streams))

        After an idle gap it is what is left of the server's work (negative: none). With zero serving
        overheads the period is the core's step, exactly. One step deep is the model's choice: the real
        core never blocks on the server (its reports queue), which in a steady state gives the clients the
        same token rate, the longer stage's."""
        return core_s if core_s >= server_behind_s else server_behind_s

    def step_s(
        self,
        decode_tokens: float,
        prefill_tokens: float = 0.0,
        context_tokens: float = 0.0,
        draft_tokens: float = 0.0,
        streams: float = 0.0,
    ) -> float:
        """A step's period when it repeats back to back (the server's work on the previous step is this
        step's): `max(core_s, server_s(streams))`; `streams`: the sequences that emit a token in it."""
        return self.period_s(
            self.core_s(decode_tokens, prefill_tokens, context_tokens, draft_tokens), self.server_s(streams)
        )

    @functools.cached_property
    def _curve(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return tuple(x for x, _ in self.knots), tuple(y for _, y in self.knots)

    # -- files ---------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = asdict(self)
        out["knots"] = [list(k) for k in self.knots]
        out["points"] = [asdict(p) for p in self.points]
        out["lora_points"] = [asdict(p) for p in self.lora_points]
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        data = dict(data)
        try:
            data["knots"] = tuple((float(a), float(b)) for a, b in data["knots"])
            data["points"] = tuple(StepPoint(**p) for p in data.get("points", ()))
            data["lora_points"] = tuple(LoraPoint(**p) for p in data.get("lora_points", ()))
            data["accepted_per_pos"] = tuple(float(a) for a in data.get("accepted_per_pos", ()))
            data["shadow_accepted_per_pos"] = tuple(float(a) for a in data.get("shadow_accepted_per_pos", ()))
            data["acceptance_classes"] = tuple(
                AcceptanceClass(
                    c["requests"], c["share"], tuple(c["accepted_per_pos"]), c["proposal_continue"]
                )
                for c in data.get("acceptance_classes", ())
            )
            if data.get("roofline") is not None:
                data["roofline"] = RooflineInputs(**data["roofline"])
            return cls(**data)
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a specfleet profile: {error}") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None

    def with_(self, **changes) -> Profile:
        return replace(self, **changes)


def proposal_continue(mean_length: float, k: int) -> float:
    """The `proposal_continue` q that gives proposals of at most `k` tokens a mean length of `mean_length`
    (1 + q + ... + q^(k-1), a draft's length truncated geometrically): from an engine's draft tokens per
    draft at that k."""
    if k <= 1 or mean_length >= k:
        return 1.0
    lo, hi = 1e-6, 1.0
    for _ in range(60):  # bisection to well below a counter's resolution
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**i for i in range(k)) < mean_length else (lo, q)
    return (lo + hi) / 2


def fit(
    points: Sequence[StepPoint], knots: Sequence[float] = DEFAULT_KNOTS
) -> tuple[tuple[tuple[float, float], ...], float, float, float, float]:
    """Least squares of relative error over the points: knot values of D (hat basis), the three per-token
    costs and the cost per verifying sequence, all kept >= 0 (a negative cost is dropped and the rest refitted). Knots beyond the largest measured
    decode tokens are left out (no extrapolation from nothing), and so are knots no plain decode step (no
    prompt chunk, no proposal) was measured at, where such steps exist: a knot between them would be set by
    verification steps alone, which also carry the proposals' own cost (bench sim, 2026-12-03: a free knot
    at 8 decode tokens took 182 ms from one k=4 step of 4 sequences, where the plain steps of 4 and 16
    sequences took 70 and 154 ms)."""
    if not points:
        raise ValueError("no measured step to fit a profile to")
    top = max(p.decode_tokens for p in points)
    plain = {
        p.decode_tokens for p in points if p.decode_tokens and not p.prefill_tokens and not p.draft_tokens
    }
    used = [k for k in knots if k <= top and (not plain or k in plain)] or [knots[0]]
    if used[-1] < top:
        used.append(top)
    xs = np.array(used, dtype=float)

    def hat(d: float) -> np.ndarray:
        row = np.zeros(len(xs))
        if d <= xs[0] or len(xs) == 1:
            row[0] = 1.0
            return row
        j = int(np.searchsorted(xs, d)) - 1
        j = min(j, len(xs) - 2)
        w = (d - xs[j]) / (xs[j + 1] - xs[j])
        row[j], row[j + 1] = 1.0 - w, w
        return row

    a = np.array(
        [
            [*hat(p.decode_tokens), p.prefill_tokens, p.context_tokens, p.draft_tokens, p.verify_seqs]
            for p in points
        ]
    )
    t = np.array([p.seconds for p in points])
    a, b = a / t[:, None], np.ones(len(t))
    active = list(range(a.shape[1]))
    # columns with no data (e.g. no draft tokens measured) are fixed at 0
    active = [c for c in active if np.any(a[:, c] != 0)]
    for _ in range(a.shape[1]):
        coef = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        coef[active] = sol
        negative = [c for c in active if coef[c] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda c: coef[c]))
    coef = np.clip(coef, 0.0, None)
    n = len(xs)
    curve = tuple((float(x), float(y)) for x, y in zip(xs, coef[:n]))
    # a knot without data of its own (or dropped) takes its neighbours' line
    ys = [y for _, y in curve]
    for i, y in enumerate(ys):
        if y == 0.0:
            good = [j for j, v in enumerate(ys) if v > 0]
            if good:
                ys[i] = float(np.interp(xs[i], xs[good], [ys[j] for j in good]))
    # the curve never falls with more tokens
    ys = list(np.maximum.accumulate(ys))
    knots_out = tuple(zip(map(float, xs), map(float, ys)))
    return knots_out, float(coef[n]), float(coef[n + 1]), float(coef[n + 2]), float(coef[n + 3])


def fitted_profile(name: str, points: Sequence[StepPoint], **fields) -> Profile:
    knots, prefill, context, draft, verify = fit(points)
    return Profile(
        name=name,
        kind="measured",
        estimate=False,
        knots=knots,
        prefill_s_per_token=prefill,
        context_s_per_token=context,
        draft_s_per_token=draft,
        verify_s_per_seq=verify,
        points=tuple(points),
        **fields,
    )


def fit_error(profile: Profile, points: Sequence[StepPoint] | None = None) -> dict[str, float]:
    """Median and worst relative error of the profile on points (its own by default)."""
    pts = profile.points if points is None else points
    errs = [
        abs(
            profile.core_s(p.decode_tokens, p.prefill_tokens, p.context_tokens, p.draft_tokens, p.verify_seqs)
            - p.seconds
        )
        / p.seconds
        for p in pts
        if p.seconds > 0
    ]
    if not errs:
        return {"median_pct": 0.0, "max_pct": 0.0}
    return {"median_pct": round(100 * float(np.median(errs)), 2), "max_pct": round(100 * float(max(errs)), 2)}
