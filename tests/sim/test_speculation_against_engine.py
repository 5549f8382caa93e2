"""The simulator's speculation against the real engine's, on one short run of the bundled model.

The real engine runs n-gram speculation (k = 4) on prompts it can copy from; the simulator runs the same
requests with the acceptance and proposal share the engine reported. Both are priced by one profile (each
real step by what it held: decode, prompt and draft tokens, context, sequences verifying), so the
comparison is of what speculation does to the steps (who gets a proposal and how long, the k-room rule,
what is accepted, how many steps each request takes), not of this machine's timing noise, which bench sim
measures: a change to the engine's speculation rules that the simulator does not follow moves the real
TPOT and not the simulated one (issue 41: a simulated speculative TPOT 47-83% off the real one).

Measured 2026-12-03: the simulated p50 15-18% above the engine's while every simulated request drew its
steps' acceptance from one distribution, where the engine's requests that copy their pattern accept nearly
every draft and find one nearly every step (TPOT 62-67 ms priced) and the others find and accept few
(96-152 ms). Now each simulated request draws its class of acceptance once from the engine's own
per-request counts (engine/spec_decode/request_classes.py, sim/profile.py `AcceptanceClass`): 2026-12-06,
8.7% with these 8 seeds (1.5-8.7% over other sets of 8, 16 and 32 seeds; 17.7% with one distribution).
"""

from __future__ import annotations

import statistics

import pytest
from specfleet.operator import load_inference_service
from specfleet.sim.fleet import SimFleet
from specfleet.sim.profile import AcceptanceClass, Profile, acceptance_classes, proposal_continue
from specfleet.sim.workload import Lengths, SimRequest, Synthetic

pytestmark = pytest.mark.slow

# The bundled model on the project's 2-core CPU, as bench sim measured it (2026-12-03, quiet host): 46 ms
# for one decode token, about 7 ms for each more (a verified proposal as much as a sequence's own token),
# 5 ms per prompt token; 10 ms per sequence that verifies (assumed: its multi-row sampling and attention).
PROFILE = Profile(
    "smollm2-cpu",
    "measured",
    False,
    ((1, 0.046), (64, 0.487)),
    prefill_s_per_token=0.005,
    context_s_per_token=1e-5,
    verify_s_per_seq=0.010,
    num_kv_blocks=364,
    block_size=16,
)
TOLERANCE = 0.15  # the issue's bound on TPOT p50 drift
# Simulated runs (seeds of the class and acceptance draws) whose median p50 is compared: one run of nine
# requests moved its p50 by 81-124 ms over these 8 seeds, against the engine's 96 ms
SEEDS = 8


ISVC = load_inference_service(
    {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "spec"},
        "spec": {
            "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 2048},
            "engine": {"prefixCaching": False},
            "batching": {"maxNumSeqs": 16, "maxNumBatchedTokens": 512},
            "speculative": {"method": "ngram", "numSpeculativeTokens": 4},
            "resources": {"gpus": 0},
        },
    }
)


def _copy_prompt(index: int, length: int, vocab: int) -> list[int]:
    """A 12-token pattern repeated, unique per request: n-gram lookups find it, the model often copies it."""
    pattern = [(index * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(12)]
    return (pattern * (length // 12 + 1))[:length]


def _real_run(
    requests: list[SimRequest],
) -> tuple[list[float], tuple[float, ...], float, float, tuple[AcceptanceClass, ...]]:
    """The real engine's TPOT per request in profile-priced seconds, its acceptance per position, the
    share of decoding sequence-steps that verified a proposal, its draft tokens per draft and its requests'
    classes of acceptance (engine/spec_decode/request_classes.py)."""
    from specfleet.engine.config import EngineConfig
    from specfleet.engine.llm_engine import Engine
    from specfleet.engine.sampling_params import SamplingParams

    engine = Engine(
        EngineConfig(
            model="bundled://smollm2-135m-instruct",
            max_num_seqs=16,
            max_num_batched_tokens=512,
            speculative_method="ngram",
            num_speculative_tokens=4,
            kv_cache_gib=0.25,
            max_model_len=2048,
        )
    )
    vocab = engine.runner.vocab_size
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), _copy_prompt(i, r.prompt_tokens, vocab), params)
    now, decoding_steps = 0.0, 0
    first: dict[str, float] = {}
    tpots: list[float] = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        context = sum(s.num_computed_tokens for s in running)
        decoding_steps += sum(not s.in_prefill for s in running)
        outputs = engine.step()
        st = engine.stats.last_step
        now += PROFILE.core_s(
            st.num_scheduled_tokens - st.prompt_tokens,
            st.prompt_tokens,
            context,
            st.num_draft_tokens,
            st.num_drafts,
        )
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                tpots.append((now - first[out.request_id]) / (n - 1))
    stats = engine.stats
    acceptance = tuple(a / stats.num_drafts for a in stats.accepted_per_pos)
    share = stats.num_drafts / decoding_steps
    classes = acceptance_classes(
        [
            (c.requests, c.decode_steps, c.drafts, c.draft_tokens, c.accepted_per_pos)
            for c in stats.request_classes
        ],
        4,
    )
    return tpots, acceptance, share, stats.num_draft_tokens / stats.num_drafts, classes


@pytest.fixture(scope="module")
def drift() -> tuple[float, str]:
    """The simulated TPOT p50 (median over `SEEDS` runs) against the engine's, relative, and a description."""
    requests = [
        SimRequest(0.0, r.prompt_tokens, r.output_tokens)
        for r in Synthetic(
            rates=((0.0, 1.0),),
            duration_s=8,
            prompt=Lengths("uniform", 32, 96),
            output=Lengths("uniform", 24, 48),
            seed=5,
        ).requests()
    ]
    assert len(requests) >= 6
    real, acceptance, share, length, classes = _real_run(requests)
    assert acceptance and 0 < share <= 1, (acceptance, share)  # the engine did speculate
    # every finished request counted in one class
    assert sum(c.requests for c in classes) == len(requests), classes
    profile = PROFILE.with_(
        accepted_per_pos=acceptance,
        proposal_share=share,
        proposal_continue=proposal_continue(length, 4),
        acceptance_classes=classes,
    )
    p50s = []
    for seed in range(SEEDS):
        run = SimFleet(ISVC, profile, seed=seed).run(requests)
        p50s.append(
            statistics.median((r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in run.records)
        )
    real_p50, sim_p50 = statistics.median(real), statistics.median(p50s)
    return abs(sim_p50 - real_p50) / real_p50, (
        f"simulated TPOT p50 {sim_p50 * 1000:.1f} ms against the engine's {real_p50 * 1000:.1f} ms "
        f"(profile-priced); acceptance {acceptance}, proposal share {share:.2f}, {length:.2f} tokens a draft; "
        f"{len(classes)} classes of requests {[(c.requests, round(c.share, 2)) for c in classes]}; "
        f"simulated p50s {[round(p * 1000, 1) for p in p50s]}"
    )


def test_simulated_speculative_tpot_p50_within_the_issues_bound(drift):
    gap, seen = drift
    assert gap <= TOLERANCE, f"{gap:.0%} apart: {seen}"
