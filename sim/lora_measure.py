"""`specfleet profile --lora-rank R`: what LoRA adapters add to an engine step, measured on the engine.

At each batch size of the grid, the same decode step is timed three ways on one engine (--enable-lora):
every sequence on the base model, every sequence on one adapter, and the sequences spread round-robin over
`spread` adapters (8 by default: as many as the batch holds). Random adapters of rank R on `q_proj,v_proj`
(PEFT's default targets, as `specfleet bench lora` uses) are written in PEFT's format and loaded as the
server loads them. The steps' extra seconds over the base are fitted as

    lora_s = lora_s_per_token * tokens on an adapter + lora_s_per_adapter * distinct adapters in the step

(the gathered kernel's work grows with the rows it shrinks and expands; each adapter in a step adds its
group's launch and its weights' read), the two costs the simulated engine prices a step that runs adapters
by (`Profile.lora_s`). The simulator prices every adapter at the rank profiled.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .profile import LoraPoint

if TYPE_CHECKING:
    from specfleet.engine.llm_engine import Engine

TARGETS = ["q_proj", "v_proj"]  # PEFT's default target modules, and `specfleet bench lora`'s


def measure_lora(
    model: str,
    rank: int,
    batches: Sequence[int],
    spread: int = 8,
    context: int = 64,
    steps: int = 5,
    kv_gib: float = 0.5,
    progress: bool = True,
) -> list[LoraPoint]:
    """At each batch: the median decode step on the base, on one adapter, and over `spread` adapters (as
    many as the batch has sequences)."""
    from specfleet.bench.lora_adapters import write_adapter
    from specfleet.engine.config import EngineConfig
    from specfleet.engine.llm_engine import Engine

    if rank < 1 or spread < 1 or any(b < 1 for b in batches):
        raise ValueError(
            f"LoRA profile: rank={rank}, spread={spread} and batches={list(batches)} must be >= 1"
        )
    engine = Engine(
        EngineConfig(
            model=model,
            max_num_seqs=max(max(batches), 1),
            max_num_batched_tokens=8192,
            kv_cache_gib=kv_gib,
            enable_prefix_caching=False,
            max_model_len=context + steps + 16,
            enable_lora=True,
            max_loras=spread,
            max_lora_rank=rank,
        )
    )
    assert engine.lora is not None
    root = tempfile.TemporaryDirectory(prefix="specfleet-lora-profile-")
    with root:  # the files stay while the engine serves them
        for i in range(spread):
            folder = write_adapter(Path(root.name) / f"a{i}", engine.lora.shape, rank, TARGETS, seed=i)
            engine.load_lora_adapter(f"a{i}", str(folder))
        return _points(engine, rank, batches, spread, context, steps, progress)


def _points(
    engine: Engine, rank: int, batches: Sequence[int], spread: int, context: int, steps: int, progress: bool
) -> list[LoraPoint]:
    from specfleet.engine.sampling_params import SamplingParams

    ids = itertools.count()
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)

    def timed(batch: int, adapters: int) -> float:
        names = [f"a{i % adapters}" if adapters else None for i in range(batch)]
        for name in names:
            n = next(ids)
            prompt = [(n * 7919 + i * 31) % (vocab - 10) + 5 for i in range(context)]
            engine.add_request(f"l{n}", prompt, params, lora_name=name)
        while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()  # the first decode step: untimed, as the profile's own points
        seconds = [_step_s(engine) for _ in range(steps)]
        while engine.has_unfinished_requests():
            engine.step()
        return statistics.median(seconds)

    timed(2, min(2, spread))  # kernels and both paths built on first use: not timed
    points = []
    for batch in batches:
        for adapters in sorted({0, 1, min(spread, batch)}):
            points.append(LoraPoint(adapters, batch, timed(batch, adapters)))
            if progress:
                print(
                    f"profile: LoRA rank {rank}, batch {batch} over {adapters} adapter(s): "
                    f"{points[-1].seconds * 1000:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return points


def _step_s(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def fit_lora(points: Sequence[LoraPoint]) -> tuple[float, float]:
    """(seconds per token on an adapter, seconds per distinct adapter in a step): least squares of the
    steps' extra seconds over the base step at the same batch, both kept >= 0 (a negative one is dropped and
    the other refitted); (0, 0) without points on adapters."""
    base = {p.batch: p.seconds for p in points if p.adapters == 0}
    rows = [
        (p.batch, p.adapters, p.seconds - base[p.batch]) for p in points if p.adapters and p.batch in base
    ]
    if not rows:
        return 0.0, 0.0
    a = np.array([[b, n] for b, n, _ in rows], dtype=float)
    extra = np.array([e for _, _, e in rows])
    active = [0, 1]
    coef = np.zeros(2)
    for _ in range(2):
        coef = np.zeros(2)
        sol, *_ = np.linalg.lstsq(a[:, active], extra, rcond=None)
        coef[active] = sol
        negative = [c for c in active if coef[c] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda c: coef[c]))
        if not active:
            return 0.0, 0.0
    coef = np.clip(coef, 0.0, None)
    return float(coef[0]), float(coef[1])
