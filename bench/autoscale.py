"""`specfleet bench autoscale`: the joint tuner (config and replicas) against the best static (replicas, k,
max_num_seqs) in hindsight, on goodput per replica-second, under a load that rises and falls.

`specfleet up`'s local fleet (bundled model) with `autoscaling: {minReplicas: 1, maxReplicas: 2}`, each engine
pinned to a core of its own (`--cpus-per-engine 1`), so that a replica is a fixed share of the machine as a
GPU replica is one device. The load
is `bench tune`'s closed-loop driver over chat prompts: low, high, low (default concurrency 2, 24, 2).
Unless `--tpot-ms` fixes it, the TPOT target is calibrated first, between what one replica and two reach
at the high phase (`calibrate_tpot`), so that the high phase needs the second replica on any host.
First every static point of the grid (replicas x k x max_num_seqs, each config pushed live through the
admin API, the replica count set by starting or retiring engines) runs the phases; then a fresh fleet,
tuned and autoscaled by the tuner, runs the same phases. A replica costs from its start to its exit
(loading included): replica-seconds are sampled every half second. Goodput counts the output tokens of
requests that meet both SLO targets. The cold start of each engine the joint run starts (a scale-up, or a
restart) is the supervisor's: from its process start to its first ready probe, model load included; the
router's scale-from-zero wait would be reported too, but `minReplicas: 1` never reaches zero. Prints
progress, writes JSON, and prints the summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

from specfleet.bench import stoppable
from specfleet.bench.closed_loop import Phase, run_phase
from specfleet.bench.tune import bench_service, bench_spec
from specfleet.fleet.engines import Startup
from specfleet.fleet.supervisor import LocalFleet
from specfleet.tuner.actuator import AdminActuator
from specfleet.tuner.loop import Tick
from specfleet.tuner.types import LiveSettings, TunedConfig

NO_GUARD = 0  # the static configs speculate at any batch size
# Seconds of the high phase per replica count when the TPOT target is calibrated: at 24 streams a request
# of 48 tokens takes 5-15 s here, so 30 s judges some 50-150 requests per count, enough for a p95.
CALIBRATION_SECONDS = 30.0


def phases(args: argparse.Namespace) -> tuple[Phase, ...]:
    low, high = args.low, args.high
    return (
        Phase(f"chat-c{low}", low, False, 96),
        Phase(f"chat-c{high}", high, False, 48),
        Phase(f"chat-c{low}-after", low, False, 96),
    )


def _isvc(args: argparse.Namespace, autoscaling: bool, replicas: int) -> Any:
    spec = bench_spec(args, {"method": "ngram", "numSpeculativeTokens": 0}, replicas, autotune=autoscaling)
    spec["routing"] = {"policy": "least-loaded"}
    if (
        args.tpot_ms is None
    ):  # the static grid's fleet, before the calibration: it runs no tuner to read an SLO
        del spec["slo"]
    spec["autoscaling"] = {
        "enabled": autoscaling,
        "minReplicas": 1,
        "maxReplicas": 2,
        "scaleDownStabilizationSeconds": args.scale_down_window,
        "cooldownSeconds": args.cooldown,
    }
    return bench_service(spec)


class ReplicaMeter:
    """Replica-seconds of a fleet: every engine process that runs (starting, serving or draining) costs."""

    def __init__(self, fleet: LocalFleet, period_s: float = 0.5) -> None:
        self.fleet, self.period_s = fleet, period_s
        self.seconds = 0.0
        self.samples: list[tuple[float, int]] = []
        self._task: asyncio.Task[None] | None = None

    def running(self) -> int:
        return sum(1 for e in self.fleet.engines if e.running)

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            count = self.running()
            self.seconds += count * (now - last)
            self.samples.append((now, count))
            last = now

    def __enter__(self) -> ReplicaMeter:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()


def _good_tokens(figures: dict[str, float]) -> float:
    return figures["goodput"] * figures["seconds"]


def _engine_args() -> list[str]:
    return ["--kv-cache-gib", "0.5", "--log-level", "warning"]


async def static_grid(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every (replicas, k, max_num_seqs) over the phases, the most replicas first; each point's figures."""
    fleet = LocalFleet(
        _isvc(args, autoscaling=False, replicas=max(args.grid_replicas)),
        tune=False,
        engine_extra_args=_engine_args(),
        cpus_per_engine=args.cpus_per_engine or None,
    )
    print(f"static grid: starting {max(args.grid_replicas)} engine(s); logs in {fleet.log_dir}", flush=True)
    await fleet.start()
    admin = AdminActuator(fleet.token, admin_url=fleet.admin_url)
    out: dict[str, dict[str, Any]] = {}
    try:
        if args.tpot_ms is None:
            args.calibration = await calibrate_tpot(fleet, admin, args)
            args.tpot_ms = args.calibration["tpot_target_ms"]
        for replicas in sorted(args.grid_replicas, reverse=True):
            await _scale_and_settle(fleet, replicas)
            for k in args.grid_k:
                for seqs in args.grid_seqs:
                    config = TunedConfig(k, seqs, max(1024, seqs * (k + 1)))
                    applied = await admin.ensure(fleet.engine_urls, LiveSettings(config, NO_GUARD))
                    if not applied.ok:
                        raise RuntimeError(
                            f"cannot apply {config.short()}: {applied.failed or applied.refused}"
                        )
                    name = f"replicas={replicas},k={k},seqs={seqs}"
                    figures = {
                        p.name: await run_phase(fleet.url, p, args.static_seconds, _slo(args))
                        for p in phases(args)
                    }
                    out[name] = summarize_run(figures, replicas * sum(f["seconds"] for f in figures.values()))
                    print(
                        f"static {name}: {out[name]['goodput_per_replica_s']:.2f} good tok per replica-s, "
                        f"attainment {out[name]['slo_attainment']:.0%}",
                        flush=True,
                    )
    finally:
        await admin.close()
        await fleet.stop(drain_timeout_s=5)
    return out


async def _scale_and_settle(fleet: LocalFleet, replicas: int) -> None:
    """`replicas` engines serving, and none of the retired ones still running."""
    await fleet.scale_to(replicas)
    while len(fleet.ready_urls()) != replicas or any(e.running for e in fleet.engines if e.retiring):
        await asyncio.sleep(0.25)


async def calibrate_tpot(fleet: LocalFleet, admin: AdminActuator, args: argparse.Namespace) -> dict[str, Any]:
    """The TPOT target between what the fewest and the most replicas of the grid reach at the high phase
    (k=0, the grid's largest max_num_seqs; TPOT p95 over `CALIBRATION_SECONDS` each): their geometric
    mean. So on any host the high phase needs the second replica and the low phases do not, which is the
    question the bench asks; a fixed target measures the host's speed instead (230 ms, sized by hand on
    one day, was met by one replica on a faster day, and the bench then compared scaling against a load
    that needed none)."""
    high = phases(args)[1]
    seconds = CALIBRATION_SECONDS / (2 if args.quick else 1)
    config = TunedConfig(0, max(args.grid_seqs), max(1024, max(args.grid_seqs)))
    measured: dict[int, float] = {}
    for replicas in (max(args.grid_replicas), min(args.grid_replicas)):
        await _scale_and_settle(fleet, replicas)
        applied = await admin.ensure(fleet.engine_urls, LiveSettings(config, NO_GUARD))
        if not applied.ok:
            raise RuntimeError(f"cannot apply {config.short()}: {applied.failed or applied.refused}")
        figures = await run_phase(fleet.url, high, seconds, _slo(args, tpot_ms=10**6))
        measured[replicas] = figures["tpot_p95_s"] * 1000
        print(
            f"calibration: {high.name} on {replicas} replica(s): TPOT p95 {measured[replicas]:.0f} ms",
            flush=True,
        )
    return tpot_target(measured)


def tpot_target(measured: dict[int, float]) -> dict[str, Any]:
    """The target from TPOT p95 (ms) by replica count: the geometric mean of the fewest's and the most's."""
    few, most = measured[min(measured)], measured[max(measured)]
    if few <= most:
        print(
            f"calibration: more replicas did not lower TPOT p95 ({few:.0f} against {most:.0f} ms): "
            "the high phase does not need them on this host",
            flush=True,
        )
    return {
        "tpot_target_ms": round(math.sqrt(few * most)),
        "tpot_p95_ms_by_replicas": {str(n): round(ms, 1) for n, ms in sorted(measured.items())},
    }


def _slo(args: argparse.Namespace, tpot_ms: float | None = None) -> tuple[float, float]:
    return args.ttft_ms / 1000, (tpot_ms or args.tpot_ms) / 1000


def summarize_run(figures: dict[str, dict[str, float]], replica_seconds: float) -> dict[str, Any]:
    good = sum(_good_tokens(f) for f in figures.values())
    requests = sum(f["requests"] for f in figures.values())
    return {
        "goodput_per_replica_s": good / max(replica_seconds, 1e-9),
        "replica_seconds": replica_seconds,
        "good_tokens": good,
        "slo_attainment": sum(f["slo_attainment"] * f["requests"] for f in figures.values())
        / max(requests, 1),
        "phases": figures,
    }


def cold_starts(startups: list[Startup], t0: float, from_zero_s: float | None) -> dict[str, Any]:
    """The engines started after the fleet's own start (`cause` scale-up or restart): when each became
    ready (seconds after `t0`) and how long it took from its process start; `from_zero_s` is the router's
    wait for the first request held with no engine ready (`specfleet_router_cold_start_seconds`)."""
    later = [s for s in startups if s.cause != "start"]
    scale_ups = [s.seconds for s in later if s.cause == "scale-up"]
    return {
        "cold_starts": [
            {
                "engine": s.index,
                "cause": s.cause,
                "t": round(s.ready_at - t0, 1),
                "seconds": round(s.seconds, 2),
            }
            for s in later
        ],
        "cold_start_s_max": round(max(scale_ups), 2) if scale_ups else None,
        "scale_from_zero_cold_start_s": None if from_zero_s is None else round(from_zero_s, 2),
    }


async def joint(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh fleet at one replica, the tuner deciding config and replicas, through the phases."""
    fleet = LocalFleet(
        _isvc(args, autoscaling=True, replicas=1),
        interval_s=args.interval,
        window_s=args.window,
        engine_extra_args=_engine_args(),
        cpus_per_engine=args.cpus_per_engine or None,
    )
    figures: dict[str, dict[str, float]] = {}
    marks: list[tuple[float, str]] = []  # (monotonic start, phase)
    config_changes: dict[str, int] = {}  # config changes (reverts included) per phase

    def on_tick(tick: Tick) -> None:
        if tick.decision.changed and marks:
            config_changes[marks[-1][1]] = config_changes.get(marks[-1][1], 0) + 1
            print(f"  [tuner] {tick.decision.kind}: {tick.decision.reason[:160]}", flush=True)

    fleet.on_tick = on_tick
    print(f"joint tuner: starting 1 engine; logs in {fleet.log_dir}", flush=True)
    await fleet.start()
    try:
        with ReplicaMeter(fleet) as meter:
            for phase in phases(args):
                marks.append((time.monotonic(), phase.name))
                figures[phase.name] = await run_phase(fleet.url, phase, args.phase_seconds, _slo(args))
                print(
                    f"joint {phase.name}: goodput {figures[phase.name]['goodput']:.1f} tok/s, attainment "
                    f"{figures[phase.name]['slo_attainment']:.0%}, engines running {meter.running()}",
                    flush=True,
                )
            replica_seconds, samples = meter.seconds, list(meter.samples)
    finally:
        await fleet.stop(drain_timeout_s=5)

    def phase_at(t: float) -> str:
        return next((name for start, name in reversed(marks) if t >= start), marks[0][1])

    replica_changes: dict[str, int] = {}
    for d in fleet.replica_decisions:
        if d.changed:
            replica_changes[phase_at(d.time)] = replica_changes.get(phase_at(d.time), 0) + 1
    t0 = marks[0][0]
    return {
        **summarize_run(figures, replica_seconds),
        "replica_changes": replica_changes,
        "config_changes": config_changes,
        "scale_decisions": [
            {"t": round(d.time - t0, 1), "replicas": d.replicas, "reason": d.reason[:200]}
            for d in fleet.replica_decisions
            if d.changed
        ],
        "replicas_timeline": [(round(t - t0, 1), n) for t, n in samples[:: max(1, len(samples) // 200)]],
        **cold_starts(fleet.startups, t0, fleet.router.cold_start_s),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    static = await static_grid(args)
    return summarize(args, static, await joint(args))


def summarize(
    args: argparse.Namespace, static: dict[str, dict[str, Any]], tuned: dict[str, Any]
) -> dict[str, Any]:
    """The JSON: the joint run against the best static point, its replica and config churn, cold starts."""
    best = max(static, key=lambda n: static[n]["goodput_per_replica_s"])
    best_value = static[best]["goodput_per_replica_s"]
    return {
        "joint_goodput_per_replica_s": round(tuned["goodput_per_replica_s"], 3),
        "best_static_goodput_per_replica_s": round(best_value, 3),
        "best_static": best,
        "goodput_per_replica_s_ratio": round(tuned["goodput_per_replica_s"] / max(best_value, 1e-9), 3),
        "slo_attainment": round(tuned["slo_attainment"], 3),
        "best_static_slo_attainment": round(static[best]["slo_attainment"], 3),
        "replica_changes_per_transition_max": max(tuned["replica_changes"].values(), default=0),
        "config_changes_per_transition_max": max(tuned["config_changes"].values(), default=0),
        "replica_changes_per_transition": tuned["replica_changes"],
        "replica_seconds": round(tuned["replica_seconds"], 1),
        "cold_start_s_max": tuned["cold_start_s_max"],
        "cold_start_s": [c["seconds"] for c in tuned["cold_starts"] if c["cause"] == "scale-up"],
        "scale_from_zero_cold_start_s": tuned["scale_from_zero_cold_start_s"],
        "tpot_target_ms": args.tpot_ms,
        "tpot_calibration": getattr(args, "calibration", None),
        "phases": [p.name for p in phases(args)],
        "phase_seconds": args.phase_seconds,
        "static": static,
        "joint": tuned,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench autoscale", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter phases and a smaller grid: a few minutes")
    p.add_argument("--low", type=int, default=2, help="concurrency of the low phases")
    p.add_argument("--high", type=int, default=24, help="concurrency of the high phase")
    # Loads that stay several times longer than a scale-up takes (one interval to see the rise, then the
    # cold start): docs/decisions/008-bench-phase-lengths.md.
    p.add_argument("--phase-seconds", type=float, default=240.0, help="joint run: seconds per phase")
    p.add_argument(
        "--static-seconds", type=float, default=30.0, help="static grid: seconds per phase per point"
    )
    p.add_argument("--grid-replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--grid-k", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--grid-seqs", type=int, nargs="+", default=[32])
    # One core of its own per replica, as each GPU replica has its own device: unpinned, a second engine on
    # this 2-core machine shares the first one's cores and adds cost without capacity
    # (docs/decisions/008-bench-phase-lengths.md).
    p.add_argument(
        "--cpus-per-engine",
        type=int,
        default=1,
        help="cores pinned to each engine (specfleet up --cpus-per-engine); 0: every engine on every core",
    )
    p.add_argument("--interval", type=float, default=4.0, help="tuner interval (s)")
    p.add_argument("--window", type=float, default=8.0, help="metrics window (s)")
    # A bench-sized HPA: the defaults (300 s down-window, 60 s cooldown) outlast a phase here.
    p.add_argument(
        "--scale-down-window", type=int, default=30, help="spec.autoscaling.scaleDownStabilizationSeconds"
    )
    p.add_argument("--cooldown", type=int, default=20, help="spec.autoscaling.cooldownSeconds")
    p.add_argument("--ttft-ms", type=int, default=6000)
    p.add_argument(
        "--tpot-ms",
        type=int,
        default=None,
        help="TPOT p95 target; by default calibrated at the start between what one and two replicas reach "
        "at the high phase (calibrate_tpot)",
    )
    p.add_argument("--out-dir", default="bench/results", help="where autoscale.json goes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.phase_seconds, args.static_seconds = (
            min(args.phase_seconds, 45.0),
            min(args.static_seconds, 15.0),
        )
        args.grid_k, args.scale_down_window, args.cooldown = (
            [0, 2],
            min(args.scale_down_window, 15),
            min(args.cooldown, 10),
        )
    result = stoppable.run(bench(args))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'autoscale.json'}", flush=True)
    print(json.dumps({k: v for k, v in result.items() if k not in ("static", "joint")}))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
