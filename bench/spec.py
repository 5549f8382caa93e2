"""`specfleet bench spec`: speculative decoding speedup by method, k and load, in one run.

Workloads: input-grounded (repeat, edit or summarise a given passage or code: the output copies the
input) and free chat. For each declared method (engine/spec_decode/methods.py; one that needs a draft model
unless --draft-model none) and k in --ks, it runs
the workload at concurrency 1 (one request at a time) and at --high-concurrency (all at once), and
reports per-request output tokens/s (end to end: output tokens over the request's latency, prefill
included; speedups use this one), per-request decode tokens/s (after the first token: what speculation
acts on) and acceptance. The default draft is the target's own weights quantized to int8. k=0 on an engine with a method configured is also
compared with an engine that never configured speculation (k0_overhead_pct).
Prints a table, writes JSON and a PNG beside it, and ends stdout with the JSON on one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specfleet.bench.prompts import chat_prompts, grounded_prompts
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.spec_decode.methods import METHODS


def run(
    llm: LLM, prompts: list[str], k: int, concurrency: int, max_tokens: int, ignore_eos: bool = False
) -> dict:
    """Per-request tokens/s (output tokens over the request's own latency) and acceptance.

    Requests stop at EOS by default: a grounded answer ends when the copied passage does, and tokens
    forced past EOS are unrelated free text that would measure chat instead. Greedy output does not
    depend on k, so every k generates the same tokens."""
    engine = llm.engine
    stats = engine.stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, num_speculative_tokens=k
    )
    rates, decode_rates, total_tokens, start_all = [], [], 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        wave = prompts[i : i + concurrency]
        started = time.perf_counter()
        results = llm.chat([[{"role": "user", "content": p}] for p in wave], params)
        elapsed = time.perf_counter() - started
        for r in results:
            n = len(r.outputs[0].token_ids)
            total_tokens += n
            m = r.metrics
            finished = (m.finished_time - m.arrival_time) if m and m.finished_time is not None else elapsed
            rates.append(n / max(finished, 1e-9))
            if m and m.finished_time is not None and m.first_token_time and n > 1:
                decode_rates.append((n - 1) / max(m.finished_time - m.first_token_time, 1e-9))
    drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    return {
        "tok_s_per_request": statistics.median(rates),
        "decode_tok_s_per_request": statistics.median(decode_rates) if decode_rates else None,
        "throughput_tok_s": total_tokens / (time.perf_counter() - start_all),
        "acceptance_rate": accepted / drafted if drafted else None,
    }


def sweep(
    llm: LLM,
    prompts: list[str],
    ks: list[int],
    concurrency: int,
    max_tokens: int,
    repeats: int,
    ignore_eos: bool,
    **labels,
) -> list[dict]:
    """Every k `repeats` times, the order of k reversed on each pass so drift on a shared machine
    falls on all k alike; per k, the median of each figure over the passes."""
    runs: dict[int, list[dict]] = {k: [] for k in ks}
    for rep in range(repeats):
        for k in ks if rep % 2 == 0 else ks[::-1]:
            runs[k].append(run(llm, prompts, k, concurrency, max_tokens, ignore_eos))
    rows = []
    for k in ks:
        row = {**labels, "k": k, "concurrency": concurrency}
        for key in runs[k][0]:
            vals = [r[key] for r in runs[k] if r[key] is not None]
            row[key] = statistics.median(vals) if vals else None
        print(
            f"{labels['method']:6} {labels['workload']:9} k={k} conc={concurrency:3} "
            f"{row['tok_s_per_request']:8.2f} tok/s/req acceptance={row['acceptance_rate']}",
            file=sys.stderr,
        )
        rows.append(row)
    return rows


def method_kwargs(draft_model: str, draft_quantization: str) -> dict[str, dict[str, str | None]]:
    """Every declared method's LLM keyword arguments; a method that needs a draft model gets --draft-model
    (and is skipped with 'none')."""
    methods: dict[str, dict[str, str | None]] = {}
    for spec in METHODS.values():
        if not spec.needs_draft_model:
            methods[spec.name] = {"speculative_method": spec.name}
        elif draft_model != "none":
            methods[spec.name] = {
                "speculative_method": spec.name,
                "draft_model": draft_model,
                "draft_quantization": None if draft_quantization == "none" else draft_quantization,
            }
    return methods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfleet bench spec", description=__doc__)
    parser.add_argument("--model", default="bundled://smollm2-135m-instruct")
    parser.add_argument(
        "--draft-model",
        default="bundled://smollm2-135m-instruct",
        help="the draft model source, or 'none' to skip the draft method",
    )
    parser.add_argument(
        "--draft-quantization", default="int8", help="int8, or 'none' for the draft as stored"
    )
    parser.add_argument("--ks", default="0,2,4,8")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per workload at concurrency 1")
    parser.add_argument("--high-concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--high-max-tokens", type=int, default=48)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate max tokens past EOS (the tail is then free text, not the task)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="sweeps over k per cell, alternating the order of k (medians are reported)",
    )
    parser.add_argument("--out", default="bench/results/spec.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    workloads = {"grounded": grounded_prompts(), "chat": chat_prompts()}
    methods = method_kwargs(args.draft_model, args.draft_quantization)

    rows = []
    for method, kwargs in methods.items():
        llm = LLM(
            model=args.model,
            num_speculative_tokens=max(ks),
            max_num_speculative_tokens=max(8, max(ks)),
            max_num_seqs=max(64, args.high_concurrency),
            **kwargs,
        )
        for workload, prompts in workloads.items():
            run(llm, prompts[: args.num_prompts], 0, args.high_concurrency, 16)  # warm up: fault in KV pages
            for conc in (1, args.high_concurrency):
                sample = prompts[: args.num_prompts] if conc == 1 else (prompts * conc)[:conc]
                tokens = args.max_tokens if conc == 1 else args.high_max_tokens
                rows.extend(
                    sweep(
                        llm,
                        sample,
                        ks,
                        conc,
                        tokens,
                        args.repeats,
                        args.ignore_eos,
                        method=method,
                        workload=workload,
                    )
                )
        del llm
    # k=0 against an engine that never configured speculation: both loaded, runs alternated.
    plain, ngram_k0 = (
        LLM(model=args.model),
        LLM(model=args.model, speculative_method="ngram", num_speculative_tokens=0),
    )
    sample = workloads["grounded"][: args.num_prompts]
    base, k0 = [], []
    for _ in range(max(3, args.repeats)):
        base.append(run(plain, sample, 0, 1, args.max_tokens, args.ignore_eos)["tok_s_per_request"])
        k0.append(run(ngram_k0, sample, 0, 1, args.max_tokens, args.ignore_eos)["tok_s_per_request"])
    del plain, ngram_k0

    result = {
        **{f"{m}_{w}_speedup": _speedup(rows, m, w, 1) for m in METHODS for w in workloads},
        "high_load_speedup": max(
            filter(None, [_speedup(rows, m, w, args.high_concurrency) for m in methods for w in workloads])
        ),
        "acceptance_rate": {f"{m}_{w}": _acceptance(rows, m, w) for m in methods for w in workloads},
        "k0_overhead_pct": 100.0 * (statistics.median(base) / statistics.median(k0) - 1),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(rows, ks, out.with_suffix(".png"))
    print(json.dumps(result))
    return 0


def _speedup(rows: list[dict], method: str, workload: str, conc: int) -> float | None:
    """The best k's tokens per second per request over k=0's, for one method, workload and concurrency."""
    sel = [
        r for r in rows if r["method"] == method and r["workload"] == workload and r["concurrency"] == conc
    ]
    if not sel:
        return None
    zero = next(r for r in sel if r["k"] == 0)["tok_s_per_request"]
    return max(r["tok_s_per_request"] for r in sel) / zero


def _acceptance(rows: list[dict], method: str, workload: str) -> float | None:
    """The median acceptance rate of one method on one workload at concurrency 1."""
    vals = [
        r["acceptance_rate"]
        for r in rows
        if r["method"] == method
        and r["workload"] == workload
        and r["acceptance_rate"] is not None
        and r["concurrency"] == 1
    ]
    return statistics.median(vals) if vals else None


def plot(rows: list[dict], ks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = sorted({(r["method"], r["workload"], r["concurrency"]) for r in rows})
    for method, workload, conc in series:
        sel = {
            r["k"]: r["tok_s_per_request"]
            for r in rows
            if (r["method"], r["workload"], r["concurrency"]) == (method, workload, conc)
        }
        base = sel.get(0) or 1.0
        ax.plot(
            ks,
            [sel[k] / base for k in ks],
            marker="o",
            linestyle="-" if conc == 1 else "--",
            label=f"{method} / {workload} / concurrency {conc}",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("speculative tokens k")
    ax.set_ylabel("per-request tokens/s vs k=0")
    ax.set_title("Speculative decoding speedup by k and load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
