"""`specfleet bench lora`: many LoRA adapters on one engine (issue 38, item 6), in one process.

- Output tok/s at concurrency 32 (`--concurrency`) with the requests spread round-robin over 1, 4, 8 and 16
  random rank-16 adapters (PEFT's format, PEFT's default targets q_proj and v_proj unless
  `--target-modules`), against the base model alone on the same requests.
- Against one merged-weight engine per adapter on the same cores: such an engine runs the base's kernels on
  weights of the base's shapes, so its speed is the base's at its share of the concurrency (32 / 8 = 4
  sequences); the 8 engines share the cores one after another (time-sharing, no contention between them,
  and each would hold a whole copy of the model: 8x the memory, not counted against them). Goodput per core
  ratio = the LoRA engine's tok/s at 8 adapters over the merged engines' total, on the same cores.
- Adapter load time at rank 16 (file read, checks, fused layout; median of `--load-repeats`).
- `--cycles` load/unload cycles while requests run (a step between each), with resident memory before and
  after (the first tenth of the cycles warm the allocator first).

Each figure is the median of `--repeats` runs. Prints a table and ends stdout with the JSON on one line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from specfleet.bench.lora_adapters import resident_bytes, write_adapter
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.lora.adapter import TARGETS, ModelShape

ADAPTER_COUNTS = (1, 4, 8, 16)


def _requests(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(n)]


def _once(
    llm: LLM, prompts: list[list[int]], names: list[str | None], output_len: int
) -> tuple[float, float]:
    """One run: output tokens per wall second and per CPU second of this process (every thread)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    results = llm.generate(prompts, params, lora_name=names, use_tqdm=False)
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def _throughputs(llm: LLM, args: argparse.Namespace, counts: list[int]) -> dict[str, float]:
    """Every configuration once per round, `--repeats` rounds, so that the host's load swings reach each
    alike; the medians. The merged engines' share: 1 / merged_at of the requests at 1 / merged_at of the
    concurrency, on the base weights (a merged engine runs the same kernels on weights of the same shapes)."""
    prompts = _requests(args.num_requests, args.prompt_len)
    share = max(1, len(prompts) // args.merged_at)
    configs: dict[str, tuple[list[list[int]], list[str | None], int]] = {
        "base": (prompts, [None] * len(prompts), args.concurrency)
    }
    for n in sorted(set(counts) | {args.merged_at}):
        configs[f"{n}_adapters"] = (prompts, [f"a{i % n}" for i in range(len(prompts))], args.concurrency)
    configs["merged_engines"] = (prompts[:share], [None] * share, max(1, args.concurrency // args.merged_at))
    runs: dict[str, list[tuple[float, float]]] = {key: [] for key in configs}
    for round_ in range(args.repeats):
        for key, (batch, names, seqs) in configs.items():
            llm.engine.update_config(max_num_seqs=seqs)
            runs[key].append(_once(llm, batch, names, args.output_len))
            print(
                f"bench lora: round {round_ + 1} {key} {runs[key][-1][0]:.2f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    llm.engine.update_config(max_num_seqs=args.concurrency)
    out = {}
    for key, values in runs.items():
        out[f"tok_s_{key}"] = statistics.median(v[0] for v in values)
        out[f"tok_per_cpu_s_{key}"] = statistics.median(v[1] for v in values)
    return out


def _progress(result: dict, key: str) -> None:
    print(f"bench lora: {key} = {result[key]:.3f}", file=sys.stderr, flush=True)


def _kernel_us(shape: ModelShape, folders: list[Path], rows: int, repeats: int = 20) -> dict[str, float]:
    """One projection's deltas for `rows` rows spread over the adapters, the native kernel against its
    torch reference (the per-adapter gather, two matmuls and scatter it replaces): microseconds, medians."""
    from specfleet.engine.lora.adapter import read_adapter
    from specfleet.kernels import cpu_lora

    adapters = [read_adapter(f"k{i}", f, shape, 64) for i, f in enumerate(folders)]
    proj = next(iter(adapters[0].layers[0]))
    weights = [a.layers[0][proj] for a in adapters]
    groups = cpu_lora.RowGroups.of([list(range(i, rows, len(adapters))) for i in range(len(adapters))])
    x = torch.randn(rows, weights[0].a_t.shape[0])
    y = torch.zeros(rows, weights[0].b_t.shape[1])
    runs: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(repeats):
        for name, call in (
            ("native", lambda: cpu_lora.lora_add(y, x, groups, [w.desc for w in weights])),
            ("torch", lambda: cpu_lora.lora_add_reference(y, x, groups, [(w.a_t, w.b_t) for w in weights])),
        ):
            start = time.perf_counter()
            call()
            runs[name].append((time.perf_counter() - start) * 1e6)
    return {f"kernel_us_{proj}_{name}": statistics.median(v) for name, v in runs.items()}


def _load_ms(llm: LLM, folder: Path, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.engine.load_lora_adapter("load-probe", str(folder))
        runs.append((time.perf_counter() - start) * 1000)
        llm.engine.unload_lora_adapter("load-probe")
    return statistics.median(runs)


def _cycles(llm: LLM, folder: Path, adapters: list[str], cycles: int, prompt_len: int) -> dict[str, float]:
    """`cycles` load/unload cycles of one adapter with a step of running requests between each."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = iter(_requests(10**6, prompt_len, seed=2))
    count = 0

    def top_up() -> None:
        nonlocal count
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < len(adapters):
            engine.add_request(
                f"cycle-{count}", next(prompts), params, lora_name=adapters[count % len(adapters)]
            )
            count += 1

    warm = max(1, cycles // 10)
    before = 0
    start = time.perf_counter()
    for i in range(warm + cycles):
        if i == warm:
            before, start = resident_bytes(), time.perf_counter()
        top_up()
        engine.load_lora_adapter("cycle", str(folder))
        engine.step()
        engine.unload_lora_adapter("cycle")
        engine.step()
    after, elapsed = resident_bytes(), time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "cycles": cycles,
        "cycle_ms": elapsed / cycles * 1000,
        "rss_before_mb": before / 2**20,
        "rss_after_mb": after / 2**20,
        "rss_growth_pct": 100.0 * (after - before) / before,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specfleet bench lora", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bundled://smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=32, help="sequences per step (max_num_seqs)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per throughput run")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--target-modules", default="q_proj,v_proj", help="comma-separated (PEFT's default)")
    p.add_argument("--adapters", default=",".join(map(str, ADAPTER_COUNTS)), help="adapter counts to run")
    p.add_argument("--merged-at", type=int, default=8, help="adapters of the merged-engines comparison")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is reported)")
    p.add_argument("--load-repeats", type=int, default=10)
    p.add_argument("--cycles", type=int, default=1000, help="load/unload cycles under load")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", default="bench/results/lora.json")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    counts = [int(c) for c in args.adapters.split(",")]
    most = max(counts + [args.merged_at])
    llm = LLM(
        model=args.model,
        max_num_seqs=args.concurrency,
        max_model_len=args.max_model_len,
        enable_lora=True,
        max_loras=most + 1,  # + 1: the load/unload cycles' adapter beside the traffic's
        max_lora_rank=max(args.rank, 16),
    )
    shape = ModelShape.of(llm.engine.runner.model.args)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    modules = args.target_modules.split(",")
    folders = [write_adapter(root / f"a{i}", shape, args.rank, modules, seed=i) for i in range(most)]
    for i, folder in enumerate(folders):
        llm.engine.load_lora_adapter(f"a{i}", str(folder))
    _once(llm, [[1, 2, 3]] * 2, [None, "a0"], 4)  # warm up both paths
    result: dict = {"model": args.model, "threads": torch.get_num_threads(), "rank": args.rank}
    result.update(
        {"target_modules": modules, "concurrency": args.concurrency, "num_requests": args.num_requests}
    )
    result.update(_kernel_us(shape, folders[: args.merged_at], args.concurrency))
    result.update(_throughputs(llm, args, counts))
    base = result["tok_s_base"]
    for n in sorted(set(counts) | {args.merged_at}):
        result[f"throughput_ratio_{n}_adapters_vs_base"] = result[f"tok_s_{n}_adapters"] / base
    merged = result["tok_s_merged_engines"]
    result["goodput_per_core_ratio_vs_merged_engines"] = result[f"tok_s_{args.merged_at}_adapters"] / merged
    result["load_ms_rank16"] = _load_ms(llm, folders[0], args.load_repeats)
    _progress(result, "load_ms_rank16")
    every = write_adapter(root / "every", shape, args.rank, list(TARGETS), seed=most)  # all 7 projections
    result["load_ms_rank16_every_projection"] = _load_ms(llm, every, args.load_repeats)
    _progress(result, "load_ms_rank16_every_projection")
    traffic = [f"a{i}" for i in range(min(most, args.merged_at))]
    result["load_unload"] = _cycles(llm, folders[-1], traffic, args.cycles, args.prompt_len)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    print(f"{'adapters':>9} {'tok/s':>9} {'vs base':>8}", file=sys.stderr)
    print(f"{'base':>9} {result['tok_s_base']:>9.1f} {1.0:>8.2f}", file=sys.stderr)
    for n in (int(c) for c in args.adapters.split(",")):
        tok_s, ratio = result[f"tok_s_{n}_adapters"], result[f"throughput_ratio_{n}_adapters_vs_base"]
        print(f"{n:>9} {tok_s:>9.1f} {ratio:>8.2f}", file=sys.stderr)
    print(
        f"merged engines ({args.merged_at}, time-shared): {result['tok_s_merged_engines']:.1f} tok/s; "
        f"goodput per core ratio {result['goodput_per_core_ratio_vs_merged_engines']:.2f}; "
        f"load {result['load_ms_rank16']:.1f} ms; cycles {result['load_unload']}",
        file=sys.stderr,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
