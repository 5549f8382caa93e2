"""Goodput per LoRA adapter, and adapter slots as a hard bound on the batch-limit search.

The engine server's request metrics (engine/server/metrics.py, hooked to engine/server/lora_metrics.py as
the server does with --enable-lora) record each finished request on an adapter in that adapter's series;
the tuner's snapshot parser reads them back into each adapter's output-token rate and TTFT/TPOT CDFs over
the window, and `status.tuning.reason` names each adapter's goodput against the service's SLO beside its
draft acceptance. With more adapters in demand than --max-loras slots, the policy never raises
max_num_seqs past the requests the slots let into a batch, and says so in its reason."""

from __future__ import annotations

from dataclasses import replace

from specfleet.tuner.loop import Tick
from specfleet.tuner.policy import Policy, PolicyParams
from specfleet.tuner.policy.load import adapter_cap
from specfleet.tuner.policy.model import adapter_goodput
from specfleet.tuner.report import tuning_status
from specfleet.tuner.snapshot import observe_pairs, parse_metrics
from specfleet.tuner.types import SLO, Decision, Observation, TuneBounds, TunedConfig

from .lora_pod import Pod
from .plant import GPU_LIKE, Plant

SLO_ = SLO(ttft_p95_s=0.5, tpot_p95_s=0.05)


def test_goodput_per_adapter_from_the_engines_request_series() -> None:
    one, two = Pod(), Pod()
    one.serve(["sql", "chat"])
    two.serve(["sql"])
    before = [parse_metrics(one.scrape(), 0.0), parse_metrics(two.scrape(), 0.0)]
    one.finish("sql", ttft=0.08, tpot=0.02, tokens=50, times=2)  # well within both targets
    two.finish("sql", ttft=0.08, tpot=0.02, tokens=50, times=2)
    one.finish("chat", ttft=0.08, tpot=0.02, tokens=40)  # one within the SLO
    one.finish("chat", ttft=0.08, tpot=0.2, tokens=40, times=3)  # three past the TPOT target
    one.finish(None, ttft=3.0, tpot=0.2, tokens=100)  # the base model's: in no adapter's series
    text = one.scrape()
    assert 'specfleet_lora_generation_tokens_total{lora_name="chat",model_name="base"} 160.0' in text
    after = [parse_metrics(text, 10.0), parse_metrics(two.scrape(), 10.0)]
    obs = observe_pairs(list(zip(before, after)), 10.0)

    assert [(a.name, a.generation_rate) for a in obs.lora_requests] == [("chat", 16.0), ("sql", 20.0)]
    goodput = {g.name: (round(g.goodput, 3), round(g.attainment, 3)) for g in adapter_goodput(obs, SLO_)}
    assert goodput == {"sql": (20.0, 1.0), "chat": (4.0, 0.25)}  # chat: 1 of 4 within -> 16 * 1/4 tok/s

    decision = Decision(time=10.0, config=None, reason="holding k=2", kind="hold")
    reason = tuning_status(Tick(decision, obs, None, slo=SLO_), None, None, "t")["reason"]
    assert (
        reason
        == "holding k=2; goodput by LoRA adapter (SLO attainment): chat 4.0 tok/s (25%), sql 20.0 tok/s (100%)"
    )
    assert (
        tuning_status(Tick(decision, obs, None), None, None, "t")["reason"] == "holding k=2"
    )  # no SLO known

    # chat unloaded: its series go at the next scrape, and the next window reports sql alone
    one.finish("sql", ttft=0.08, tpot=0.02, tokens=50)
    one.serve(["sql"])
    text = one.scrape()
    assert 'lora_name="chat"' not in text
    later = observe_pairs([(after[0], parse_metrics(text, 20.0))], 20.0)
    assert [(a.name, a.generation_rate) for a in later.lora_requests] == [("sql", 5.0)]


class SlotBound(Plant):
    """The plant with `slots` adapter slots and `adapters` adapters in demand, evenly loaded: only the slots'
    share of the demand runs (the engine's scheduler passes the others over), the rest waits, and the
    engines' vllm:lora_requests_info says so."""

    slots: float = 2.0
    adapters: float = 4.0

    def observe(
        self, t: float, config: TunedConfig | None, running_config: TunedConfig | None = None
    ) -> Observation:
        share = self.slots / self.adapters
        full = self.demand
        self.demand = full * share
        try:
            obs = super().observe(t, config, running_config)
        finally:
            self.demand = full
        slotless = full * (1 - share)
        return replace(
            obs,
            waiting=(obs.waiting or 0.0) + slotless,
            in_system_now=(obs.in_system_now or 0.0) + slotless,
            lora_slots=self.slots,
            lora_adapters=self.adapters,
        )


PARAMS = PolicyParams(
    slo=SLO(ttft_p95_s=60.0, tpot_p95_s=5.0),  # every config meets it: goodput is throughput
    bounds=TuneBounds(k=(0, 0), max_num_seqs=(4, 64), max_num_batched_tokens=(256, 4096)),
    window_s=10.0,
    interval_s=10.0,
)


def _run(plant: Plant, steps: int) -> tuple[list[int], list[Decision]]:
    """Closed loop from max_num_seqs=16: the max_num_seqs in force after each interval, and the decisions."""
    policy, config = Policy(PARAMS), TunedConfig(0, 16, 1024)
    seqs, decisions = [], []
    for i in range(steps):
        decision = policy.decide(plant.observe(i * 10.0, config))
        decisions.append(decision)
        config = decision.config or config
        seqs.append(config.max_num_seqs)
    return seqs, decisions


def test_the_cap_is_what_the_slots_let_run_and_never_lowers_the_value_in_force() -> None:
    obs = Observation(
        time=0.0, config=None, pods=2, running=48.0, waiting=48.0, lora_slots=2, lora_adapters=8
    )
    assert adapter_cap(obs, 8) == 12  # 96 requests over 2 engines, a quarter of them in slots: 12 each
    assert adapter_cap(obs, 16) == 16  # the cap holds max_num_seqs where it is, it does not cut it
    assert adapter_cap(replace(obs, lora_adapters=2), 16) is None  # every adapter in demand has a slot
    assert adapter_cap(replace(obs, lora_slots=None, lora_adapters=None), 16) is None  # no LoRA gauge


def test_adapter_slots_cap_max_num_seqs_and_the_reason_says_so() -> None:
    # a step cost where a longer batch pays (GPU-like): without slots the search's best is max_num_seqs=32
    free, bound = Plant(demand=48, steps=GPU_LIKE), SlotBound(demand=48, steps=GPU_LIKE)
    free_seqs, free_decisions = _run(free, 6)
    bound_seqs, decisions = _run(bound, 6)
    assert "best alternative k=0 seqs=32 " in free_decisions[0].reason, free_decisions[0].reason
    # with 2 of 4 adapters in slots, 24 requests per engine can run: the search goes no further
    assert "best alternative k=0 seqs=24 " in decisions[0].reason, decisions[0].reason
    assert max(bound_seqs) <= 24, bound_seqs
    clause = (
        "; adapter slots bind: 4.0 adapters in demand per engine for 2 slots (--max-loras), 50% of the "
        "requests can run, so max_num_seqs is searched up to 24 only"
    )
    assert all(d.reason.endswith(clause) for d in decisions), [d.reason for d in decisions]
    assert not any("adapter slots" in d.reason for d in free_decisions)
