"""bench sim's simulation side re-run on a saved run, without a real fleet:
`python -m specfleet.bench.sim_rescore OUT/sim.json...` prints one JSON line per configuration.

Each configuration is simulated again from what its record in `sim.json` holds. That is the fitted profile as
the record rounds it (knots to 0.01 ms, prefill, context and draft costs), the serving overheads, the
acceptance and its classes, and the same trace (`configs`). The result is compared with the saved real
figures. The calibration is computed again from the saved step mixes (`step_mix`) where the record has them.
Otherwise it re-uses the saved decode and prefill factors. This is for a change to the simulator or to
calibration's form, scored on runs already taken (issue 41). The profile's rounding alone can deal a
speculative configuration other draws than the run did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from specfleet.bench.sim import (
    StepMix,
    _errors,
    _simulate,
    calibration,
    configs,
    isvc_doc,
    rescaled,
    sim_mix,
)
from specfleet.operator import load_inference_service
from specfleet.sim.profile import AcceptanceClass, Profile, proposal_continue

SECONDS = 20.0  # the trace of `--quick`, the runs these records come from (its requests: the record's count)


def saved_profile(base: Profile, record: dict[str, Any]) -> tuple[Profile, tuple[float, ...]]:
    """The profile a configuration was simulated with, from its record, and the acceptance given to its
    fleet (empty where its classes stay with the profile), as `run_config` built them."""
    fitted = record["profile"]
    p = base.with_(
        knots=tuple((tokens, ms / 1000) for tokens, ms in fitted["knots_ms"]),
        prefill_s_per_token=fitted["prefill_ms_per_token"] / 1000,
        context_s_per_token=fitted["context_us_per_token"] / 1e6,
        draft_s_per_token=fitted["draft_ms_per_token"] / 1000,
        verify_s_per_seq=fitted["verify_ms_per_seq"] / 1000,
        request_overhead_s=record["request_overhead_ms"] / 1000,
        step_overhead_s=record["step_overhead_ms"] / 1000,
        stream_overhead_s=record["stream_overhead_ms"] / 1000,
        startup_s=record["startup_s"],
        points=(),
    )
    accepted = tuple(record["acceptance"])
    if accepted:
        p = p.with_(
            proposal_share=record["proposal_share"],
            proposal_continue=proposal_continue(record["draft_tokens_per_draft"], len(accepted)),
            shadow_share=record["shadow_share"],
            shadow_accepted_per_pos=tuple(record["shadow_acceptance"]),
        )
    classes = tuple(
        AcceptanceClass(float(c["requests"]), c["share"], tuple(c["acceptance"]), c["proposal_continue"])
        for c in record["acceptance_classes"]
    )
    if classes:
        return p.with_(acceptance_classes=classes, accepted_per_pos=accepted), ()
    return p, accepted


async def rescore_config(base: Profile, record: dict[str, Any]) -> dict[str, Any]:
    """One configuration's errors re-run, calibrated and not, with the factors used and where they came from."""
    c = next(x for x in configs(SECONDS) if x.name == record["config"])
    args = argparse.Namespace(interval=5.0, window=10.0)  # bench sim's defaults
    isvc = load_inference_service(isvc_doc(c, args.interval))
    requests = list(c.workload.requests())
    profile, acceptance = saved_profile(base, record)
    raw, _, raw_fleet = await _simulate(c, isvc, profile, args, requests, acceptance)
    if "step_mix" in record:
        real = StepMix(**record["step_mix"]["real"])
        (decode, prefill), _ = calibration(real, sim_mix(raw_fleet), profile)
        source = "step_mix"
    else:
        decode, prefill, source = record["profile_scale_decode"], record["profile_scale_prefill"], "saved"
    sim, run, _ = await _simulate(c, isvc, rescaled(profile, decode, prefill), args, requests, acceptance)
    out: dict[str, Any] = {
        "config": c.name,
        **_errors(sim, record["real"]),
        "uncalibrated": _errors(raw, record["real"]),
        "factors": {"decode": round(decode, 3), "prefill": round(prefill, 3), "from": source},
    }
    if c.tune:
        out["tuner_sim"] = [d["config"] for d in run.decisions if d["config"]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specfleet.bench.sim_rescore", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", help="bench sim's sim.json files")
    for path in parser.parse_args(argv).runs:
        saved = json.loads(Path(path).read_text())
        base = Profile.from_json(saved["profile"])
        for record in saved["configs"]:
            print(json.dumps({"run": path, **asyncio.run(rescore_config(base, record))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
