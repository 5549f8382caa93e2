"""max_loras as a capacity input: the engines' vllm:lora_requests_info gauge is read into the observation, and
with more adapters in demand than adapter slots the goodput model admits only the slots' share of the demand
into a batch, so the batch-limit search does not raise max_num_seqs for requests that wait on a slot."""

from __future__ import annotations

from specfleet.tuner.policy.candidates import best, candidates, score
from specfleet.tuner.policy.model import LoadModel, StepCost
from specfleet.tuner.policy.params import StepLimits
from specfleet.tuner.snapshot import observe_pairs, parse_metrics
from specfleet.tuner.types import SLO, Observation, TuneBounds, TunedConfig


def _page(running: str, waiting: str) -> str:
    return (
        "# TYPE vllm:lora_requests_info gauge\n"
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} 1.7e9\n'
    )


def test_the_lora_gauge_is_read_per_engine() -> None:
    pods = [_page("a,b", "c,d"), _page("a", "")]  # 4 adapters in demand on one engine, 1 on the other
    pairs = [(parse_metrics(p, 0.0), parse_metrics(p, 10.0)) for p in pods]
    obs = observe_pairs(pairs, 10.0)
    assert (obs.lora_slots, obs.lora_adapters) == (2.0, 2.5)
    assert obs.lora_runnable_share == 0.8
    assert observe_pairs([(parse_metrics("", 0.0), parse_metrics("", 1.0))], 1.0).lora_runnable_share == 1.0


def test_slots_bound_the_batch_and_the_search_keeps_max_num_seqs() -> None:
    cost = StepCost(0.018, 0.003)
    current = TunedConfig(0, 16, 512)
    bounds = TuneBounds(k=(0, 0), max_num_seqs=(1, 64), max_num_batched_tokens=(64, 4096))
    obs = Observation(time=0.0, config=current, pods=1, running=16.0, waiting=16.0, generation_rate=100.0)
    slo = SLO(ttft_p95_s=2.0, tpot_p95_s=1.0)

    def pick(share: float) -> int:
        model = LoadModel(32.0, (), 0.0, 0.0, cost, runnable_share=share)
        options = [
            score(c, current, obs, slo, model) for c in candidates(current, obs, slo, bounds, StepLimits())
        ]
        chosen = best(options, current, limit_s=1.0, change_penalty=0.02)
        assert chosen is not None
        return chosen.config.max_num_seqs

    bound = LoadModel(32.0, (), 0.0, 0.0, cost, runnable_share=0.5)
    assert bound.predict(TunedConfig(0, 32, 512)).batch == bound.predict(current).batch == 16.0
    assert pick(1.0) > 16  # every waiting request could run: more slots, more goodput
    assert pick(0.5) == 16  # half wait for an adapter slot: more sequences would not run
