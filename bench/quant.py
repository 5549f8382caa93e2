"""`specfleet bench quant`: what quantized weights cost in quality and buy in single-stream speed.

quality: perplexity on a fixed public-domain text (bench/data/, ~3.8k tokens, scored in 512-token windows
through the engine's prompt logprobs) and greedy agreement with float32 over the built-in prompt sets
(bench/prompts.py: 64 greedy tokens each; `agree_prefix` is the mean fraction of tokens before the first
divergence, `exact` the share of prompts identical to float32), for every weight form the engine runs:
float32, int8, the bundled GGUF as stored (Q4_1 projections, Q8_0 head), the bundled model's float32
weights re-quantized with gguf-py's quantizers to Q4_0 and Q8_0, and 4-bit groups of 64 with zero points
(the form AWQ and GPTQ checkpoints run in; plain round-to-nearest here, without their calibration), and
the same 4-bit weights written as AutoAWQ GEMM and GPTQ v1 checkpoints (act-order too) and loaded from
disk through the checkpoint readers.
Q4_K needs input sizes that are multiples of 256, and this model's 576 is not (llama.cpp falls back per
tensor too): it is reported as not applicable.

speed: c=1 decode TPOT (one request, 64 greedy tokens after a short prompt; medians of --runs) of
float32, int8, gguf (int8 activations) and gguf-f32act (float32 activations) in one run, with a breakdown
of one decode step: the decoder layers, the head (final norm + vocabulary projection), and everything else
(scheduling, sampling, Python).

stepcost: the engine's decode step time at batches 1..32 for each weight form (the forms side by side in
one process, timed in turns), and the tuner's step-cost fit over those points (tuner/policy/model.py: c0
the floor, c1 per token, the knee c0 / c1): a quantized engine streams fewer bytes per step, so its floor
c0 is lower, and the fit must follow it.

Ends stdout with the JSON on one line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from specfleet.bench.prompts import chat_prompts, grounded_prompts
from specfleet.engine import LLM, SamplingParams

BUNDLED = "bundled://smollm2-135m-instruct"
TEXT = Path(__file__).with_name("data") / "pride_and_prejudice_ch1-3.txt"
WINDOW = 512  # tokens scored per request: the text in independent windows, each from its own start
GREEDY_TOKENS = 64
# Engine kwargs per weight form; the re-quantized forms (Q4_0, Q8_0, int4-g64) run as gguf.
# gguf runs int8 activations (the default); gguf-f32act keeps them float32 (exact, the old path).
KINDS: dict[str, dict] = {
    "fp32": {},
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
    "gguf-f32act": {"quantization": "gguf", "quantized_activations": "float32"},
}
STEPCOST_BATCHES = (1, 2, 4, 8, 16, 32)  # decode batches the step-cost check times: both sides of the knee


def requantized(kind: str):
    """A read_quantized stand-in that quantizes the bundled model's float32 projections to `kind`."""
    import numpy as np
    from specfleet.engine.checkpoint import load_state_dict
    from specfleet.kernels.quantized import QuantTensor

    def read(path, hf_config):
        from specfleet.engine.model_source import resolve_model

        state = load_state_dict(resolve_model(BUNDLED).path)
        out = {}
        for name, w in state.items():
            key = name.removeprefix("model.")
            if not key.endswith("_proj.weight") and key != "embed_tokens.weight":
                continue
            if (
                key == "embed_tokens.weight"
            ):  # the tied head: Q8_0 as in the bundled file; AWQ/GPTQ keep it float
                if kind == "int4-g64":
                    continue
                key, kind_here = "lm_head.weight", "Q8_0"
            else:
                kind_here = kind
            if kind_here in ("Q4_0", "Q8_0"):
                import gguf
                from specfleet.engine.quant.gguf_blocks import decode

                raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind_here])
                out[key] = decode(np.ascontiguousarray(raw), kind_here, tuple(w.shape))
            else:  # int4 groups of 64, asymmetric round-to-nearest
                n, k = w.shape
                g = w.reshape(n, k // 64, 64)
                lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
                scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
                zero = torch.round(-lo / scale).clamp(0, 15)
                codes = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
                out[key] = QuantTensor(
                    codes.reshape(n, k).to(torch.uint8), scale, -zero * scale, 64, 4, "int4-g64"
                )
        return out

    return read


# AWQ/GPTQ checkpoints written from the bundled float32 weights: 4-bit, groups of 64, zero points,
# round-to-nearest (no calibration: the tools' activation-aware scaling and error feedback are not
# reproduced, so these rows bound the formats' kernels and layout, not the tools' accuracy).
CHECKPOINT_GROUP = 64
CHECKPOINTS = ("awq", "gptq", "gptq-act-order")
REQUANTIZED = ("Q4_0", "Q8_0", "int4-g64")  # the bundled float32 weights through the GGUF path
QUALITY_KINDS = (*KINDS, *REQUANTIZED, *CHECKPOINTS)


def write_checkpoint(kind: str, out: Path) -> None:
    """An AutoAWQ GEMM (`awq`) or GPTQ v1 (`gptq`, `gptq-act-order`: desc_act with a shuffled g_idx)
    checkpoint of the bundled model in `out`; the tied embedding and head stay float, as both tools
    leave them."""
    import shutil

    from safetensors.torch import save_file
    from specfleet.bench.gpu.quant_packers import pack_awq, pack_gptq
    from specfleet.engine.checkpoint import load_state_dict
    from specfleet.engine.model_source import resolve_model

    source = resolve_model(BUNDLED).path
    tensors: dict[str, torch.Tensor] = {}
    for name, w in load_state_dict(source).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = w.contiguous()
            continue
        if kind == "awq":
            packed, _ = pack_awq(w, CHECKPOINT_GROUP)
        else:
            packed, _ = pack_gptq(w, CHECKPOINT_GROUP, act_order=kind == "gptq-act-order")
        tensors.update({f"{name.removesuffix('.weight')}.{k}": v.contiguous() for k, v in packed.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    method = "awq" if kind == "awq" else "gptq"
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": CHECKPOINT_GROUP}
    config["quantization_config"].update(
        {"zero_point": True, "version": "gemm"}
        if method == "awq"
        else {"desc_act": kind == "gptq-act-order", "sym": False}
    )
    (out / "config.json").write_text(json.dumps(config))
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)


@contextmanager
def weights(kind: str):
    """Engine kwargs for one weight form: re-quantized forms swap the GGUF reader for the run, AWQ/GPTQ
    forms load a checkpoint written for the run."""
    import tempfile

    import specfleet.engine.quant.gguf_file as gguf_file

    if kind in CHECKPOINTS:
        with tempfile.TemporaryDirectory(prefix=f"specfleet-{kind}-") as tmp:
            write_checkpoint(kind, Path(tmp))
            yield {"model": f"file://{tmp}"}
        return
    original = gguf_file.read_quantized
    if kind in REQUANTIZED:
        gguf_file.read_quantized = requantized(kind)
    try:
        yield KINDS.get(kind, {"quantization": "gguf"})
    finally:
        gguf_file.read_quantized = original


def perplexity(llm: LLM) -> float:
    ids = llm.get_tokenizer()(TEXT.read_text())["input_ids"]
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids) - 1, WINDOW) if len(ids[i : i + WINDOW]) > 1]
    results = llm.generate(
        windows, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False
    )
    nll: list[float] = []
    for r in results:
        assert r.prompt_logprobs is not None, "asked for with prompt_logprobs=0"
        nll.extend(-p.logprob for p in r.prompt_logprobs[1:] if p is not None)  # only the first is None
    return math.exp(sum(nll) / len(nll))


def greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / len(a))
    return {
        "agree_prefix": round(statistics.mean(prefix), 4),
        "exact": round(sum(a == b for a, b in zip(ref, got)) / len(ref), 4),
    }


def quality(kinds: list[str]) -> dict:
    prompts = chat_prompts() + grounded_prompts()[:8]
    out: dict[str, dict[str, float | str]] = {}
    # Agreement is always with float32's tokens: it runs first, and is reported only when asked for.
    reference: list[list[int]] = []
    for kind in ["fp32", *(k for k in kinds if k != "fp32")]:
        with weights(kind) as kw:
            llm = LLM(**{"model": BUNDLED, **kw}, max_model_len=2048, kv_cache_gib=0.5)
            start = time.perf_counter()
            tokens = greedy(llm, prompts)
            if kind == "fp32":
                reference = tokens
                if kind not in kinds:
                    del llm
                    continue
            row: dict[str, float | str] = {"perplexity": round(perplexity(llm), 4)}
            row.update(agreement(reference, tokens))
            row["seconds"] = round(time.perf_counter() - start, 1)
            out[kind] = row
            print(kind, row, flush=True)
            del llm
    out["Q4_K"] = {
        "not_applicable": "input sizes 576 are not multiples of 256 (K-quants need 256-value rows)"
    }
    return out


class StepTimer:
    """Wraps the model's forward and logits to split one decode step's wall time."""

    def __init__(self, model):
        self.model, self.layers, self.head = model, 0.0, 0.0
        self._forward, self._logits = model.forward, model.logits

        def forward(*a, **k):
            t = time.perf_counter()
            try:
                return self._forward(*a, **k)
            finally:
                self.layers += time.perf_counter() - t

        def logits(*a, **k):
            t = time.perf_counter()
            try:
                return self._logits(*a, **k)
            finally:
                self.head += time.perf_counter() - t

        model.forward, model.logits = forward, logits


def speed(kinds: list[str], runs: int, threads: int | None) -> dict:
    if threads:  # on a shared machine 1 thread avoids OpenMP barriers waiting on a descheduled thread
        from specfleet.kernels import cpu_native

        torch.set_num_threads(threads)
        cpu_native.set_num_threads(threads)
    prompt = "Tell me about the history of Rome."
    out = {}
    for kind in kinds:
        with weights(kind) as kw:
            llm = LLM(model=BUNDLED, max_model_len=1024, kv_cache_gib=0.2, **kw)
            timer = StepTimer(llm.engine.runner.model)
            tpots, layers, head = [], [], []
            greedy(llm, [prompt])  # warm-up
            for _ in range(runs):
                timer.layers = timer.head = 0.0
                t0 = time.perf_counter()
                llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
                t1 = time.perf_counter()
                prefill_layers, prefill_head = timer.layers, timer.head
                timer.layers = timer.head = 0.0
                llm.generate(
                    [prompt],
                    SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS + 1, ignore_eos=True),
                    use_tqdm=False,
                )
                t2 = time.perf_counter()
                # The two runs differ only by GREEDY_TOKENS decode steps: their difference is decode alone.
                tpots.append(((t2 - t1) - (t1 - t0)) / GREEDY_TOKENS * 1e3)
                layers.append((timer.layers - prefill_layers) / GREEDY_TOKENS * 1e3)
                head.append((timer.head - prefill_head) / GREEDY_TOKENS * 1e3)
            model = llm.engine.runner.model
            row = {
                "tpot_ms_p50": round(statistics.median(tpots), 2),
                "tpot_ms_all": [round(t, 2) for t in tpots],
                "step_layers_ms": round(statistics.median(layers), 2),
                "step_head_ms": round(statistics.median(head), 2),
                "weight_bytes_mb": round(weight_bytes(model) / 1e6, 1),
            }
            row["step_other_ms"] = round(row["tpot_ms_p50"] - row["step_layers_ms"] - row["step_head_ms"], 2)
            out[kind] = row
            print(kind, row, flush=True)
            del llm
    base = out.get("fp32", {}).get("tpot_ms_p50")
    if base:
        for row in out.values():
            row["tpot_ratio_vs_fp32"] = round(row["tpot_ms_p50"] / base, 3)
    return out


def stepcost(kinds: list[str], steps: int) -> dict:
    """Decode step time by batch for every form, the engines loaded side by side in this process and timed
    in turns (engine A's step, then B's, ...), each point the fastest of `steps` turns: a machine shared with
    other work slows some turns, and the fastest is the step's own cost for every engine alike. Then the
    tuner's fit (`fit_step_cost`) over each form's points."""
    from specfleet.engine import SamplingParams
    from specfleet.tuner.policy.model import fit_step_cost

    engines = {k: LLM(model=BUNDLED, max_model_len=1024, kv_cache_gib=0.3, **KINDS[k]).engine for k in kinds}
    times: dict[str, dict[int, float]] = {k: {} for k in kinds}
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    n = 0
    for batch in STEPCOST_BATCHES:
        for engine in engines.values():
            for _ in range(batch):
                n += 1
                engine.add_request(f"s{n}", [(n * 7919 + i * 31) % 40000 + 5 for i in range(64)], params)
            while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()
            engine.step()  # the first decode step: not timed
        for _ in range(steps):
            for kind, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
                times[kind][batch] = min(times[kind].get(batch, elapsed), elapsed)
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
        print(
            f"batch {batch}: " + ", ".join(f"{k} {t[batch] * 1e3:.1f} ms" for k, t in times.items()),
            flush=True,
        )
    out: dict[str, dict[str, Any]] = {}
    for kind, by_batch in times.items():
        cost = fit_step_cost([(float(b), 0.0, t) for b, t in by_batch.items()])
        assert cost is not None
        out[kind] = {
            "step_ms": {str(b): round(t * 1e3, 2) for b, t in by_batch.items()},
            "c0_ms": round(cost.c0 * 1e3, 2),
            "c1_ms": round(cost.c1 * 1e3, 3),
            "knee": round(cost.knee, 2),
        }
    base = out.get("fp32", {})
    for row in out.values():
        if base:
            row["c0_ratio_vs_fp32"] = round(row["c0_ms"] / base["c0_ms"], 3)
            row["step_ratio_vs_fp32"] = {
                b: round(t / base["step_ms"][b], 3) for b, t in row["step_ms"].items()
            }
    return out


def weight_bytes(model) -> int:
    """Bytes of the matmul weights one decode step streams (panels, scales, mins)."""
    total = 0
    for layer in [*model.layers, model]:
        for linear in vars(layer).values():
            for attr in ("panels", "codes", "scales", "mins", "scale"):
                t = getattr(linear, attr, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet bench quant", description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["quality", "speed", "stepcost"])
    parser.add_argument(
        "--kinds",
        default=None,
        help="comma-separated subset (quality: " + ",".join(QUALITY_KINDS) + "; speed: "
        "fp32,int8,gguf,gguf-f32act; stepcost: fp32,int8,gguf)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=5,
        help="speed: timed runs per form (the median is reported); stepcost: timed turns per batch (the fastest)",
    )
    parser.add_argument("--threads", type=int, default=None, help="speed: torch and native kernel threads")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.kinds:
        allowed = QUALITY_KINDS if args.mode == "quality" else tuple(KINDS)
        unknown = sorted(set(args.kinds.split(",")) - set(allowed))
        if unknown:
            parser.error(f"--kinds: unknown {unknown} for {args.mode}; choose from {','.join(allowed)}")
    if args.mode == "quality":
        kinds = args.kinds.split(",") if args.kinds else list(QUALITY_KINDS)
        result = {
            "bench": "quant-quality",
            "text": TEXT.name,
            "window": WINDOW,
            "greedy_tokens": GREEDY_TOKENS,
            "results": quality(kinds),
        }
    elif args.mode == "stepcost":
        if args.threads:
            torch.set_num_threads(args.threads)
        kinds = (args.kinds or "fp32,int8,gguf").split(",")
        result = {
            "bench": "quant-stepcost",
            "batches": STEPCOST_BATCHES,
            "context": 64,
            "steps": args.runs,
            "threads": torch.get_num_threads(),
            "results": stepcost(kinds, args.runs),
        }
    else:
        kinds = (args.kinds or "fp32,int8,gguf,gguf-f32act").split(",")
        result = {
            "bench": "quant-speed",
            "concurrency": 1,
            "output_tokens": GREEDY_TOKENS,
            "runs": args.runs,
            "threads": torch.get_num_threads() if not args.threads else args.threads,
            "results": speed(kinds, args.runs, args.threads),
        }
    line = json.dumps(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
