"""`specfleet bench offline`: the engine against Hugging Face transformers, in one process, same prompts.

Throughput: a deterministic mix of prompt lengths 16-512 and output lengths 16-256 (greedy, ignore_eos);
transformers runs static batches of 16 padded on the left, the engine gets every request at once.
Single stream: one request, 256 new tokens, both. Both count only the tokens each request asked for.
Prints a table, writes JSON and a PNG beside it, and ends stdout with the JSON on one line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.model_source import resolve_model


def workload(num_prompts: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 40000) for _ in range(rng.randint(16, 512))], rng.randint(16, 256))
        for _ in range(num_prompts)
    ]


def run_engine(llm: LLM, requests: list[tuple[list[int], int]]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    results = llm.generate([p for p, _ in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.outputs[0].token_ids) for r in results)


@torch.inference_mode()
def run_hf(model, requests: list[tuple[list[int], int]], batch_size: int) -> tuple[float, int]:
    from tqdm import tqdm

    start, useful = time.perf_counter(), 0
    for i in tqdm(range(0, len(requests), batch_size), desc="transformers"):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        steps = max(n for _, n in batch)
        model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=0,
        )
        useful += sum(n for _, n in batch)
    return time.perf_counter() - start, useful


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    groups = ["throughput (mixed batch)", "single stream"]
    engine = [result["engine_tok_s"], result["engine_single_stream_tok_s"]]
    hf = [result["hf_tok_s"], result["hf_single_stream_tok_s"]]
    xs = range(len(groups))
    ax.bar([x - 0.2 for x in xs], engine, width=0.4, label="specfleet engine")
    ax.bar([x + 0.2 for x in xs], hf, width=0.4, label="transformers")
    for x, e, h in zip(xs, engine, hf):
        ax.text(x - 0.2, e, f"{e:.0f}", ha="center", va="bottom")
        ax.text(x + 0.2, h, f"{h:.0f}", ha="center", va="bottom")
    ax.set_xticks(list(xs), groups)
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"{result['model']} on {result['threads']} CPU threads: ratios "
        f"{result['throughput_ratio']:.2f}x / {result['single_stream_ratio']:.2f}x"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet bench offline", description=__doc__)
    parser.add_argument("--model", default="bundled://smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--single-stream-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf", action="store_true", help="engine only (no ratios)")
    parser.add_argument(
        "--quantization", default=None, help="as `serve --quantization` (gguf: a GGUF file's own blocks)"
    )
    parser.add_argument("--out", default="bench/results/offline.json")
    args = parser.parse_args(argv)

    requests = workload(args.num_prompts)
    single = [(workload(1, seed=1)[0][0][:64], args.single_stream_tokens)]
    llm = LLM(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
    )
    run_engine(llm, [(p[:32], 8) for p, _ in requests[:4]])  # warm up
    llm.engine.stats.peak_kv_slots_allocated = llm.engine.stats.peak_kv_slots_used = 0
    engine_s, engine_tokens = run_engine(llm, requests)
    stats = llm.engine.stats
    waste = 100.0 * (1 - stats.peak_kv_slots_used / max(1, stats.peak_kv_slots_allocated))
    single_s, single_tokens = run_engine(llm, single)
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "engine_tok_s": engine_tokens / engine_s,
        "engine_single_stream_tok_s": single_tokens / single_s,
        "kv_waste_pct": waste,
        "engine_preemptions": stats.num_preemptions,
    }
    del llm
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            resolve_model(args.model).path, dtype=torch.float32
        ).eval()
        model.generation_config.eos_token_id = None
        hf_s, hf_tokens = run_hf(model, requests, args.hf_batch_size)
        hf_single_s, hf_single_tokens = run_hf(model, single, 1)
        result.update(
            {
                "hf_tok_s": hf_tokens / hf_s,
                "hf_single_stream_tok_s": hf_single_tokens / hf_single_s,
            }
        )
        result["throughput_ratio"] = result["engine_tok_s"] / result["hf_tok_s"]
        result["single_stream_ratio"] = (
            result["engine_single_stream_tok_s"] / result["hf_single_stream_tok_s"]
        )

    print(f"\n{'':28}{'engine':>12}{'transformers':>14}{'ratio':>8}")
    for label, e, h in (
        ("throughput tok/s", "engine_tok_s", "hf_tok_s"),
        ("single stream tok/s", "engine_single_stream_tok_s", "hf_single_stream_tok_s"),
    ):
        hv = result.get(h)
        ratio = f"{result[e] / hv:8.2f}" if hv else ""
        print(f"{label:28}{result[e]:12.1f}{hv or float('nan'):14.1f}{ratio}")
    print(f"{'KV waste at peak (%)':28}{waste:12.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if not args.skip_hf:
        plot(result, out.with_suffix(".png"))
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
