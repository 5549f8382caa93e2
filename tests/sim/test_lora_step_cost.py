"""The LoRA step cost in the simulator: a profile's per-token and per-adapter cost (`Profile.lora_s`, fitted
by `specfleet profile --lora-rank` from steps timed on the engine with and without adapters) lengthens each
simulated step that runs adapters by exactly that, in the scheduler's steps and in fast mode's decode runs
alike; profiles written before the fields load with no LoRA cost; and the measurement itself on the
bundled model (slow)."""

from __future__ import annotations

import json
import random

import pytest
from specfleet.operator import load_inference_service
from specfleet.sim.engine import Record, SimEngine
from specfleet.sim.fleet import start_limits
from specfleet.sim.lora import SimAdapters, adapter_work
from specfleet.sim.lora_measure import fit_lora
from specfleet.sim.profile import LoraPoint, Profile

PER_TOKEN, PER_ADAPTER = 0.002, 0.005  # seconds: a cost the base steps below (10-100 ms) cannot hide
BASE = Profile("p", "measured", False, ((1, 0.01), (64, 0.1)), prefill_s_per_token=1e-4)
LORA = BASE.with_(lora_s_per_token=PER_TOKEN, lora_s_per_adapter=PER_ADAPTER, lora_rank=16)
SPEC = load_inference_service(
    {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "lora"},
        "spec": {"model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 512}},
    }
).spec


def test_the_price_of_a_steps_adapters() -> None:
    assert LORA.lora_s(tokens=12, adapters=0) == 0.0  # the base model's step
    assert LORA.lora_s(tokens=12, adapters=3) == pytest.approx(12 * PER_TOKEN + 3 * PER_ADAPTER)
    assert BASE.lora_s(tokens=12, adapters=3) == 0.0  # not profiled: no cost
    # a prompt chunk of 30 on a, two decodes on b, one on a, one on the base
    assert adapter_work([("a", 30), ("b", 1), ("b", 1), ("a", 1), (None, 1)]) == (33, 2)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        BASE.with_(lora_s_per_token=-1e-3)


def _steps(profile: Profile, names: list[str | None], fast: bool) -> list[float]:
    """Each step's duration with one engine serving a request per name (all at t=0, 16 prompt tokens, 8
    output tokens; 4 adapter slots, every adapter resident: no load time)."""
    from specfleet.engine.knobs import LiveConfig

    adapters = SimAdapters(max_loras=4, load_s=0.0)
    engine = SimEngine(
        0,
        profile,
        LiveConfig(**SPEC.start_values()),
        start_limits(SPEC),
        block_size=16,
        prefix_caching=False,
        rng=random.Random(0),
        fast=fast,
        adapters=adapters,
    )
    for i, name in enumerate(names):
        from specfleet.sim.workload import SimRequest

        engine.add(SimRequest(0.0, 16, 8, adapter=name), Record(i, 0.0, 0, 16, 8), 0.0)
    now, steps = 0.0, []
    while (plan := engine.start_step(now)) is not None:
        steps += plan.durations
        now = plan.end
        engine.finish_step()
    return steps


@pytest.mark.parametrize("fast", [False, True])
def test_each_step_that_runs_adapters_is_longer_by_their_price(fast: bool) -> None:
    names = ["a", "b", "a", None]  # three sequences on two adapters, one on the base
    base = _steps(LORA, [None] * 4, fast)
    assert _steps(BASE, names, fast) == pytest.approx(base)  # no LoRA cost profiled: the base's steps
    priced = _steps(LORA, names, fast)
    assert len(priced) == len(base) == 8  # the prefill step (its first token), then 7 decode steps
    # the first step prefills 3 x 16 prompt tokens on adapters; each decode step runs 3 of their tokens
    assert priced[0] - base[0] == pytest.approx(48 * PER_TOKEN + 2 * PER_ADAPTER)
    for got, plain in zip(priced[1:], base[1:], strict=True):
        assert got - plain == pytest.approx(3 * PER_TOKEN + 2 * PER_ADAPTER)


def test_the_fit_recovers_the_two_costs_and_old_profiles_load(tmp_path) -> None:
    points = [LoraPoint(0, b, 0.01 + 0.001 * b) for b in (1, 4, 8, 16)]
    points += [
        LoraPoint(n, b, 0.01 + 0.001 * b + LORA.lora_s(b, n)) for b in (1, 4, 8, 16) for n in {1, min(8, b)}
    ]
    per_token, per_adapter = fit_lora(points)
    assert (per_token, per_adapter) == (pytest.approx(PER_TOKEN), pytest.approx(PER_ADAPTER))
    assert fit_lora([p for p in points if p.adapters == 0]) == (0.0, 0.0)
    # a cost that does not grow with adapters: the per-adapter one is 0, not negative
    flat = [LoraPoint(0, 8, 0.02), LoraPoint(1, 8, 0.03), LoraPoint(8, 8, 0.029)]
    assert fit_lora(flat)[1] == 0.0 and fit_lora(flat)[0] > 0

    profile = LORA.with_(lora_points=tuple(points))
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    old = json.loads((tmp_path / "p.json").read_text())
    for name in ("lora_s_per_token", "lora_s_per_adapter", "lora_rank", "lora_points"):
        del old[name]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Profile.load(tmp_path / "old.json")
    assert (loaded.lora_rank, loaded.lora_points, loaded.lora_s(10, 2)) == (0, (), 0.0)


@pytest.mark.slow
def test_specfleet_profile_measures_the_lora_step_on_the_bundled_model(tmp_path) -> None:
    """`specfleet profile --lora-rank 16` on a tiny grid: the base step and the steps over 1 and 2 adapters
    at each batch, stored in the profile with the fitted costs."""
    from specfleet.sim.measure import main

    out = tmp_path / "lora.json"
    args = ["--out", str(out), "--batches", "1", "2", "--contexts", "16", "--prefills", "16", "--steps", "2"]
    assert main([*args, "--lora-rank", "16", "--lora-adapters", "2", "--kv-cache-gib", "0.05"]) == 0
    profile = Profile.load(out)
    assert profile.lora_rank == 16
    assert sorted((p.batch, p.adapters) for p in profile.lora_points) == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    assert all(p.seconds > 0 for p in profile.lora_points)
    assert profile.lora_s_per_token >= 0 and profile.lora_s_per_adapter >= 0
    assert main([*args, "--lora-rank", "-1"]) == 2  # refused before anything is measured
