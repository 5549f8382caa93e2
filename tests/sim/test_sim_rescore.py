"""bench/sim_rescore.py: a saved bench sim record simulated again without a real fleet. The "real" figures
here are a simulation's own (a stand-in for the engines: it models nothing of them but what the record
holds), so a faithful rebuild of the record's profile and acceptance reproduces them exactly."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace

from helpers import cpu_like_profile
from specfleet.bench.sim import _simulate, configs, isvc_doc, rescaled, sim_mix, step_mix_record
from specfleet.bench.sim_rescore import main, rescore_config, saved_profile
from specfleet.operator import load_inference_service

BASE = cpu_like_profile(num_kv_blocks=364)
RECORD = {
    "config": "copy-1e-spec",
    "profile": {
        "knots_ms": [[1.0, 21.5], [4.0, 21.5], [16.0, 43.77], [32.0, 86.12]],
        "prefill_ms_per_token": 2.231,
        "context_us_per_token": 12.77,
        "draft_ms_per_token": 0.37,
        "verify_ms_per_seq": 0.0,
    },
    "request_overhead_ms": 3.3,
    "step_overhead_ms": 0.0,
    "stream_overhead_ms": 0.0,
    "startup_s": 5.0,
    "acceptance": [0.663, 0.519, 0.446, 0.389],
    "proposal_share": 0.364,
    "draft_tokens_per_draft": 3.14,
    "shadow_share": None,
    "shadow_acceptance": [],
    "acceptance_classes": [
        {"requests": 15, "share": 0.3, "acceptance": [0.3, 0.2, 0.1, 0.1], "proposal_continue": 0.85},
        {"requests": 14, "share": 0.8, "acceptance": [0.95, 0.8, 0.75, 0.7], "proposal_continue": 0.9},
    ],
    "profile_scale_decode": 1.0,
    "profile_scale_prefill": 1.0,
}


def _simulated(profile, acceptance):
    c = next(x for x in configs(20.0) if x.name == RECORD["config"])
    args = Namespace(interval=5.0, window=10.0)
    isvc = load_inference_service(isvc_doc(c, 5.0))
    return asyncio.run(_simulate(c, isvc, profile, args, list(c.workload.requests()), acceptance))


def test_a_record_simulates_again_to_its_own_figures(tmp_path, capsys):
    profile, acceptance = saved_profile(BASE, RECORD)
    assert acceptance == () and len(profile.acceptance_classes) == 2 and profile.request_overhead_s == 0.0033
    assert profile.decode_s(16) == 0.04377 and profile.context_s_per_token == 12.77e-6
    real, _, _ = _simulated(profile, acceptance)
    record = {**RECORD, "real": real}
    out = asyncio.run(rescore_config(BASE, record))
    assert out["factors"] == {"decode": 1.0, "prefill": 1.0, "from": "saved"}
    assert set(out["uncalibrated"].values()) == {0.0} and out["tpot_p50_error_pct"] == 0.0
    # a file of them, as bench sim writes it
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"profile": BASE.to_json(), "configs": [record]}))
    assert main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["throughput_error_pct"] == 0.0


def test_saved_step_mixes_calibrate_again():
    """With the step mixes saved, the factors come from them: "real" engines whose decode ran at 0.8x."""
    profile, acceptance = saved_profile(BASE, RECORD)
    _, _, same = _simulated(profile, acceptance)
    real, _, slower = _simulated(rescaled(profile, 0.8, 1.0), acceptance)
    record = {**RECORD, "real": real, "step_mix": step_mix_record(sim_mix(slower), sim_mix(same))}
    out = asyncio.run(rescore_config(BASE, record))
    assert out["factors"]["from"] == "step_mix" and 0.75 <= out["factors"]["decode"] <= 0.85
    assert out["tpot_p50_error_pct"] < out["uncalibrated"]["tpot_p50_error_pct"]
