"""`specfleet bench architectures`: decode speed of every architecture against Llama's at one parameter count,
in one process, the architectures alternating so that host noise reaches each alike (issue 37, item 5):

    specfleet bench architectures --hidden 512 --layers 8 --rounds 5

Writes random-weight checkpoints of one shape (bench/random_checkpoint.py: llama, qwen3, phi3, gemma2,
gemma3, and mixtral with 8 experts, top 2, beside `dense`, a Llama whose MLP is as wide as Mixtral's two
active experts) into a temporary folder, loads each in an engine, warms each up, then runs `--rounds`
rounds; every round runs each architecture's c1 (one request) and c32 (`--concurrency` requests at once)
decode, each round starting one architecture further down the list. Greedy, ignore_eos, prompts of
`--prompt-tokens` random ids (new ones each round, the same for every architecture in a round).
`--quantization int8` quantizes every engine's weights at load (Mixtral's experts as the dense MLPs): a
c32 step streams every expert's weights, so MoE's cost against its dense twin depends on the bytes a
weight takes.

A decode rate is the tokens after each request's first over the time from the step that gave the first of
them to the step that gave the last (the engine's own RequestMetrics): prefill is left out. Prints
progress on stderr and one JSON line on stdout: per architecture the rates of every round and their
medians, `ratio_c1` and `ratio_c32` (each architecture's median over llama's), and
`moe_c32_ratio_vs_dense_active` (mixtral's c32 median over dense's), with the goals (0.85 and 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# The architectures in the order a round runs them; `dense` is the Llama Mixtral's speed is judged against.
ARCHES = ("llama", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "dense")
# Judged against llama at the same parameter count (issue 37 item 5); mixtral against dense.
AGAINST_LLAMA = ("qwen3", "phi3", "gemma2", "gemma3")
DENSE_RATIO_GOAL = 0.85  # "within 15% of the Llama path"
MOE_RATIO_GOAL = 0.8  # "MoE at c32 ... at least 0.8x of a dense model with the same active parameters"
# Each engine's KV cache: c32 x (16 + 32) tokens of an 8-layer model with 4 KV heads of 64 is ~25 MiB, and
# seven engines live at once; 2 GiB each (the CPU default) would take 14 GiB of the host for nothing.
KV_CACHE_GIB = 0.25


def checkpoint_args(arch: str, hidden: int) -> tuple[str, int | None]:
    """(random_checkpoint --arch, --intermediate) of each entry: `dense` is a Llama whose MLP is as wide as
    Mixtral's two active experts of 3 x hidden (the same active parameters)."""
    if arch == "dense":
        from specfleet.bench.random_checkpoint import MOE_TOP_K

        return "llama", MOE_TOP_K * 3 * hidden
    return arch, None


def decode_rate(outputs: Sequence) -> float:
    """Tokens after each request's first, per second from the earliest first token to the latest last one."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    first = min(o.metrics.first_token_time for o in outputs)
    last = max(o.metrics.last_token_time for o in outputs)
    if tokens <= 0 or last <= first:
        raise ValueError(f"no decode to time: {tokens} tokens after the first, over {last - first:.6f} s")
    return tokens / (last - first)


def summarize(rates: dict[str, dict[str, list[float]]]) -> dict:
    """The JSON's figures from each architecture's per-round rates {arch: {"c1": [...], "c32": [...]}}:
    medians, and every ratio as one median over another."""
    medians = {arch: {c: statistics.median(v) for c, v in runs.items()} for arch, runs in rates.items()}
    out: dict = {"tok_s": rates, "median_tok_s": medians}
    if "llama" in medians:
        for c in ("c1", "c32"):
            out[f"ratio_{c}"] = {
                arch: medians[arch][c] / medians["llama"][c] for arch in AGAINST_LLAMA if arch in medians
            }
    if "mixtral" in medians and "dense" in medians:
        for c in ("c1", "c32"):
            out[f"moe_{c}_ratio_vs_dense_active"] = medians["mixtral"][c] / medians["dense"][c]
    met = {
        arch: min(out["ratio_c1"][arch], out["ratio_c32"][arch]) >= DENSE_RATIO_GOAL
        for arch in out.get("ratio_c1", {})
    }
    if "moe_c32_ratio_vs_dense_active" in out:
        met["mixtral"] = out["moe_c32_ratio_vs_dense_active"] >= MOE_RATIO_GOAL
    out["goal"] = {"ratio_min": DENSE_RATIO_GOAL, "moe_c32_ratio_min": MOE_RATIO_GOAL, "met": met}
    return out


def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(tokens)] for _ in range(n)]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, workdir: Path) -> dict:
    from specfleet.bench.random_checkpoint import write_checkpoint
    from specfleet.engine import LLM, SamplingParams

    start, load_start = time.perf_counter(), os.getloadavg()[0]
    params: dict[str, int] = {}
    engines: dict[str, LLM] = {}
    for arch in args.archs:
        kind, intermediate = checkpoint_args(arch, args.hidden)
        path = workdir / arch
        params[arch] = write_checkpoint(kind, args.hidden, args.layers, path, intermediate)
        engines[arch] = LLM(
            model=f"file://{path}",
            max_num_seqs=max(args.concurrency, 1),
            kv_cache_gib=KV_CACHE_GIB,  # the model's own context (2048): Gemma's window (512) gets its pool
            quantization=args.quantization,
        )
        _log(f"{arch}: {params[arch] / 1e6:.2f}M parameters, loaded")
    c1 = SamplingParams(temperature=0, max_tokens=args.c1_tokens, ignore_eos=True)
    c32 = SamplingParams(temperature=0, max_tokens=args.c32_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in engines.values():  # the first steps of an engine pay for allocations and caches
        llm.generate(_prompts(args.concurrency, args.prompt_tokens, seed=-1), warm)
    rates: dict[str, dict[str, list[float]]] = {arch: {"c1": [], "c32": []} for arch in engines}
    order = list(engines)
    for r in range(args.rounds):
        one = _prompts(1, args.prompt_tokens, seed=2 * r)
        many = _prompts(args.concurrency, args.prompt_tokens, seed=2 * r + 1)
        for arch in order[r % len(order) :] + order[: r % len(order)]:
            rates[arch]["c1"].append(decode_rate(engines[arch].generate(one, c1)))
            rates[arch]["c32"].append(decode_rate(engines[arch].generate(many, c32)))
            _log(
                f"round {r + 1}/{args.rounds} {arch}: c1 {rates[arch]['c1'][-1]:.1f} tok/s, "
                f"c{args.concurrency} {rates[arch]['c32'][-1]:.1f} tok/s"
            )
    for llm in engines.values():
        llm.close()
    return {
        "bench": "architectures",
        "hidden": args.hidden,
        "layers": args.layers,
        "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens,
        "c1_new_tokens": args.c1_tokens,
        "c32_new_tokens": args.c32_tokens,
        "c32_concurrency": args.concurrency,
        "quantization": args.quantization,
        "params": params,
        **summarize(rates),
        "load_avg_1m": [load_start, os.getloadavg()[0]],
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet bench architectures", description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="the medians' sample count per architecture")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--c1-tokens", type=int, default=64, help="new tokens of the one c1 request")
    parser.add_argument("--c32-tokens", type=int, default=32, help="new tokens of each c32 request")
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once in the 'c32' runs")
    parser.add_argument("--archs", nargs="+", choices=ARCHES, default=list(ARCHES), metavar="ARCH")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument(
        "--quantization",
        choices=("int8",),
        help="every engine's weights quantized at load (default: float32, as the checkpoints are written)",
    )
    args = parser.parse_args(argv)
    for name in ("rounds", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    for name in ("c1_tokens", "c32_tokens"):
        if getattr(args, name) < 2:
            parser.error(
                f"--{name.replace('_', '-')} must be >= 2 (a decode rate needs tokens after the first)"
            )
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="specfleet-archs-") as tmp:
            result = run(args, Path(tmp))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
