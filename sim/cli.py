"""`specfleet simulate --isvc FILE.yaml --workload W [--profile P] --out DIR`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specfleet.operator.inference_service import InvalidInferenceService, load_inference_service
from specfleet.router.policies import POLICIES

from .acceptance import classes_from_metrics
from .fleet import SimFleet
from .profile import Profile
from .report import summarize, write
from .roofline import roofline_profile
from .workload import SimRequest, Synthetic, load_trace, parse_lengths, parse_rates


def workload_from_args(args: argparse.Namespace) -> list[SimRequest]:
    """`--workload trace.jsonl`, or `--workload synthetic` with the generator's flags."""
    if args.workload != "synthetic":
        return load_trace(args.workload)
    return list(
        Synthetic(
            rates=parse_rates(args.rate),
            duration_s=args.duration,
            cv=args.cv,
            prompt=parse_lengths(args.prompt_len),
            output=parse_lengths(args.output_len),
            prefix_groups=args.prefix_groups,
            prefix_tokens=args.prefix_tokens,
            prefix_share=args.prefix_share,
            seed=args.seed,
        ).requests()
    )


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, help="a JSONL trace, or 'synthetic' (then the flags below)")
    g = p.add_argument_group("synthetic workload")
    g.add_argument("--rate", default="5", help="requests/s, or a schedule FROM_S:RATE,FROM_S:RATE,...")
    g.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    g.add_argument("--cv", type=float, default=1.0, help="arrival burstiness: 1 Poisson, else gamma")
    g.add_argument(
        "--prompt-len", default="uniform:64-512", help="fixed:N | uniform:LOW-HIGH | lognormal:MEDIAN-MAX"
    )
    g.add_argument("--output-len", default="uniform:32-256")
    g.add_argument("--prefix-groups", type=int, default=0)
    g.add_argument("--prefix-tokens", type=int, default=0)
    g.add_argument("--prefix-share", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)


def load_profile(text: str | None) -> Profile:
    """A profile file, `roofline:HARDWARE[:MODEL[:TP]]`, or (None) the bundled model's CPU profile."""
    if text is None:
        return Profile.load(Path(__file__).with_name("cpu_smollm2.json"))
    if text.startswith("roofline:"):
        parts = text.split(":")[1:]
        return roofline_profile(
            parts[0], parts[1] if len(parts) > 1 else "llama3-8b", int(parts[2]) if len(parts) > 2 else 1
        )
    return Profile.load(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet simulate",
        description="Simulate an InferenceService's fleet on a "
        "workload: the engine's scheduler and block manager, the router and the tuner as "
        "real code over simulated time, step costs from a profile.",
    )
    p.add_argument("--isvc", required=True, help="InferenceService YAML")
    add_workload_args(p)
    p.add_argument(
        "--profile",
        default=None,
        help="profile JSON (specfleet profile), or roofline:HARDWARE[:MODEL[:TP]] "
        "(an estimate); default: the bundled model on this project's 2-core CPU",
    )
    p.add_argument("--out", required=True, help="directory for summary.json, requests.jsonl, timeline.png")
    p.add_argument("--replicas", type=int, default=None, help="override spec.replicas")
    p.add_argument(
        "--tune",
        dest="tune",
        action="store_true",
        default=None,
        help="run the tuner (default: as spec.autotune.enabled)",
    )
    p.add_argument("--no-tune", dest="tune", action="store_false")
    p.add_argument(
        "--fast",
        action="store_true",
        help="repeat pure-decode steps without the scheduler (for "
        "large fleets; validated against the exact mode, docs/simulator.md)",
    )
    p.add_argument(
        "--acceptance", default=None, help="P(position i accepted), comma-separated (default: the profile's)"
    )
    p.add_argument(
        "--acceptance-from",
        default=None,
        metavar="FILE[,FILE...]",
        help="engines' /metrics texts, saved (curl ENGINE/metrics > FILE): each simulated request draws its class "
        "of acceptance from the finished requests they counted (in place of the profile's classes)",
    )
    p.add_argument(
        "--autoscale",
        dest="autoscale",
        action="store_true",
        default=None,
        help="run the replica autoscaler (default: as spec.autoscaling.enabled; needs the tuner)",
    )
    p.add_argument("--no-autoscale", dest="autoscale", action="store_false")
    p.add_argument(
        "--startup-s",
        type=float,
        default=None,
        help="a new replica's start-up delay before it is routable (default: the profile's startup_s)",
    )
    p.add_argument(
        "--policy",
        default=None,
        choices=list(POLICIES),
        help="routing policy (default: spec.routing.policy; least-loaded with routing disabled)",
    )
    p.add_argument("--sim-seed", type=int, default=0)
    return p


def with_classes_from(profile: Profile, files: str, k: int) -> Profile:
    """The profile with the classes of acceptance counted in the saved /metrics texts `files` (comma-separated),
    drafted at most `k` tokens; a text with none is refused (no request finished into a class there)."""
    texts = [Path(f).read_text() for f in files.split(",")]
    classes = classes_from_metrics(texts, k)
    if not classes:
        raise ValueError(
            f"--acceptance-from {files}: no specfleet_spec_decode_class_* counters with a finished request "
            "(an engine with speculation on, after some requests finished)"
        )
    return profile.with_(acceptance_classes=classes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        isvc = load_inference_service(args.isvc)
        profile = load_profile(args.profile)
        requests = workload_from_args(args)
        acceptance = tuple(float(a) for a in args.acceptance.split(",")) if args.acceptance else ()
        if args.acceptance_from:
            profile = with_classes_from(
                profile, args.acceptance_from, isvc.spec.speculative.num_speculative_tokens
            )
        fleet = SimFleet(
            isvc,
            profile,
            replicas=args.replicas,
            tune=args.tune,
            fast=args.fast,
            seed=args.sim_seed,
            accepted_per_pos=acceptance,
            autoscale=args.autoscale,
            startup_s=args.startup_s,
            policy=args.policy,
        )
    except (InvalidInferenceService, OSError, ValueError) as error:
        print(f"specfleet simulate: {error}", file=sys.stderr)
        return 2
    if profile.estimate:
        print(f"note: profile {profile.name} is an ESTIMATE ({profile.notes})", file=sys.stderr)
    print(
        f"simulating {len(requests)} requests over {fleet.replicas} replica(s) of {isvc.name}"
        + (f" (autoscaled, {fleet.startup_s:.0f}s start-up)" if fleet.autoscaling else ""),
        file=sys.stderr,
    )
    run = fleet.run(requests)
    slo = {"ttft": isvc.spec.slo.ttft_p95_ms / 1000.0, "tpot": isvc.spec.slo.tpot_p95_ms / 1000.0}
    summary = summarize(run, profile, slo, max(isvc.spec.resources.gpus, 1))
    out = Path(args.out)
    write(
        run,
        summary,
        out,
        f"{isvc.name}: "
        + (
            f"{run.replicas}-{run.max_replicas} replicas (autoscaled)"
            if fleet.autoscaling
            else f"{run.replicas} replicas"
        )
        + f", {len(run.records)} requests, profile "
        f"{profile.name}{' (estimate)' if profile.estimate else ''}",
    )
    print(
        f"wrote {out}/summary.json, requests.jsonl, timeline.png; {summary['sim']['requests_per_wall_s']} "
        f"simulated requests per wall-clock second",
        file=sys.stderr,
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "slo"}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
