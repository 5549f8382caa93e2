"""`specfleet profile`: measure the engine's own step time over a grid, on this machine, into a profile.

For each point of the grid (decoding sequences B, context C, k) the engine is brought to B sequences
decoding at about C tokens of context, then `Engine.step()` is timed over several steps; prefill points
time one prompt chunk of each size. The per-step composition (decode, prompt, draft tokens; KV context)
is read from the engine's scheduler and `StepStats`, and `profile.fit` turns the points into a profile.

Beside each point's wall time the point keeps the CPU time of the thread that stepped the engine and of
the whole process, and the cores other processes kept busy meanwhile (`StepPoint.cpu_s`, `process_cpu_s`,
`others_cores`; sim/host_cpu.py), so a profile says whether its steps were slow or waited.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specfleet.engine.config import SPECULATIVE_METHODS

from .host_cpu import Span
from .profile import Profile, StepPoint, fit_error, fitted_profile

if TYPE_CHECKING:
    from specfleet.engine.llm_engine import Engine


@dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (64, 512)
    ks: tuple[int, ...] = (0,)
    prefills: tuple[int, ...] = (32, 128, 512)
    steps: int = 5  # timed decode steps per point; the median is kept
    # the decode points of one context from one set of requests (`_staircase_points`): the largest batch
    # prefilled once, then cut down batch by batch, where each point otherwise prefills a batch of its own
    staircase: bool = False
    # with `staircase`: at each batch (k = 0) also the step that prefills a prompt of this many tokens beside
    # the batch's decodes, as a request arriving at a busy engine is prefilled (0: none)
    mixed_prefill: int = 0


def _engine(
    model: str,
    method: str,
    max_k: int,
    kv_gib: float,
    draft_model: str | None,
    draft_quantization: str | None,
    max_model_len: int,
    quantization: str | None = None,
):
    from specfleet.engine.config import EngineConfig
    from specfleet.engine.llm_engine import Engine

    return Engine(
        EngineConfig(
            model=model,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            speculative_method=method,
            num_speculative_tokens=0,
            max_num_speculative_tokens=max(max_k, 1) if method != "none" else 8,
            kv_cache_gib=kv_gib,
            draft_model=draft_model,
            draft_quantization=draft_quantization,
            quantization=quantization,
            enable_prefix_caching=False,
            max_model_len=max_model_len,
        )
    )


def _timed(engine) -> StepPoint:
    running = engine.scheduler.running
    context = sum(s.num_computed_tokens for s in running)
    cpu, process_cpu = time.thread_time(), time.process_time()
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    cpu, process_cpu = time.thread_time() - cpu, time.process_time() - process_cpu
    st = engine.stats.last_step
    return StepPoint(
        st.num_scheduled_tokens - st.prompt_tokens,
        st.prompt_tokens,
        context,
        st.num_draft_tokens,
        seconds,
        st.num_drafts,
        cpu_s=cpu,
        process_cpu_s=process_cpu,
    )


def _with_cpu(point: StepPoint, timed: list[StepPoint], span: Span) -> StepPoint:
    """The point with its CPU fields from its timed steps (their median, as its `seconds`) and the cores
    other processes kept busy over the span that timed them."""
    return replace(
        point,
        cpu_s=statistics.median(p.cpu_s or 0.0 for p in timed),
        process_cpu_s=statistics.median(p.process_cpu_s or 0.0 for p in timed),
        others_cores=span.others_cores(),
    )


def measure(
    model: str = "bundled://smollm2-135m-instruct",
    grid: Grid = Grid(),
    method: str = "none",
    kv_gib: float = 1.0,
    draft_model: str | None = None,
    draft_quantization: str | None = None,
    progress: bool = True,
    max_model_len: int = 1024,
    quantization: str | None = None,
) -> tuple[list[StepPoint], int]:
    """The measured points, and the engine's KV blocks (what a simulated engine gets)."""
    profiler = Profiler(
        model, method, max(grid.ks), kv_gib, draft_model, draft_quantization, max_model_len, quantization
    )
    return profiler.points(grid, progress), profiler.num_kv_blocks


class Profiler:
    """An engine kept for measuring, so that the same grid can be measured again minutes later without
    loading the model again: `bench sim` measures before every configuration's real run, since on a shared
    host the machine's speed moves between a profile and the runs it prices (2026-12-06: a profile at the
    start priced steps 1.2-1.5x slower than the engines ran minutes later)."""

    def __init__(
        self,
        model: str,
        method: str,
        max_k: int,
        kv_gib: float,
        draft_model: str | None = None,
        draft_quantization: str | None = None,
        max_model_len: int = 1024,
        quantization: str | None = None,
    ) -> None:
        from specfleet.engine.sampling_params import SamplingParams

        self.engine = _engine(
            model, method, max_k, kv_gib, draft_model, draft_quantization, max_model_len, quantization
        )
        warm = SamplingParams(max_tokens=4, ignore_eos=True)
        self.engine.add_request("warm-up", [100, 101, 102, 103], warm)  # kernels build on first use: untimed
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self._ids = itertools.count(1)  # request ids, and the salt of each request's prompt

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.kv.num_blocks

    def points(self, grid: Grid, progress: bool = True) -> list[StepPoint]:
        """The grid's decode points (one set of requests per context with `grid.staircase`), then its
        prefill points."""
        decode = _staircase_points if grid.staircase else _decode_points
        return decode(self.engine, grid, self._ids, progress) + _prefill_points(
            self.engine, grid, self._ids, progress
        )


def _prompt(vocab: int, length: int, salt: int) -> list[int]:
    # a repeating pattern, so that an n-gram proposer finds matches as it does on copied text
    return [(salt * 7919 + (i % 23) * 31) % (vocab - 10) + 5 for i in range(length)]


def _decode_points(engine: Engine, grid: Grid, ids: Iterator[int], progress: bool) -> list[StepPoint]:
    """One point per (k, context, batch) of the grid: the median decode step of that many requests."""
    from specfleet.engine.sampling_params import SamplingParams

    vocab = engine.runner.vocab_size
    points: list[StepPoint] = []
    for k in grid.ks:
        engine.update_config(num_speculative_tokens=k)
        for context in grid.contexts:
            for batch in grid.batches:
                # nobody may finish inside the timed steps, however many proposals are accepted
                params = SamplingParams(
                    max_tokens=(grid.steps + 2) * (k + 1) + 8, temperature=0.0, ignore_eos=True
                )
                for _ in range(batch):
                    n = next(ids)
                    engine.add_request(f"p{n}", _prompt(vocab, context, n), params)
                while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
                    engine.step()
                engine.step()  # the first decode step after prefill: proposals start here
                span = Span.start()
                timed = [p for p in (_timed(engine) for _ in range(grid.steps)) if p.decode_tokens > 0]
                mid = statistics.median(p.seconds for p in timed)
                point = StepPoint(
                    statistics.mean(p.decode_tokens for p in timed),
                    0.0,
                    statistics.mean(p.context_tokens for p in timed),
                    statistics.mean(p.draft_tokens for p in timed),
                    mid,
                    statistics.mean(p.verify_seqs for p in timed),
                )
                points.append(_with_cpu(point, timed, span))
                while engine.has_unfinished_requests():
                    engine.step()
                if progress:
                    print(
                        f"profile: k={k} context={context} batch={batch}: {mid * 1000:.1f} ms "
                        f"({points[-1].decode_tokens:.0f} decode tokens, "
                        f"{points[-1].verify_seqs:.1f} sequences verifying)",
                        file=sys.stderr,
                        flush=True,
                    )
        engine.update_config(num_speculative_tokens=0)
    return points


def _timed_point(engine: Engine, steps: int) -> StepPoint:
    """The median of `steps` timed decode steps, each figure of the step's mix their mean."""
    span = Span.start()
    timed = [p for p in (_timed(engine) for _ in range(steps)) if p.decode_tokens > 0]
    point = StepPoint(
        statistics.mean(p.decode_tokens for p in timed),
        0.0,
        statistics.mean(p.context_tokens for p in timed),
        statistics.mean(p.draft_tokens for p in timed),
        statistics.median(p.seconds for p in timed),
        statistics.mean(p.verify_seqs for p in timed),
    )
    return _with_cpu(point, timed, span)


def _staircase_points(engine: Engine, grid: Grid, ids: Iterator[int], progress: bool) -> list[StepPoint]:
    """One point per (context, batch, k) of the grid, from one set of requests per context: the largest
    batch prefilled once, timed at each k, then cut down to the next batch by aborting requests. The
    per-point grid prefills every batch of its own (26 points in 80 s on the 2-core host, most of it
    prompts); here the prompts are the largest batch's once per context. A point's context is the
    requests' as timed (the prompt plus what they generated on the batches before), recorded as measured."""
    from specfleet.engine.sampling_params import SamplingParams

    vocab = engine.runner.vocab_size
    batches = sorted(grid.batches, reverse=True)
    # nobody may finish inside the staircase, however many proposals are accepted
    budget = len(batches) * len(grid.ks) * (grid.steps + 1) * (max(grid.ks) + 1) + 8
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    points: list[StepPoint] = []
    for context in grid.contexts:
        names = []
        for _ in range(batches[0]):
            n = next(ids)
            names.append(f"p{n}")
            engine.add_request(names[-1], _prompt(vocab, context, n), params)
        while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for batch in batches:
            while len(names) > batch:
                engine.abort(names.pop())
            if grid.mixed_prefill:
                points.append(_mixed_point(engine, grid, ids, vocab))
            for k in grid.ks:
                engine.update_config(num_speculative_tokens=k)
                engine.step()  # the first step at this k: its proposals start here
                points.append(_timed_point(engine, grid.steps))
                if progress:
                    print(
                        f"profile: k={k} context={context} batch={batch}: {points[-1].seconds * 1000:.1f} ms "
                        f"({points[-1].decode_tokens:.0f} decode tokens, {points[-1].context_tokens:.0f} "
                        f"context, {points[-1].verify_seqs:.1f} sequences verifying)",
                        file=sys.stderr,
                        flush=True,
                    )
        for name in names:
            engine.abort(name)
        engine.update_config(num_speculative_tokens=0)
    return points


def _mixed_point(engine: Engine, grid: Grid, ids: Iterator[int], vocab: int) -> StepPoint:
    """The median of `grid.steps` steps that each prefill a new `grid.mixed_prefill`-token prompt beside the
    running batch's decodes (at k = 0); each new request is aborted after its step."""
    from specfleet.engine.sampling_params import SamplingParams

    engine.update_config(num_speculative_tokens=0)
    timed = []
    span = Span.start()
    for _ in range(grid.steps):
        n = next(ids)
        engine.add_request(
            f"m{n}", _prompt(vocab, grid.mixed_prefill, n), SamplingParams(max_tokens=4, temperature=0.0)
        )
        timed.append(_timed(engine))
        engine.abort(f"m{n}")
    point = StepPoint(
        statistics.mean(p.decode_tokens for p in timed),
        statistics.mean(p.prefill_tokens for p in timed),
        statistics.mean(p.context_tokens for p in timed),
        0.0,
        statistics.median(p.seconds for p in timed),
    )
    return _with_cpu(point, timed, span)


def _prefill_points(engine: Engine, grid: Grid, ids: Iterator[int], progress: bool) -> list[StepPoint]:
    """One point per prefill length of the grid: the median step that prefills one such prompt."""
    from specfleet.engine.sampling_params import SamplingParams

    vocab = engine.runner.vocab_size
    points: list[StepPoint] = []
    for length in grid.prefills:
        timed = []
        span = Span.start()
        for _ in range(max(1, grid.steps // 2)):
            n = next(ids)
            engine.add_request(
                f"p{n}", _prompt(vocab, length, n), SamplingParams(max_tokens=1, temperature=0.0)
            )
            timed.append(_timed(engine))
            while engine.has_unfinished_requests():
                engine.step()
        p = min(timed, key=lambda x: x.seconds)
        point = StepPoint(
            p.decode_tokens,
            p.prefill_tokens,
            p.context_tokens,
            0.0,
            statistics.median(x.seconds for x in timed),
        )
        points.append(_with_cpu(point, timed, span))
        if progress:
            print(
                f"profile: prefill {length}: {points[-1].seconds * 1000:.1f} ms", file=sys.stderr, flush=True
            )
    return points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet profile",
        description="Measure the engine's step time over a grid "
        "of (decode tokens, prefill tokens, context, k) on this machine into a profile "
        "file; or write a roofline ESTIMATE for hardware not at hand (--roofline).",
    )
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--model", default="bundled://smollm2-135m-instruct")
    p.add_argument("--method", default="none", choices=SPECULATIVE_METHODS, help="speculative method")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--draft-quantization", default=None, choices=["int8"])
    p.add_argument(
        "--quantization", default=None, choices=["int8", "gguf"], help="the profiled engine's weights"
    )
    p.add_argument("--batches", type=int, nargs="+", default=list(Grid.batches))
    p.add_argument("--contexts", type=int, nargs="+", default=list(Grid.contexts))
    p.add_argument(
        "--ks", type=int, nargs="+", default=None, help="k values (default 0, or 0 2 4 with a method)"
    )
    p.add_argument("--prefills", type=int, nargs="+", default=list(Grid.prefills))
    p.add_argument("--steps", type=int, default=Grid.steps)
    p.add_argument(
        "--kv-cache-gib", type=float, default=0.5, help="KV cache of the profiled (and simulated) engine"
    )
    p.add_argument(
        "--roofline",
        metavar="HARDWARE",
        default=None,
        help="write a roofline estimate instead: h100-sxm, h200, a100-80g or l4",
    )
    p.add_argument(
        "--roofline-model", default="llama3-8b", help="with --roofline: llama3-8b, llama3-70b, ..."
    )
    p.add_argument("--tp", type=int, default=1, help="with --roofline: tensor parallel degree")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also measure what LoRA adapters of this rank add to a step (sim/lora_measure.py; 0: not)",
    )
    p.add_argument(
        "--lora-adapters", type=int, default=8, help="with --lora-rank: the most adapters one step mixes"
    )
    p.add_argument(
        "--lora-batches", type=int, nargs="+", default=None, help="with --lora-rank (default: --batches)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.roofline:
        from .roofline import roofline_profile

        try:
            profile = roofline_profile(args.roofline, args.roofline_model, tp=args.tp)
        except ValueError as error:
            print(f"specfleet profile: {error}", file=sys.stderr)
            return 2
        profile.save(args.out)
        print(f"wrote {args.out}: {profile.notes}")
        print(json.dumps({"profile": profile.name, "estimate": True, "kv_blocks": profile.num_kv_blocks}))
        return 0
    ks = tuple(args.ks) if args.ks else ((0, 2, 4) if args.method != "none" else (0,))
    if any(v < 1 for v in (*args.batches, *args.contexts, *args.prefills)) or any(k < 0 for k in ks):
        print(
            "specfleet profile: --batches, --contexts and --prefills must be >= 1, --ks >= 0", file=sys.stderr
        )
        return 2
    if args.lora_rank < 0 or args.lora_adapters < 1 or any(b < 1 for b in args.lora_batches or ()):
        print(
            "specfleet profile: --lora-rank must be >= 0, --lora-adapters and --lora-batches >= 1",
            file=sys.stderr,
        )
        return 2
    grid = Grid(tuple(args.batches), tuple(args.contexts), ks, tuple(args.prefills), args.steps)
    points, blocks = measure(
        args.model,
        grid,
        args.method,
        args.kv_cache_gib,
        args.draft_model,
        args.draft_quantization,
        quantization=args.quantization,
    )
    import platform

    profile = fitted_profile(
        f"measured-{platform.node()}",
        points,
        num_kv_blocks=blocks,
        block_size=16,
        hardware=f"{platform.machine()} {platform.node()}",
        model=args.model,
        notes=f"measured with method={args.method} quantization={args.quantization} on this machine",
    )
    if args.lora_rank:
        profile = with_lora(profile, args)
    profile.save(args.out)
    print(f"wrote {args.out}: {len(points)} points, fit error {fit_error(profile)}")
    print(json.dumps({"profile": profile.name, "points": len(points), **fit_error(profile)}))
    return 0


def with_lora(profile: Profile, args: argparse.Namespace) -> Profile:
    """The profile with the LoRA step cost measured at --lora-rank (sim/lora_measure.py)."""
    from .lora_measure import fit_lora, measure_lora

    rank = args.lora_rank
    batches = args.lora_batches or args.batches
    points = measure_lora(
        args.model, rank, batches, args.lora_adapters, steps=args.steps, kv_gib=args.kv_cache_gib
    )
    per_token, per_adapter = fit_lora(points)
    print(
        f"profile: LoRA rank {rank}: {per_token * 1e3:.3f} ms per token on an adapter, "
        f"{per_adapter * 1e3:.3f} ms per adapter in a step",
        file=sys.stderr,
    )
    return profile.with_(
        lora_s_per_token=per_token, lora_s_per_adapter=per_adapter, lora_rank=rank, lora_points=tuple(points)
    )


if __name__ == "__main__":
    raise SystemExit(main())
