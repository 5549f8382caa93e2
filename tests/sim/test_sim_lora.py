"""LoRA in the simulator (sim/lora.py): with one adapter slot, a request for a second adapter waits until
the first adapter's requests drain (the real scheduler's --max-loras rule), and the step that first runs an
adapter not in host memory is longer by its load time, once per adapter while it stays resident."""

from __future__ import annotations

import random

import pytest
from specfleet.operator import load_inference_service
from specfleet.sim.engine import Record, SimEngine
from specfleet.sim.fleet import start_limits
from specfleet.sim.lora import SimAdapters
from specfleet.sim.profile import Profile
from specfleet.sim.workload import SimRequest

PROFILE = Profile("p", "measured", False, ((1, 0.01), (64, 0.1)), prefill_s_per_token=1e-4)
SPEC = load_inference_service(
    {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "lora"},
        "spec": {"model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 512}},
    }
).spec
LOAD_S = 0.15  # the budget for a rank-16 load on the bundled model is 0.2 s


def _run(adapters: SimAdapters | None, names: list[str | None]) -> tuple[list[Record], list[float]]:
    """Requests (one per name, all at t=0, 8 output tokens) through one engine; their records and the
    duration of each step."""
    from specfleet.engine.knobs import LiveConfig

    engine = SimEngine(
        0,
        PROFILE,
        LiveConfig(**SPEC.start_values()),
        start_limits(SPEC),
        block_size=16,
        prefix_caching=False,
        rng=random.Random(0),
        adapters=adapters,
    )
    records = [Record(i, 0.0, 0, 32, 8) for i in range(len(names))]
    for record, name in zip(records, names, strict=True):
        engine.add(SimRequest(0.0, 32, 8, adapter=name), record, 0.0)
    now, steps = 0.0, []
    while (plan := engine.start_step(now)) is not None:
        steps += plan.durations
        now = plan.end
        engine.finish_step()
    return records, steps


def test_one_slot_serves_the_adapters_in_turn_and_pays_each_load_once() -> None:
    slots = SimAdapters(max_loras=1, load_s=LOAD_S, max_cpu_loras=2)
    records, steps = _run(slots, ["a", "a", "b", None])
    a_done = max(r.finish_s or 0.0 for r in records[:2])
    assert records[2].first_scheduled_s is not None and records[2].first_scheduled_s >= a_done
    assert records[3].first_scheduled_s == 0.0  # the base needs no slot
    assert slots.loads == 2 and sorted(slots.resident) == ["a", "b"]
    _, base_steps = _run(None, [None, None, None, None])
    assert sum(steps) - sum(base_steps) >= 2 * LOAD_S  # two loads, and b's requests ran after a's


def test_a_host_cache_of_one_reloads_an_evicted_adapter() -> None:
    cache = SimAdapters(max_loras=1, load_s=LOAD_S)
    assert cache.step_load_s(["a", None]) == LOAD_S
    assert cache.step_load_s(["a"]) == 0.0
    assert cache.step_load_s(["b"]) == LOAD_S  # evicts a (max_cpu_loras defaults to max_loras)
    assert cache.step_load_s(["a"]) == LOAD_S
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be >= max_loras=2"):
        SimAdapters(max_loras=2, load_s=0.1, max_cpu_loras=1)


def test_a_fleet_with_fewer_adapter_slots_than_adapters_waits_for_them() -> None:
    """spec.adapters and lora.maxLoras through SimFleet: requests over 8 adapters wait longer for their
    first token with 1 slot than with 8, and every engine pays its own loads."""
    from helpers import cpu_like_profile
    from specfleet.sim.fleet import SimFleet
    from specfleet.sim.workload import Lengths, Synthetic

    workload = Synthetic(
        rates=((0.0, 4.0),),
        duration_s=20.0,
        prompt=Lengths("fixed", 64, 64),
        output=Lengths("fixed", 16, 16),
        adapters=8,
        seed=1,
    )
    requests = list(workload.requests())
    assert {r.adapter for r in requests} == {f"adapter-{i}" for i in range(8)}

    def ttft_p50(slots: int) -> float:
        doc = {
            "apiVersion": "serving.specfleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "lora"},
            "spec": {
                "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 512},
                "adapters": [{"name": f"adapter-{i}", "source": f"file:///a/{i}"} for i in range(8)],
                "lora": {"maxLoras": slots},
            },
        }
        run = SimFleet(load_inference_service(doc), cpu_like_profile(num_kv_blocks=256)).run(requests)
        waits = sorted((r.first_token_s or 0.0) - r.arrival_s for r in run.records)
        return waits[len(waits) // 2]

    assert ttft_p50(1) > 1.5 * ttft_p50(8)
