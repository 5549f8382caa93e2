"""Draft acceptance per LoRA adapter: the server's counters (engine/server/lora_metrics.py, fed the engine
core's `lora_state` as at a /metrics scrape) rendered to Prometheus text, read back by the tuner's snapshot
parser into a per-adapter acceptance over the window, and named in `status.tuning.reason`. An unloaded
adapter's series disappear; a second pod's counts add to the first's."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from specfleet.engine.server.lora_metrics import LoraMetrics
from specfleet.tuner.loop import Tick
from specfleet.tuner.report import MAX_ADAPTERS_SHOWN, tuning_status
from specfleet.tuner.snapshot import observe_pairs, parse_metrics
from specfleet.tuner.types import Decision, Observation


def _state(drafts: dict[str, list[int]]) -> dict[str, Any]:
    """The engine core's lora_state with these per-adapter [draft tokens, accepted] totals."""
    names = {name: f"/adapters/{name}" for name in drafts}
    return {
        "adapters": names,
        "running": [],
        "waiting": [],
        "loads": 0,
        "evictions": 0,
        "load_s": [],
        "drafts": drafts,
    }


class Pod:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = LoraMetrics(self.registry, "base", max_loras=2)

    def scrape(self, drafts: dict[str, list[int]]) -> str:
        self.metrics.update(_state(drafts))
        return generate_latest(self.registry).decode()


def test_acceptance_per_adapter_from_the_metrics_text() -> None:
    one, two = Pod(), Pod()
    before = [
        parse_metrics(one.scrape({"sql": [40, 30], "chat": [10, 2]}), 0.0),
        parse_metrics(two.scrape({}), 0.0),
    ]
    text = one.scrape({"sql": [140, 110], "chat": [110, 22]})
    assert 'specfleet_lora_spec_decode_draft_tokens_total{lora_name="sql",model_name="base"} 140.0' in text
    assert 'specfleet_lora_spec_decode_accepted_tokens_total{lora_name="chat",model_name="base"} 22.0' in text
    after = [parse_metrics(text, 10.0), parse_metrics(two.scrape({"sql": [100, 20]}), 10.0)]
    obs = observe_pairs(list(zip(before, after)), 10.0)
    # over the window: sql (100 + 100) drafted, (80 + 20) accepted on the two pods; chat 100 drafted, 20 accepted
    assert obs.lora_acceptance == (("chat", 0.2), ("sql", 0.5))

    # unloading chat removes its series: the next window reports sql alone
    text = one.scrape({"sql": [240, 190]})
    assert 'lora_name="chat"' not in text
    later = observe_pairs([(after[0], parse_metrics(text, 20.0))], 20.0)
    assert later.lora_acceptance == (("sql", 0.8),)


def test_the_status_reason_names_each_adapters_acceptance() -> None:
    decision = Decision(time=0.0, config=None, reason="holding k=2", kind="hold")
    many = tuple((f"a{i:02d}", i / 20) for i in range(MAX_ADAPTERS_SHOWN + 3))
    status = tuning_status(
        Tick(decision, Observation(time=0.0, config=None, lora_acceptance=many), None), None, None, "t"
    )
    assert status["reason"].startswith("holding k=2; draft acceptance by LoRA adapter: a00 0.00, a01 0.05")
    assert status["reason"].endswith("a07 0.35 (+3 more)")
    plain = tuning_status(Tick(decision, Observation(time=0.0, config=None), None), None, None, "t")
    assert plain["reason"] == "holding k=2"  # no adapters, no clause
