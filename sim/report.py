"""What a simulation prints and writes: per-request rows, percentiles, throughput, goodput, SLO attainment,
cost, the timeline of replicas and tuned config, and a PNG like `bench tune`'s."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from specfleet.engine.knobs import SEARCHED

from .fleet import SimRun
from .profile import Profile


def request_rows(run: SimRun) -> list[dict[str, Any]]:
    rows = []
    for r in run.records:
        ttft = None if r.first_token_s is None else r.first_token_s - r.arrival_s
        e2e = (r.finish_s or r.arrival_s) - r.arrival_s
        tpot = None
        if ttft is not None and r.output_tokens > 1:
            tpot = (e2e - ttft) / (r.output_tokens - 1)
        rows.append(
            {
                "index": r.index,
                "arrival_s": round(r.arrival_s, 6),
                "engine": r.engine,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "cached_tokens": r.cached_tokens,
                "preemptions": r.preemptions,
                "finish_reason": r.finish_reason,
                "ttft_s": ttft,
                "tpot_s": tpot,
                "e2e_s": e2e,
                "itl_mean_s": r.itl_sum / r.itl_count if r.itl_count else None,
                "itl_max_s": r.itl_max,
            }
        )
    return rows


def summarize(
    run: SimRun, profile: Profile, slo: dict[str, float], gpus_per_replica: int = 1
) -> dict[str, Any]:
    """`slo`: seconds per metric (ttft, tpot, e2e); goodput counts requests meeting every one (vLLM's
    definition, as `bench serve`)."""
    rows = request_rows(run)
    duration = max(run.duration_s, 1e-9)
    out_tokens = sum(r["output_tokens"] for r in rows)
    summary: dict[str, Any] = {
        "completed": len(rows),
        "unfinished": run.unfinished,
        "duration_s": round(run.duration_s, 3),
        "request_throughput": len(rows) / duration,
        "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
    }
    series = {
        "ttft": [r["ttft_s"] for r in rows if r["ttft_s"] is not None],
        "tpot": [r["tpot_s"] for r in rows if r["tpot_s"] is not None],
        "e2e": [r["e2e_s"] for r in rows],
    }
    for name, values in series.items():
        arr = np.asarray(values, dtype=float) * 1000.0
        summary[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else None
        for q in (50, 90, 95, 99):
            summary[f"p{q}_{name}_ms"] = float(np.percentile(arr, q)) if arr.size else None
    mean_itl = run.itl.mean()
    summary["mean_itl_ms"] = mean_itl * 1000 if mean_itl is not None else None
    for q in (50, 90, 95, 99):
        v = run.itl.percentile(q)
        summary[f"p{q}_itl_ms"] = v * 1000 if v is not None else None

    def meets(r: dict[str, Any]) -> bool:
        values = {"ttft": r["ttft_s"] or 0.0, "tpot": r["tpot_s"] or 0.0, "e2e": r["e2e_s"]}
        return all(values[k] <= limit for k, limit in slo.items())

    good = [r for r in rows if meets(r)]
    summary["slo"] = {k: v * 1000.0 for k, v in slo.items()}
    summary["goodput"] = len(good) / duration
    summary["goodput_tokens"] = sum(r["output_tokens"] for r in good) / duration
    summary["slo_attainment"] = len(good) / len(rows) if rows else 0.0
    summary["preemptions"] = sum(r["preemptions"] for r in rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    summary["prefix_cache_hit_rate"] = sum(r["cached_tokens"] for r in rows) / prompt if prompt else 0.0
    summary["routing_policy"] = run.routing_policy
    replica_seconds = run.replica_seconds
    summary["cost"] = {
        "replica_seconds": round(replica_seconds, 1),
        "gpu_hours": round(replica_seconds * gpus_per_replica / 3600.0, 3),
    }
    summary["replicas"] = run.replicas
    summary["max_replicas"] = run.max_replicas
    summary["replica_changes"] = run.replica_decisions
    summary["rejected"] = run.rejected
    summary["tuner_changes"] = len(run.decisions)
    summary["final_config"] = run.timeline[-1].config if run.timeline else None
    summary["profile"] = {"name": profile.name, "kind": profile.kind, "estimate": profile.estimate}
    summary["sim"] = {
        "wall_s": round(run.wall_s, 3),
        "steps": run.steps,
        "requests_per_wall_s": round(len(rows) / max(run.wall_s, 1e-9), 1),
        "simulated_s_per_wall_s": round(run.duration_s / max(run.wall_s, 1e-9), 2),
        "cpu_s": round(run.cpu_s, 3),
        "requests_per_cpu_s": round(len(rows) / max(run.cpu_s, 1e-9), 1),
    }
    return summary


def write(run: SimRun, summary: dict[str, Any], out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "requests.jsonl", "w") as f:
        for row in request_rows(run):
            f.write(json.dumps(row) + "\n")
    (out / "timeline.json").write_text(json.dumps([asdict(t) for t in run.timeline], indent=0))
    (out / "decisions.json").write_text(json.dumps(run.decisions, indent=1))
    plot(run, out / "timeline.png", title)


def plot(run: SimRun, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = run.timeline
    t = [p.t for p in tl]
    panels = (
        ("arrivals/s", [p.arrivals_per_s for p in tl]),
        ("in system (running+waiting)", [p.running + p.waiting for p in tl]),
        ("replicas (dashed: ready)", [p.replicas for p in tl]),
        *((knob.label, [p.config.get(knob.name) for p in tl]) for knob in SEARCHED),  # the tuned config
        ("TPOT p95 seen by tuner (ms)", [p.tpot_p95_s * 1000 if p.tpot_p95_s else float("nan") for p in tl]),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.5 * len(panels)), sharex=True)
    for ax, (label, values) in zip(axes, panels, strict=True):
        ax.step(t, values, where="post", color="C0")
        if label.startswith("replicas"):  # the ones the router can send to: the rest are starting
            ax.step(t, [p.ready for p in tl], where="post", color="C1", linestyle="--")
        ax.set_ylabel(label, fontsize=8)
    axes[-1].set_xlabel("simulated seconds")
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
