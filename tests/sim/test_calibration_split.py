"""bench sim's calibration of decode-only and prefill-bearing steps apart (issue 41): the engines export the
steps that computed no prompt token apart on /metrics, the simulated engines the same, and the calibration
sets the decode costs' factor from those steps and the prompt token's from the others, where one factor
over every step traded TTFT for TPOT when the profile priced decode slower than the engines ran it and
prefill right."""

from __future__ import annotations

import json

import pytest
from helpers import cpu_like_profile
from specfleet.bench.sim import StepMix, calibration, rescaled, sim_mix, step_mix_record
from specfleet.engine.server.metrics import ServerMetrics
from specfleet.engine.stats import EngineStats, StepStats
from specfleet.operator import load_inference_service
from specfleet.sim.fleet import SimFleet
from specfleet.sim.workload import Lengths, Synthetic
from specfleet.tuner.snapshot import parse_metrics

PROFILE = cpu_like_profile(num_kv_blocks=256).with_(step_overhead_s=0.01, stream_overhead_s=0.002)


def test_the_engine_exports_the_steps_that_computed_no_prompt_token_apart():
    metrics = ServerMetrics("m")
    stats = EngineStats()
    steps = (
        StepStats(duration_s=0.200, batch_size=3, prompt_tokens=64),  # a prompt chunk beside two decodes
        StepStats(duration_s=0.030, batch_size=3, num_draft_tokens=4, num_drafts=1),
        StepStats(duration_s=0.050, batch_size=4),
    )
    for step in steps:
        stats.last_step = step
        metrics.observe_step(stats, stepped=True)
    metrics.observe_step(stats, stepped=False)  # going idle observes no step
    snap = parse_metrics(metrics.render().decode(), 0.0)
    assert snap.counts["step_duration_seconds"] == 3
    assert snap.counts["decode_step_duration_seconds"] == 2
    assert snap.sums["decode_step_duration_seconds"] == pytest.approx(0.080)
    assert snap.counters["decode_step_sequences"] == 7
    assert (snap.counters["decode_step_draft_tokens"], snap.counters["decode_step_drafts"]) == (4, 1)
    mix = StepMix()
    mix.add(snap.counters, snap.sums, snap.counts)
    assert (mix.decode().steps, mix.prefill().steps, mix.prefill().seconds) == (2, 1, pytest.approx(0.2))


def _fleet(profile):
    spec = {
        "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 2048},
        "batching": {"maxNumSeqs": 16, "maxNumBatchedTokens": 512},
        "speculative": {"method": "none", "numSpeculativeTokens": 0},
        "replicas": 1,
        "resources": {"gpus": 0},
    }
    doc = {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "c"},
        "spec": spec,
    }
    fleet = SimFleet(load_inference_service(doc), profile)
    workload = Synthetic(
        rates=((0.0, 4.0),),
        duration_s=20,
        prompt=Lengths("uniform", 16, 96),
        output=Lengths("uniform", 16, 64),
        seed=5,
    )
    fleet.run(list(workload.requests()))
    return fleet


def test_decode_and_prefill_are_calibrated_each_from_their_own_steps():
    """The "real" engines here are simulated ones on a machine whose decode costs run at 0.75x the profile
    and whose prompt tokens cost what the profile says (a stand-in for the engines' /metrics: it models
    nothing of a real engine but the split the calibration reads). The split recovers both; the one factor
    over every step lies between them, which priced prompts 10-25 % short."""
    same = _fleet(PROFILE)
    real = _fleet(rescaled(PROFILE, 0.75, 1.0))
    mix = sim_mix(same)
    assert 0 < mix.decode().steps < mix.steps and mix.prefill().prompt_tokens == mix.prompt_tokens
    (decode, prefill), record = calibration(sim_mix(real), mix, PROFILE)
    assert decode == pytest.approx(0.75, rel=0.08)
    assert prefill == pytest.approx(1.0, rel=0.12)
    assert decode < record["profile_scale"] < prefill
    assert (record["profile_scale_decode"], record["profile_scale_prefill"]) == (
        round(decode, 3),
        round(prefill, 3),
    )


def test_without_decode_steps_apart_one_factor_prices_every_step():
    """An engine from before the split exports no decode steps: both factors are the one over every step."""
    mix = sim_mix(_fleet(PROFILE))
    old = StepMix(
        mix.steps, mix.seconds * 0.8, mix.sequences, mix.prompt_tokens, mix.draft_tokens, mix.drafts
    )
    (decode, prefill), record = calibration(old, mix, PROFILE)
    assert (
        decode == prefill == pytest.approx(record["profile_scale"], abs=1e-3) == pytest.approx(0.8, rel=0.01)
    )


def test_the_step_mixes_are_kept_whole_and_calibrate_again_as_they_did():
    """bench sim's JSON keeps both worlds' step mixes (issue 41: the saved runs held only the factors, so
    copy-1e-spec's real decode steps could not be split into plain and verifying ones afterwards)."""
    real, sim = sim_mix(_fleet(rescaled(PROFILE, 0.75, 1.0))), sim_mix(_fleet(PROFILE))
    record = json.loads(json.dumps(step_mix_record(real, sim)))
    back = StepMix(**record["real"]), StepMix(**record["sim"])
    assert back == (real, sim) and back[0].decode_draft_tokens == real.decode_draft_tokens
    assert calibration(*back, PROFILE)[0] == calibration(real, sim, PROFILE)[0]
