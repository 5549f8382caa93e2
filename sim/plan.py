"""`specfleet plan`: the cheapest fleet that meets an SLO on a workload, found by simulation.

For each engine config of the grid (tensor parallelism x k x max_num_seqs x max_num_batched_tokens), the
fewest replicas whose simulated TTFT p95 and TPOT p95 meet the SLO are found by doubling then bisection
(more replicas never hurt latency under load-bounded routing: the search assumes it). Tensor parallelism
is searched over the degrees the profile covers (`roofline.tp_degrees`): a roofline estimate is derived
again at each degree, a measured profile covers the one it was timed at. Cost is the GPUs held
(replicas x tp); the cheapest config wins, ties to the better TPOT p95; the runner-up is the next
cheapest config.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from specfleet.engine.config import SPECULATIVE_METHODS
from specfleet.operator.inference_service import InferenceService, load_inference_service

from .cli import add_workload_args, load_profile, workload_from_args
from .fleet import SimFleet, SimRun
from .profile import Profile
from .report import summarize, write
from .roofline import at_tp, covers_tp, tp_degrees
from .workload import SimRequest


@dataclass(frozen=True)
class Candidate:
    k: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tp: int = 1

    def short(self) -> str:
        return f"tp={self.tp} k={self.k} seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens}"


@dataclass
class Found:
    candidate: Candidate
    replicas: int
    summary: dict[str, Any]

    @property
    def gpu_seconds(self) -> float:
        return self.replicas * self.candidate.tp * self.summary["duration_s"]


def isvc_for(
    model: str,
    c: Candidate,
    replicas: int,
    method: str,
    slo: dict[str, float],
    max_model_len: int,
    name: str = "planned",
) -> dict[str, Any]:
    speculative: dict[str, Any] = {"method": method if c.k else "none", "numSpeculativeTokens": c.k}
    if not c.k:
        speculative = {"method": "none"}
    return {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": model, "maxModelLen": max_model_len},
            # one GPU per rank (spec rule: resources.gpus x nodes = tensorParallelSize x pipelineParallelSize)
            "engine": {"tensorParallelSize": c.tp},
            "batching": {"maxNumSeqs": c.max_num_seqs, "maxNumBatchedTokens": c.max_num_batched_tokens},
            "speculative": speculative,
            "replicas": replicas,
            "resources": {"gpus": c.tp},
            "slo": {"ttftP95Ms": round(slo["ttft"] * 1000), "tpotP95Ms": round(slo["tpot"] * 1000)},
        },
    }


def simulate_run(
    profile: Profile, isvc_doc: dict[str, Any], requests: list[SimRequest], slo: dict[str, float], fast: bool
) -> tuple[SimRun, dict[str, Any]]:
    isvc: InferenceService = load_inference_service(isvc_doc)
    run = SimFleet(isvc, profile, tune=False, fast=fast).run(requests)
    return run, summarize(run, profile, slo, isvc.spec.resources.gpus)


def simulate(
    profile: Profile, isvc_doc: dict[str, Any], requests: list[SimRequest], slo: dict[str, float], fast: bool
) -> dict[str, Any]:
    return simulate_run(profile, isvc_doc, requests, slo, fast)[1]


def meets(summary: dict[str, Any], slo: dict[str, float]) -> bool:
    return (
        summary["unfinished"] == 0
        and summary["p95_ttft_ms"] is not None
        and summary["p95_ttft_ms"] <= slo["ttft"] * 1000
        and (summary["p95_tpot_ms"] or 0.0) <= slo["tpot"] * 1000
    )


def fewest_replicas(
    profile: Profile,
    model: str,
    c: Candidate,
    method: str,
    requests: list[SimRequest],
    slo: dict[str, float],
    max_replicas: int,
    max_model_len: int,
    fast: bool,
    log: Any,
) -> Found | None:
    # every token after the first waits at least a lone sequence's decode step: past the TPOT SLO, no
    # replica count helps (without speculation; accepted proposals put several tokens in one step)
    floor = profile.step_s(1, streams=1)
    if c.k == 0 and floor > slo["tpot"]:
        log(
            f"plan: {c.short()}: a lone decode step takes {floor * 1000:.1f} ms > the TPOT SLO "
            f"{slo['tpot'] * 1000:g} ms at any replica count: skipped"
        )
        return None
    cache: dict[int, dict[str, Any]] = {}

    def at(r: int) -> dict[str, Any]:
        if r not in cache:
            cache[r] = simulate(
                profile, isvc_for(model, c, r, method, slo, max_model_len), requests, slo, fast
            )
            s = cache[r]
            log(
                f"plan: {c.short()} replicas={r}: TTFT p95 {s['p95_ttft_ms']:.0f} ms, TPOT p95 "
                f"{(s['p95_tpot_ms'] or 0):.1f} ms -> {'meets' if meets(s, slo) else 'misses'}"
            )
        return cache[r]

    low, high = 0, 1
    while not meets(at(high), slo):
        low, high = high, high * 2
        if high > max_replicas:
            if low < max_replicas and meets(at(max_replicas), slo):
                high = max_replicas
                break
            return None
    while high - low > 1:
        mid = (low + high) // 2
        if meets(at(mid), slo):
            high = mid
        else:
            low = mid
    return Found(c, high, at(high))


def rank(f: Found) -> tuple[float, ...]:
    """The cost rule: fewest GPUs held (replicas x tp) over the same workload; between equals the lower
    TPOT p95, then the lower TTFT p95 (more headroom), then the smaller batch limits (less memory)."""
    s = f.summary
    c = f.candidate
    return (
        f.replicas * c.tp,
        s["p95_tpot_ms"] or 0.0,
        s["p95_ttft_ms"],
        c.max_num_seqs,
        c.max_num_batched_tokens,
    )


def predicted(f: Found) -> tuple[float, ...]:
    return (f.replicas * f.candidate.tp, *rank(f)[1:3])


def parse_slo(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        key = {"ttft_p95": "ttft", "tpot_p95": "tpot"}.get(name.strip())
        try:
            number = float(value.removesuffix("ms"))
        except ValueError:
            number = -1.0
        if key is None or number <= 0:
            raise ValueError(f"--slo {item!r}: use ttft_p95=MS,tpot_p95=MS (milliseconds > 0)")
        out[key] = number / 1000.0
    if set(out) != {"ttft", "tpot"}:
        raise ValueError("--slo needs both ttft_p95=MS and tpot_p95=MS")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet plan",
        description="Search replicas, tensor parallelism, k and "
        "batch limits with the simulator; print the cheapest config meeting the SLO and "
        "the runner-up; write its InferenceService YAML.",
    )
    p.add_argument("--model", required=True, help="model source URI for the YAML (e.g. hf://meta-llama/...)")
    p.add_argument(
        "--profile",
        default=None,
        help="profile JSON, or roofline:HARDWARE[:MODEL] (an estimate; then TP is searched)",
    )
    add_workload_args(p)
    p.add_argument("--slo", required=True, help="ttft_p95=MS,tpot_p95=MS")
    p.add_argument(
        "--method", default="none", choices=SPECULATIVE_METHODS, help="speculative method for k > 0"
    )
    p.add_argument(
        "--ks", type=int, nargs="+", default=None, help="k values (default 0, or 0 2 4 with a method)"
    )
    p.add_argument("--seqs", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=None,
        help="tensor parallel degrees (default: those the profile covers: a roofline estimate 1 2 4 8 where "
        "the model splits and fits, a measured profile its own)",
    )
    p.add_argument("--max-replicas", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--exact", action="store_true", help="simulate every step with the scheduler (default: fast mode)"
    )
    p.add_argument("--out", default="planned-isvc.yaml", help="InferenceService YAML to write")
    p.add_argument(
        "--sim-out",
        default=None,
        help="directory for the cheapest config's simulation (summary.json, requests.jsonl, timeline.png; "
        "default: the YAML's name with -sim)",
    )
    return p


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _search(
    args: argparse.Namespace,
    profiles: dict[int, Profile],
    ks: list[int],
    requests: list[SimRequest],
    slo: dict[str, float],
) -> list[Found]:
    """Every (tp, k, seqs, tokens) of the grid that meets the SLO, each with its fewest replicas."""
    found: list[Found] = []
    for tp, profile in profiles.items():
        for k in ks:
            for seqs in args.seqs:
                for tokens in args.tokens:
                    if tokens < seqs:
                        continue
                    f = fewest_replicas(
                        profile,
                        args.model,
                        Candidate(k, seqs, tokens, tp),
                        args.method,
                        requests,
                        slo,
                        args.max_replicas,
                        args.max_model_len,
                        not args.exact,
                        _log,
                    )
                    if f is not None:
                        found.append(f)
    return found


def _figures(f: Found) -> dict[str, Any]:
    """A found config's figures as the plan prints them."""
    s = f.summary
    return {
        "config": f.candidate.short(),
        "replicas": f.replicas,
        "gpus": f.replicas * f.candidate.tp,
        "gpu_hours": round(f.gpu_seconds / 3600, 3),
        "ttft_p95_ms": round(s["p95_ttft_ms"], 1),
        "tpot_p95_ms": round(s["p95_tpot_ms"] or 0.0, 2),
        "throughput_tok_s": round(s["output_throughput"], 1),
        "slo_attainment": round(s["slo_attainment"], 3),
        "profile": s["profile"]["name"],
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        slo = parse_slo(args.slo)
        base = load_profile(args.profile)
        requests = workload_from_args(args)
        tps = sorted(set(args.tp)) if args.tp else list(tp_degrees(base))
        for tp in tps:
            problem = covers_tp(base, tp)
            if problem:
                raise ValueError(f"--tp {tp}: {problem}")
        ks = args.ks or ([0, 2, 4] if args.method != "none" else [0])
        profiles = {tp: at_tp(base, tp) for tp in tps}
        # every spec rule (parallelism, batching, speculation) checked before the search, not in it
        for tp in tps:
            load_inference_service(
                isvc_for(
                    args.model,
                    Candidate(max(ks), min(args.seqs), max(args.tokens), tp),
                    1,
                    args.method,
                    slo,
                    args.max_model_len,
                )
            )
    except (OSError, ValueError) as error:
        print(f"specfleet plan: {error}", file=sys.stderr)
        return 2
    if profiles[tps[0]].estimate:
        print(f"note: profile {base.name} is an ESTIMATE ({base.notes})", file=sys.stderr)

    _log(f"plan: searching tp={tps} k={ks} seqs={args.seqs} tokens={args.tokens}")
    found = _search(args, profiles, ks, requests, slo)
    if not found:
        print(
            f"specfleet plan: no config meets {args.slo} within {args.max_replicas} replicas", file=sys.stderr
        )
        return 1
    found.sort(key=rank)
    best = found[0]
    # configs that predict the same as the winner (a batch limit the workload never reaches) are its
    # equivalents, not a second choice: the runner-up is the next config that predicts something else
    equivalents = [f for f in found[1:] if predicted(f) == predicted(best)]
    runner = next((f for f in found[1:] if predicted(f) != predicted(best)), None)
    doc = isvc_for(args.model, best.candidate, best.replicas, args.method, slo, args.max_model_len)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(yaml.safe_dump(doc, sort_keys=False))
    sim_out = Path(args.sim_out or Path(args.out).with_suffix("").as_posix() + "-sim")
    run, _ = simulate_run(profiles[best.candidate.tp], doc, requests, slo, not args.exact)
    write(
        run,
        best.summary,
        sim_out,
        f"plan: {best.replicas} x ({best.candidate.short()}), profile {best.summary['profile']['name']}"
        + (" (estimate)" if best.summary["profile"]["estimate"] else ""),
    )

    result = {
        "best": _figures(best),
        "runner_up": _figures(runner) if runner else None,
        "equivalents": [f.candidate.short() for f in equivalents],
        "yaml": args.out,
        "sim_out": str(sim_out),
        "searched": {"tp": tps, "k": ks, "seqs": args.seqs, "tokens": args.tokens},
        "profile": base.name,
        "estimate": base.estimate,
    }
    print(
        f"cheapest: {result['best']}\n"
        + (f"  predicted the same: {', '.join(result['equivalents'])}\n" if equivalents else "")
        + f"runner-up: {result['runner_up']}\nwrote {args.out} and "
        f"{sim_out}/timeline.png" + ("\nnote: the profile is an ESTIMATE" if base.estimate else "")
    )
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
