"""`specfleet bench pp`: what pipeline parallelism's micro-batch overlap buys in decode throughput.

Three setups on the same model, each given the same batch of short prompts (`--seqs` sequences,
`--tokens` greedy tokens each, EOS ignored) under the same `--max-num-seqs` (default: half of --seqs):
one process (pp=1), two pipeline stages with one micro-batch in flight at a time (pp=2,
--no-pipeline-overlap), and two stages with one micro-batch per stage in flight (pp=2, overlap; the same
engine as the one before, its overlap switched between batches). With overlap each micro-batch takes up
to max_num_seqs sequences, so twice as many run at once (vLLM's virtual engines). Each setup runs `--runs`
timed batches after a warm-up batch, the setups taking turns; reported: output tokens per second (median
and all runs), and the overlap's ratio to no overlap.

On CPU each stage is a process sharing the cores: the overlap can only use cores the no-overlap run leaves
idle, so on a machine whose cores are taken by other work it cannot win; compare the ratio within one run.

Ends stdout with the JSON on one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from specfleet.engine import LLM, SamplingParams

BUNDLED = "bundled://smollm2-135m-instruct"
# Prompts of ~15 tokens plus --tokens: a small context keeps three engines' KV caches small in memory.
ENGINE_MAX_MODEL_LEN = 512
# name -> (engine, overlap): a process can hold one process group, so both pp=2 setups are one engine
# whose overlap is switched between batches.
SETUPS = {"pp1": ("pp1", False), "pp2_no_overlap": ("pp2", False), "pp2_overlap": ("pp2", True)}
ENGINES = {"pp1": dict(pipeline_parallel_size=1), "pp2": dict(pipeline_parallel_size=2)}


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a clock", "winter", "bread", "a library", "trains", "the moon", "gardens"]
    return [f"Write a short note about {topics[i % len(topics)]} number {i}." for i in range(n)]


def measure(model: str, setups: list[str], seqs: int, tokens: int, runs: int, max_num_seqs: int) -> dict:
    """Every setup's engine is started first; the timed batches then take turns (run 1 of each setup, run 2
    of each, ...), so a change in the machine's load reaches all setups alike."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = _prompts(seqs)
    engines: dict[str, LLM] = {}
    rates: dict[str, list[float]] = {name: [] for name in setups}
    peaks: dict[str, int] = {}
    try:
        for engine in sorted({SETUPS[name][0] for name in setups}):
            engines[engine] = LLM(
                model=model, max_model_len=ENGINE_MAX_MODEL_LEN, max_num_seqs=max_num_seqs, **ENGINES[engine]
            )
            engines[engine].generate(prompts, params)  # warm-up: native kernels, first allocations
        for _ in range(runs):
            for name in setups:
                engine, overlap = SETUPS[name]
                llm = engines[engine]
                llm.engine.set_pipeline_overlap(overlap)
                llm.engine.stats.peak_micro_batches_in_flight = 0
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - start
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                print(f"{name}: {rates[name][-1]:.2f} tok/s", flush=True)
                peaks[name] = llm.engine.stats.peak_micro_batches_in_flight
    finally:
        for llm in engines.values():
            llm.close()
    return {
        name: {
            "tok_per_s_median": round(statistics.median(r), 2),
            "tok_per_s_runs": [round(x, 2) for x in r],
            "peak_micro_batches_in_flight": peaks[name],
        }
        for name, r in rates.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specfleet bench pp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=BUNDLED)
    ap.add_argument("--seqs", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per sequence")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="every engine's (default: half of --seqs)")
    ap.add_argument("--runs", type=int, default=3, help="timed batches per engine (median reported)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    args = ap.parse_args(argv)
    result: dict = {
        "model": args.model,
        "seqs": args.seqs,
        "tokens": args.tokens,
        "runs": args.runs,
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }
    max_num_seqs = args.max_num_seqs or max(1, args.seqs // 2)
    result["max_num_seqs"] = max_num_seqs
    result.update(
        measure(args.model, args.setups.split(","), args.seqs, args.tokens, args.runs, max_num_seqs)
    )
    if "pp2_overlap" in result and "pp2_no_overlap" in result:
        result["overlap_speedup"] = round(
            result["pp2_overlap"]["tok_per_s_median"] / result["pp2_no_overlap"]["tok_per_s_median"], 3
        )
    result["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    main()
