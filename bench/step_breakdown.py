"""Where one decode step's time goes: `python -m specfleet.bench.step_breakdown --batch 1 8 32`.

Runs the in-process engine on the bundled model with `batch` greedy requests decoding together (prompts
prefilled first, not counted), times each part of `Engine.step()` with wrappers around the engine's own
methods, and prints one JSON line per batch size with the median milliseconds of each part over the
measured steps. The parts: schedule, prepare (batch tensors), forward (the layers), logits (lm_head),
sample, update (scheduler bookkeeping), postprocess (stops, outputs), other (the rest of step()).
Used for docs/engine_core.md; py-spy (`pip install specfleet[dev]`) shows the same step as a flame graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from specfleet.engine.config import QUANTIZATIONS

PARTS = ("schedule", "prepare", "forward", "logits", "sample", "update", "postprocess")


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def measure(engine: Any, batch: int, steps: int, warmup: int) -> dict[str, float]:
    from specfleet.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", f"Write a long story about topic number {i}.", params)
    while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    runner, sched = engine.runner, engine.scheduler
    originals = {
        "schedule": (sched, "schedule"),
        "prepare": (runner, "prepare"),
        "forward": (runner.model, "forward"),
        "logits": (runner.model, "logits"),
        "sample": (runner, "_sample"),
        "update": (sched, "update"),
        "postprocess": (engine, "_postprocess"),
    }
    for name, (obj, attr) in originals.items():
        setattr(obj, attr, _timed(totals, name, getattr(obj, attr)))
    rows: list[dict[str, float]] = []
    try:
        for i in range(warmup + steps):
            totals.clear()
            start = time.perf_counter()
            engine.step()
            total = time.perf_counter() - start
            if i >= warmup:
                row = {name: totals[name] * 1000 for name in PARTS}
                row["other"] = total * 1000 - sum(row.values())
                row["total"] = total * 1000
                rows.append(row)
    finally:
        for obj, attr in originals.values():
            delattr(obj, attr)  # back to the class's method
    for i in range(batch):
        engine.abort(f"b{batch}-{i}")
    return {name: round(statistics.median(r[name] for r in rows), 3) for name in (*PARTS, "other", "total")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specfleet.bench.step_breakdown", description=__doc__.split("\n")[0]
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=40, help="measured decode steps per batch size")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--model", default="bundled://smollm2-135m-instruct")
    p.add_argument(
        "--quantization", default=None, choices=[q for q in QUANTIZATIONS if q], help="as `specfleet serve`'s"
    )
    args = p.parse_args(argv)
    from specfleet.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=args.model,
            quantization=args.quantization,
            max_model_len=1024,
            kv_cache_gib=0.5,
            max_num_seqs=max(args.batch),
        )
    )
    for batch in args.batch:
        print(json.dumps({"batch": batch, "ms": measure(engine, batch, args.steps, args.warmup)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
