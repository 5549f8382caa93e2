"""`specfleet bench tune`: the tuner against the best static config in hindsight, on a shifting workload.

One local fleet (bundled model); phases of closed-loop load through the chat API (default: concurrency 1
on input-grounded prompts, 32 on chat, 2 on chat; the prompt sets of `specfleet bench spec`, with
max_tokens a user of each would ask for: a copied passage is long, a chat answer under load short;
requests stop at EOS). Every static config of the grid (k x max_num_seqs) runs each phase,
pushed live through the admin API, in two passes (the second in reverse order); a fresh tuner runs the
same phases back to back before them and again after them, and the two are averaged. Goodput is measured
by the client over each phase's window (bench/closed_loop.py): output tokens/s of requests whose TTFT and
TPOT meet the SLO. Prints progress, writes
JSON and a PNG timeline, and prints the JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from specfleet.bench import stoppable
from specfleet.bench.closed_loop import Phase, prime, run_phase
from specfleet.engine.spec_decode.methods import METHODS
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator import load_inference_service
from specfleet.tuner.actuator import AdminActuator
from specfleet.tuner.types import LiveSettings, TunedConfig

PHASES = (
    Phase("grounded-c1", 1, True, 128),
    Phase("chat-c32", 32, False, 48),
    Phase("chat-c2", 2, False, 96),
)
NO_GUARD = 0  # speculative_disable_by_batch_size of the static configs: they speculate at any batch size
WARM_UP = Phase("warm-up", 4, False, 32)  # before a tuner pass that comes first; not measured


def _speculative(method: str) -> dict[str, Any]:
    """The method's spec; a method that needs a draft model gets the draft that pays for the bundled model:
    its own weights in int8."""
    spec: dict[str, Any] = {"method": method, "numSpeculativeTokens": 0}
    if METHODS[method].needs_draft_model:
        spec["draftModel"] = {"source": "bundled://smollm2-135m-instruct", "quantization": "int8"}
    return spec


def bench_spec(
    args: argparse.Namespace, speculative: dict[str, Any], replicas: int, autotune: bool = True
) -> dict[str, Any]:
    """The InferenceService spec the fleet benchmarks share: the bundled model at fp32, batch limits with
    room for the grid's largest static config, the SLO from the command line, the tuner every 5 s within
    the grid's bounds."""
    return {
        "model": {"source": "bundled://smollm2-135m-instruct", "dtype": "float32", "maxModelLen": 1024},
        "engine": {"drainTimeoutSeconds": 5},
        "batching": {"maxNumSeqs": 32, "maxNumBatchedTokens": 1024},
        "speculative": speculative,
        "replicas": replicas,
        "resources": {"gpus": 0},
        "slo": {"ttftP95Ms": args.ttft_ms, "tpotP95Ms": args.tpot_ms},
        "autotune": {
            "enabled": autotune,
            "intervalSeconds": 5,
            "bounds": {
                "numSpeculativeTokens": [0, 6],
                "maxNumSeqs": [4, 64],
                "maxNumBatchedTokens": [256, 2048],
            },
        },
    }


def bench_service(spec: dict[str, Any]) -> Any:
    """`spec` as the InferenceService named "bench"."""
    return load_inference_service(
        {
            "apiVersion": "serving.specfleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "bench"},
            "spec": spec,
        }
    )


def _isvc(args: argparse.Namespace) -> Any:
    if args.file:
        return load_inference_service(args.file)
    return bench_service(bench_spec(args, _speculative(args.method), args.replicas))


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    isvc = _isvc(args)
    slo = (isvc.spec.slo.ttft_p95_ms / 1000, isvc.spec.slo.tpot_p95_ms / 1000)
    fleet = LocalFleet(
        isvc,
        tune=False,
        interval_s=args.interval,
        window_s=args.window,
        engine_extra_args=["--kv-cache-gib", "0.5", "--log-level", "warning"],
    )
    print(f"starting {isvc.spec.replicas} engine(s); logs in {fleet.log_dir}", flush=True)
    await fleet.start()
    admin = AdminActuator(fleet.token, admin_url=fleet.admin_url)
    start_config = TunedConfig(0, isvc.spec.batching.max_num_seqs, isvc.spec.batching.max_num_batched_tokens)
    passes: list[Static] = []
    tuner_passes: list[dict[str, dict[str, float]]] = []
    timeline: list[dict[str, Any]] = []
    changes: dict[str, int] = {}
    try:
        grid = {
            f"k={k},seqs={seqs}": TunedConfig(
                k, seqs, max(isvc.spec.batching.max_num_batched_tokens, seqs * (k + 1))
            )
            for k in args.grid_k
            for seqs in args.grid_seqs
        }

        async def tuner_pass() -> None:
            await admin.ensure(fleet.engine_urls, LiveSettings(start_config, NO_GUARD))
            tuner_passes.append(await run_tuner(fleet, args, slo, len(tuner_passes) + 1, timeline, changes))

        async def grid_pass(reverse: bool) -> None:
            passes.append(await static_pass(fleet, admin, grid, args.static_seconds, slo, reverse=reverse))

        if (
            args.tuner_passes == 2
        ):  # tuner, static, static reversed, tuner: drift that is linear in time cancels
            await run_phase(fleet.url, WARM_UP, 10.0, slo)
            await prime(fleet.url, PHASES)
            await tuner_pass()
            await grid_pass(reverse=False)
        else:  # static, tuner, static reversed
            await prime(fleet.url, PHASES)
            await grid_pass(reverse=False)
            await tuner_pass()
        if args.static_passes > 1:
            await grid_pass(reverse=True)
        if args.tuner_passes == 2:
            await tuner_pass()
    finally:
        await admin.close()
        await fleet.stop(drain_timeout_s=5)
    return {**summarize(passes, tuner_passes, changes, timeline), "tuner_guard": args.guard}


async def run_tuner(
    fleet: LocalFleet,
    args: argparse.Namespace,
    slo: tuple[float, float],
    number: int,
    timeline: list[dict[str, Any]],
    changes: dict[str, int],
) -> dict[str, dict[str, float]]:
    """The phases back to back under a fresh tuner (from k=0); appends to the timeline and counts the
    changes of each transition (keyed "pass N: phase")."""
    fleet.tuner = fleet.new_tuner()
    if not args.guard:
        fleet.tuner.policy.params = replace(fleet.tuner.policy.params, guard=False)
    t0 = time.monotonic()
    current = [PHASES[0]]
    figures: dict[str, dict[str, float]] = {}

    async def tune_loop() -> None:
        while True:
            tick = await fleet.tick()
            cfg = fleet.tuner.policy.current if fleet.tuner else None
            timeline.append(
                {
                    "pass": number,
                    "t": time.monotonic() - t0,
                    "phase": current[0].name,
                    "load": current[0].concurrency,
                    "k": cfg.num_speculative_tokens if cfg else None,
                    "max_num_seqs": cfg.max_num_seqs if cfg else None,
                    "guard": tick.guard,
                    "tpot_p95_ms": None
                    if tick.observation.tpot_p95_s is None
                    else tick.observation.tpot_p95_s * 1000,
                    "kind": tick.decision.kind,
                    "reason": tick.decision.reason,
                }
            )
            if tick.decision.changed:  # reverts count: a probe reverted within a load level is churn too
                key = f"pass {number}: {current[0].name}"
                changes[key] = changes.get(key, 0) + 1
                print(f"  [tuner] {tick.decision.kind}: {tick.decision.reason[:160]}", flush=True)
            await asyncio.sleep(args.interval)

    loop = asyncio.create_task(tune_loop())
    try:
        for phase in PHASES:
            current[0] = phase
            figures[phase.name] = await run_phase(fleet.url, phase, args.phase_seconds, slo)
            print(
                f"tuner (pass {number}) {phase.name}: goodput {figures[phase.name]['goodput']:.1f} tok/s "
                f"attainment {figures[phase.name]['slo_attainment']:.0%}",
                flush=True,
            )
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    return figures


Static = dict[str, dict[str, dict[str, float]]]  # config -> phase -> figures


async def static_pass(
    fleet: LocalFleet,
    admin: AdminActuator,
    grid: dict[str, TunedConfig],
    seconds: float,
    slo: tuple[float, float],
    reverse: bool,
) -> Static:
    """Every config of the grid under every phase; configs that behave alike under a phase share one
    measurement as long as theirs together."""
    static: Static = {name: {} for name in grid}
    for phase in reversed(PHASES) if reverse else PHASES:
        groups = equivalent_groups(grid, phase.concurrency)
        for names in reversed(groups) if reverse else groups:
            config = grid[names[0]]
            applied = await admin.ensure(fleet.engine_urls, LiveSettings(config, NO_GUARD))
            if not applied.ok:
                raise RuntimeError(f"cannot apply {config.short()}: {applied.failed or applied.refused}")
            measured = await run_phase(fleet.url, phase, seconds * len(names), slo)
            for name in names:
                static[name][phase.name] = measured
            print(
                f"static {' = '.join(names)} {phase.name}: goodput {measured['goodput']:.1f} tok/s "
                f"attainment {measured['slo_attainment']:.0%}",
                flush=True,
            )
    return static


def mean_passes(passes: list[Static]) -> Static:
    """Each config's figures per phase averaged over the passes (requests summed)."""
    out: Static = {}
    for name, phases in passes[0].items():
        out[name] = {}
        for phase in phases:
            runs = [p[name][phase] for p in passes]
            out[name][phase] = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
            out[name][phase]["requests"] = sum(r["requests"] for r in runs)
    return out


def equivalent_groups(grid: dict[str, TunedConfig], concurrency: int) -> list[list[str]]:
    """Configs that behave alike under a load: a `max_num_seqs` at or above the concurrency never binds, so
    k=2 with 8 or 32 sequences is one engine behaviour at concurrency 2. Each group is measured once, for
    as long as its members would have been in turn: the same time, less noise, and no best-of-two
    measurements of one behaviour inflating the hindsight optimum."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for name, c in grid.items():
        key = (c.num_speculative_tokens, min(c.max_num_seqs, concurrency), c.max_num_batched_tokens)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _overall(per_phase: dict[str, dict[str, float]]) -> float:
    """Goodput over the whole workload with equal time per phase: the mean of the phases' goodputs."""
    return sum(p["goodput"] for p in per_phase.values()) / len(per_phase)


def _phase_goodput(phase: str) -> Callable[[dict[str, dict[str, float]]], float]:
    """Reads one phase's goodput out of a pass's figures."""
    return lambda figures: figures[phase]["goodput"]


def hindsight_best(
    passes: list[Static], value: Callable[[dict[str, dict[str, float]]], float]
) -> tuple[str, float]:
    """The best static config in hindsight and its goodput, without the winner's curse: the largest of
    several noisy measurements overstates the config it picks. With two passes, the config picked on
    one pass is valued on the other, both ways, averaged; with one pass, the plain maximum."""
    picks = []
    for i, chosen_on in enumerate(passes):
        name = max(chosen_on, key=lambda n: value(chosen_on[n]))
        valued_on = passes[1 - i] if len(passes) == 2 else chosen_on
        picks.append((name, value(valued_on[name])))
    names = list(dict.fromkeys(n for n, _ in picks))
    return " / ".join(names), sum(v for _, v in picks) / len(picks)


def summarize(
    passes: list[Static],
    tuner_passes: list[dict[str, dict[str, float]]],
    changes: dict[str, int],
    timeline: list[dict[str, Any]],
) -> dict[str, Any]:
    """The tuner's figures per phase are the mean of its passes, like each static config's."""
    static = mean_passes(passes)
    tuner = mean_passes([{"tuner": t} for t in tuner_passes])["tuner"]
    best_name, best_static = hindsight_best(passes, _overall)
    tuner_goodput = _overall(tuner)
    per_phase = {p: hindsight_best(passes, _phase_goodput(p)) for p in tuner}
    ratios = {p: tuner[p]["goodput"] / max(best, 1e-9) for p, (_, best) in per_phase.items()}
    # the plain maximum over the averaged passes, for comparison: an upper bound of the hindsight best
    best_max = max(_overall(s) for s in static.values())
    ratios_max = {
        p: tuner[p]["goodput"] / max(max(s[p]["goodput"] for s in static.values()), 1e-9) for p in tuner
    }
    requests = sum(p["requests"] for p in tuner.values())
    return {
        "tuner_goodput": round(tuner_goodput, 2),
        "best_static_goodput": round(best_static, 2),
        "best_static_config": best_name,
        "goodput_ratio": round(tuner_goodput / max(best_static, 1e-9), 3),
        "per_phase_best_static": {p: name for p, (name, _) in per_phase.items()},
        "per_phase_ratio": {p: round(r, 3) for p, r in ratios.items()},
        "per_phase_ratio_min": round(min(ratios.values()), 3),
        "slo_attainment": round(
            sum(p["slo_attainment"] * p["requests"] for p in tuner.values()) / max(requests, 1), 3
        ),
        "changes_per_transition_max": max(changes.values(), default=0),
        "changes_per_transition": changes,
        "reverts": sum(1 for point in timeline if point.get("kind") == "revert"),
        "static_passes": len(passes),
        "tuner_passes": len(tuner_passes),
        "goodput_ratio_vs_max": round(tuner_goodput / max(best_max, 1e-9), 3),
        "per_phase_ratio_min_vs_max": round(min(ratios_max.values()), 3),
        "static": static,
        "passes": passes,
        "tuner": tuner,
        "tuner_by_pass": tuner_passes,
        "timeline": timeline,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 8), sharex=True)
    for number in sorted({p.get("pass", 1) for p in result["timeline"]}):
        tl = [p for p in result["timeline"] if p.get("pass", 1) == number]
        t = [p["t"] for p in tl]
        style = "-" if number == 1 else ":"
        for ax, key, label in zip(
            axes,
            ("load", "k", "max_num_seqs", "tpot_p95_ms"),
            ("load (concurrency)", "k", "max_num_seqs", "TPOT p95 (ms)"),
            strict=True,
        ):
            ax.step(
                t,
                [p[key] if p[key] is not None else float("nan") for p in tl],
                where="post",
                linestyle=style,
                color="C0",
                label=f"tuner pass {number}",
            )
            ax.set_ylabel(label)
        guard = [p.get("guard") or float("nan") for p in tl]  # 0: never disables, not drawn
        axes[0].step(
            t,
            guard,
            where="post",
            linestyle=style,
            color="C1",
            label=f"speculation off above (guard), pass {number}",
        )
    axes[0].legend(loc="upper right", fontsize="x-small")
    axes[-1].set_xlabel("seconds into the tuner run")
    axes[0].set_title(
        f"specfleet tuner: goodput ratio {result['goodput_ratio']} vs best static "
        f"{result['best_static_config']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench tune", description=__doc__.splitlines()[0])
    p.add_argument("-f", "--file", default=None, help="InferenceService YAML (default: a built-in CPU one)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument(
        "--phase-seconds",
        type=float,
        # A fresh tuner runs the spec's k=0 for its first interval (a rate needs two scrapes): ~5 % of a
        # 60 s phase, the whole margin of the 0.95 per-phase target on a 2-core host's noise; ~2 % of 120 s
        # (docs/decisions/008-bench-phase-lengths.md).
        default=120.0,
        help="tuner run: seconds per phase",
    )
    p.add_argument(
        "--static-seconds", type=float, default=15.0, help="static grid: seconds per phase per config"
    )
    p.add_argument(
        "--static-passes",
        type=int,
        choices=[1, 2],
        default=2,
        help="static grid before the tuner, and (2) again after it in reverse order, averaged",
    )
    p.add_argument(
        "--tuner-passes",
        type=int,
        choices=[1, 2],
        default=2,
        help="2: the tuner runs the phases before the static grid and again after it (fresh each "
        "time), averaged; 1: once, between the static passes",
    )
    p.add_argument("--grid-k", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument(
        "--method",
        choices=list(METHODS),
        default="ngram",
        help="speculative method of the fleet (ignored with --file): ngram (3.5x on grounded "
        "prompts at concurrency 1, 0.4x on chat at 32) or draft, the int8 copy of the "
        "bundled model (1.6x on chat at concurrency 1, 0.3-0.5x at 32)",
    )
    p.add_argument("--grid-seqs", type=int, nargs="+", default=[8, 32])
    p.add_argument("--interval", type=float, default=4.0, help="tuner interval (s)")
    p.add_argument("--window", type=float, default=8.0, help="metrics window (s)")
    p.add_argument(
        "--no-guard",
        dest="guard",
        action="store_false",
        help="the tuner leaves speculative_disable_by_batch_size at 0 (to measure what it adds)",
    )
    p.add_argument("--ttft-ms", type=int, default=6000)
    p.add_argument("--tpot-ms", type=int, default=400)
    p.add_argument("--out-dir", default="bench/results", help="where tune.json and tune.png go")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = stoppable.run(bench(args))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "tune.png")
    print(f"wrote {out / 'tune.json'} and {out / 'tune.png'}", flush=True)
    summary = {
        k: v for k, v in result.items() if k not in ("static", "passes", "tuner", "tuner_by_pass", "timeline")
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
