"""KV bytes per token of one Gemma 3 sequence at a long context, its sliding layers keeping only their window,
against the all-global figure (every layer keeping every token, as before the sliding pool):

    specfleet bench gemma-kv --context 8192 --window 1024

The checkpoint has Gemma 3 1B's KV shape (26 layers, five sliding per global one, one KV head of 256) with
random weights and a narrow hidden size, MLP and attention (one query head by default): the KV the engine
holds depends only on the layers, KV heads, head size, window and block size, and the rest only costs
time on the host. One request of `context - 1` prompt tokens runs through the engine in chunks of
`--chunk` tokens; after each step the blocks its sequence holds in each pool are counted, and the bytes are
those blocks' K and V in every layer of their pool (the engine's dtype, float32 on the CPU), read when
the sequence holds `context` tokens (its prompt computed, the first token sampled). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Gemma 3 1B's attention shape (its config.json): what the KV per token depends on
LAYERS, KV_HEADS, HEAD_DIM, SLIDING_PER_GLOBAL = 26, 1, 256, 5


def write_checkpoint(path: Path, window: int, context: int, hidden: int, heads: int) -> None:
    import torch
    from specfleet.engine.model_source import resolve_model
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=49152,  # the bundled tokenizer's
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=window,
        layer_types=[
            "full_attention" if (i + 1) % (SLIDING_PER_GLOBAL + 1) == 0 else "sliding_attention"
            for i in range(LAYERS)
        ],
        max_position_embeddings=context + 64,
        architectures=["Gemma3ForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer = resolve_model("bundled://smollm2-135m-instruct").path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)


def measure(url: str, context: int, block_size: int, chunk: int) -> dict:
    from specfleet.engine.block_manager import NULL_BLOCK
    from specfleet.engine.llm_engine import Engine
    from specfleet.engine.sampling_params import SamplingParams

    engine = Engine(
        model=url,
        block_size=block_size,
        max_model_len=context + block_size,  # room for the token after the one at `context`
        max_num_seqs=1,
        max_num_seqs_limit=1,
        max_num_batched_tokens=chunk,
        max_num_batched_tokens_limit=chunk,
        enable_prefix_caching=False,
    )
    kv, runner = engine.kv, engine.runner
    assert kv.sliding is not None and runner.sliding is not None, (
        "the sliding layers have no pool of their own"
    )
    # bytes of one block in each pool: K and V of every layer whose cache is that pool's
    per_block = {"full": 0, "sliding": 0}
    for layer, (k, v) in enumerate(runner.kv_caches):
        pool = "sliding" if layer in runner.sliding.layers else "full"
        per_block[pool] += (k[0].numel() + v[0].numel()) * k.element_size()
    all_global = per_block["full"] + per_block["sliding"]  # one block of every layer

    prompt = [(31 * i + 7) % 49000 + 100 for i in range(context - 1)]
    engine.add_request("kv", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seq = engine.scheduler.waiting.peek()
    held: dict[str, int] = {}
    peak_sliding, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        if seq.is_finished:
            break
        sliding = sum(b != NULL_BLOCK for b in seq.sliding_table)
        peak_sliding = max(peak_sliding, sliding)
        held = {"tokens": seq.num_tokens, "full": len(seq.block_table), "sliding": sliding}
    seconds = time.perf_counter() - start
    tokens = held["tokens"]
    hybrid = held["full"] * per_block["full"] + held["sliding"] * per_block["sliding"]
    everything = held["full"] * all_global  # the same table in every layer: what the engine held before
    ideal = tokens * all_global // block_size  # every layer, every token, no partial block
    capacity = _capacity(engine, context, block_size, all_global)
    engine.close()
    return {
        "context_tokens": tokens,
        "block_size": block_size,
        "dtype": str(runner.kv_caches[0][0].dtype).removeprefix("torch."),
        "blocks_held": {"full": held["full"], "sliding": held["sliding"]},
        "peak_sliding_blocks_between_steps": peak_sliding,
        "kv_bytes": hybrid,
        "kv_bytes_per_token": round(hybrid / tokens, 1),
        "all_global_kv_bytes": everything,
        "all_global_bytes_per_token": round(everything / tokens, 1),
        "all_global_ideal_bytes_per_token": round(ideal / tokens, 1),
        "ratio": round(hybrid / everything, 4),
        "pool_blocks": {"full": kv.num_blocks, "sliding": kv.sliding.num_blocks},
        "prefill_seconds": round(seconds, 1),
        f"sequences_of_{context}_in_{CAPACITY_GIB:g}_gib": capacity,
    }


# The CPU engine's default KV budget (engine/loader.py DEFAULT_CPU_KV_GIB): how many sequences of the
# context fit in it with the default live limits, with the sliding pool and all-global.
CAPACITY_GIB = 2.0


def _capacity(engine, context: int, block_size: int, all_global: int) -> dict[str, int]:
    import torch
    from specfleet.engine.block_manager import SlidingLayers
    from specfleet.engine.config import EngineConfig
    from specfleet.engine.loader import kv_cache_blocks, sliding_blocks_needed

    config = EngineConfig(model="-", block_size=block_size, kv_cache_gib=CAPACITY_GIB)
    assert engine.runner.sliding is not None
    sliding = SlidingLayers(engine.runner.sliding.layers, engine.runner.sliding.window)
    full = kv_cache_blocks(config, [engine.runner.model], context, torch.device("cpu"), sliding=sliding)
    per_seq = -(-context // block_size)
    chunk = sliding_blocks_needed(config, sliding.window, seqs=0)
    per_window = sliding_blocks_needed(config, sliding.window, seqs=1) - chunk
    windows = (sliding.num_blocks - 1 - chunk) // per_window
    return {
        "sliding_pool": min(full // per_seq, windows),
        "all_global": int(CAPACITY_GIB * 2**30 // all_global) // per_seq,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet bench gemma-kv", description=__doc__)
    parser.add_argument("--context", type=int, default=8192, help="tokens the sequence reaches")
    parser.add_argument("--window", type=int, default=1024, help="the sliding layers' window (Gemma 3 4B+)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (no bearing on the KV)")
    parser.add_argument("--heads", type=int, default=1, help="query heads (no bearing on the KV; 1B has 4)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gemma-kv-") as tmp:
        path = Path(tmp)
        write_checkpoint(path, args.window, args.context, args.hidden, args.heads)
        result = measure(f"file://{path}", args.context, args.block_size, args.chunk)
    result = {
        "model": f"Gemma 3 1B KV shape ({LAYERS} layers, {SLIDING_PER_GLOBAL}:1 sliding:global, "
        f"{KV_HEADS} KV head x {HEAD_DIM}), random weights",
        "window": args.window,
        **result,
    }
    print(json.dumps(result, indent=2))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
