"""An experiment: does pre-screening the tuner's changes with the simulator help?

`ScreenedPolicy` is the tuner's `Policy` with one step added: before a change goes out (a `change`
decision: the search's pick, a move towards the TPOT target, a probe or a load-shift rule; never a
revert), one engine is simulated for `window_s` at the load the observation shows (its finished-request
rate per engine, mean prompt and output lengths, acceptance) under the config in force and under the
change; a change the simulator predicts to lose goodput beyond the policy's dead band, or to miss a p95
target (TTFT or TPOT) the config in force meets, is vetoed: the policy's state goes back to before the
decision and the move is tabooed at this load, as a reverted one. A veto, not a picker: at a light load
goodput is the arrival rate under either config, and the change passes.

`python -m specfleet.sim.prescreen` runs the comparison on a simulated fleet (the shifting load of
`bench sim`'s shift-1e-tuner) with the screen's profile equal to the world's, and off by a factor.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass, replace
from typing import Any

from specfleet.operator import load_inference_service
from specfleet.tuner.policy import Policy
from specfleet.tuner.types import Decision, Observation, TunedConfig

from .fleet import SimFleet
from .profile import Profile
from .report import summarize
from .workload import Lengths, Synthetic


@dataclass(frozen=True)
class Screened:
    goodput: float  # tokens/s of requests meeting the SLO
    meets: bool  # TTFT p95 and TPOT p95 within the SLO


@dataclass
class Screen:
    """One engine simulated at an observation's load, under a config."""

    isvc_doc: dict[str, Any]
    profile: Profile
    window_s: float = 60.0  # simulated seconds of arrivals per screen (12 tuner intervals of 5 s)
    seed: int = 0
    runs: int = 0
    cpu_s: float = 0.0

    def __call__(self, config: TunedConfig, obs: Observation) -> Screened:
        rate = (obs.request_rate or 0.0) / obs.engines
        if rate <= 0:
            return Screened(0.0, True)
        output = max(1, round((obs.generation_rate or 0.0) / (obs.request_rate or 1.0)))
        prompt = max(1, round((obs.prompt_rate or 0.0) / (obs.request_rate or 1.0)))
        requests = list(
            Synthetic(
                rates=((0.0, rate),),
                duration_s=self.window_s,
                prompt=Lengths("fixed", prompt, prompt),
                output=Lengths("fixed", output, output),
                seed=self.seed,
            ).requests()
        )
        if not requests:
            return Screened(0.0, True)
        doc = copy.deepcopy(self.isvc_doc)
        spec = doc["spec"]
        spec["replicas"] = 1
        spec.pop("autotune", None)
        spec["batching"] = {
            "maxNumSeqs": config.max_num_seqs,
            "maxNumBatchedTokens": config.max_num_batched_tokens,
        }
        spec["speculative"] = {**spec["speculative"], "numSpeculativeTokens": config.num_speculative_tokens}
        isvc = load_inference_service(doc)
        profile = self.profile
        if obs.accepted_per_pos:
            profile = profile.with_(
                accepted_per_pos=obs.accepted_per_pos, proposal_share=obs.proposal_share or 1.0
            )
        slo = {"ttft": isvc.spec.slo.ttft_p95_ms / 1000.0, "tpot": isvc.spec.slo.tpot_p95_ms / 1000.0}
        start = time.process_time()
        run = SimFleet(isvc, profile, tune=False, fast=True).run(requests)
        self.cpu_s += time.process_time() - start
        self.runs += 1
        s = summarize(run, profile, slo)
        meets = (s["p95_ttft_ms"] or 0.0) <= slo["ttft"] * 1000 and (s["p95_tpot_ms"] or 0.0) <= slo[
            "tpot"
        ] * 1000
        return Screened(float(s["goodput_tokens"]), meets)


class ScreenedPolicy(Policy):
    """`Policy` whose `change` decisions pass the simulator first (see the module's docstring)."""

    def __init__(self, params: Any, initial: TunedConfig | None, screen: Screen) -> None:
        super().__init__(params, initial)
        self.screen = screen
        self.vetoed = 0
        self.passed = 0

    def decide(self, obs: Observation | None, now: float | None = None) -> Decision:
        # what a change moves: the config in force, the probation, the cooldown's clock, the level's count
        saved = (self.current, self.before_change, self.probation, self.last_change, copy.copy(self.level))
        saved_guard = self.guard
        decision = super().decide(obs, now)
        previous = saved[0]
        if decision.kind != "change" or decision.config is None or previous is None or obs is None:
            return decision
        here, there = self.screen(previous, obs), self.screen(decision.config, obs)
        loses = there.goodput < here.goodput * (1.0 - self.params.dead_band)
        if not loses and (there.meets or not here.meets):
            self.passed += 1
            return decision
        self.vetoed += 1
        self.current, self.before_change, self.probation = saved[0], saved[1], saved[2]
        self.last_change, self.level, self.guard = saved[3], saved[4], saved_guard
        self.taboo.forbid(previous, decision.config, obs.demand, decision.time + self.params.taboo_s)
        return Decision(
            decision.time,
            None,
            f"{decision.reason}; vetoed by the simulator: {decision.config.short()} {there.goodput:.1f} tok/s"
            f"{'' if there.meets else ' (misses the SLO)'} against {here.goodput:.1f} for {previous.short()}",
            "hold",
        )


def shift_isvc(interval_s: float = 5.0) -> dict[str, Any]:
    """bench sim's shift-1e-tuner: one engine of the bundled model, n-gram speculation for the tuner to
    turn on or off, its bounds."""
    return {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "prescreen"},
        "spec": {
            "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 1024},
            "batching": {"maxNumSeqs": 32, "maxNumBatchedTokens": 512},
            "speculative": {"method": "ngram", "numSpeculativeTokens": 0},
            "replicas": 1,
            "resources": {"gpus": 0},
            "slo": {"ttftP95Ms": 3000, "tpotP95Ms": 300},
            "autotune": {
                "enabled": True,
                "intervalSeconds": round(interval_s),
                "bounds": {
                    "numSpeculativeTokens": [0, 4],
                    "maxNumSeqs": [4, 32],
                    "maxNumBatchedTokens": [256, 512],
                },
            },
        },
    }


def run_one(
    world: Profile, screen_profile: Profile | None, seconds: float, seed: int, peak: float
) -> dict[str, Any]:
    doc = shift_isvc()
    requests = list(
        Synthetic(
            rates=((0.0, 0.5), (seconds / 3, peak), (2 * seconds / 3, 0.5)),
            duration_s=seconds,
            prompt=Lengths("uniform", 16, 96),
            output=Lengths("uniform", 16, 64),
            seed=seed,
        ).requests()
    )
    isvc = load_inference_service(doc)
    fleet = SimFleet(isvc, world, fast=True, seed=seed)
    assert fleet.tuner is not None
    screened: ScreenedPolicy | None = None
    if screen_profile is not None:
        old = fleet.tuner.policy
        screened = ScreenedPolicy(old.params, old.current, Screen(doc, screen_profile, seed=seed))
        fleet.tuner.policy = screened
    start = time.process_time()
    run = fleet.run(requests)
    cpu = time.process_time() - start
    slo = {"ttft": 3.0, "tpot": 0.3}
    s = summarize(run, world, slo)
    kinds = [t.decision.kind for t in run.ticks]
    return {
        "goodput_tok_s": round(s["goodput_tokens"], 2),
        "slo_attainment": round(s["slo_attainment"], 4),
        "ttft_p95_ms": round(s["p95_ttft_ms"], 1),
        "tpot_p95_ms": round(s["p95_tpot_ms"], 1),
        "changes": kinds.count("change"),
        "reverts": kinds.count("revert"),
        "vetoed": screened.vetoed if screened else 0,
        "screen_runs": screened.screen.runs if screened else 0,
        "screen_cpu_s": round(screened.screen.cpu_s, 2) if screened else 0.0,
        "cpu_s": round(cpu, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specfleet.sim.prescreen", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600.0, help="the shifting load's length (3 phases)")
    p.add_argument("--peak", type=float, default=4.0, help="requests/s of the middle phase")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument(
        "--acceptance", default="0.8,0.7,0.6,0.5", help="the world's P(position i accepted) for n-gram"
    )
    p.add_argument(
        "--off",
        type=float,
        default=1.3,
        help="the mis-calibrated screen: the world's steps are this much slower",
    )
    args = p.parse_args(argv)
    from .cli import load_profile

    base = load_profile(None).with_(accepted_per_pos=tuple(float(a) for a in args.acceptance.split(",")))
    world = base
    slow = replace(base, knots=tuple((d, s * args.off) for d, s in base.knots)).with_(
        prefill_s_per_token=base.prefill_s_per_token * args.off
    )
    arms: dict[str, tuple[Profile, Profile | None]] = {
        "tuner": (world, None),
        "tuner+screen (same profile)": (world, world),
        f"tuner+screen (world {args.off:g}x slower)": (slow, world),
        f"tuner (world {args.off:g}x slower)": (slow, None),
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for seed in args.seeds:
        for name, (w, screen) in arms.items():
            r = run_one(w, screen, args.seconds, seed, args.peak)
            results[name].append(r)
            print(json.dumps({"arm": name, "seed": seed, **r}), flush=True)
    print(json.dumps({"seeds": args.seeds, "results": results}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
