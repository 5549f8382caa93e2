"""Grammar engines compared on this machine: compile time and per-token mask cost (fill bitmask).

`python -m specfleet.bench.structured_mask [--backends xgrammar,llguidance,outlines] [--repeats 3] [--threads N]
[--engine]` (--engine: also the share of the engine's generation time spent on grammar work, batch 1 and 32)

With the bundled SmolLM2 tokenizer (vocab 49152) and one JSON schema (nested object, enum, array with
min/max items, string pattern), each backend compiles the schema (cold: a fresh compiler, so no cache),
then walks the token ids of a valid instance (compact: no whitespace, the same for every backend), filling the allowed-token bitmask before every token: one
matcher (batch 1), and 32 matchers one step at a time (batch 32, one row each, sequential and with the
backend's own parallel fill where it has one). Also times the in-place application of the mask rows
to float32 logits at batch 1 and 32, with real masks (those met along the instance). Prints a table and, last, the figures as JSON on one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "12345"},
}
BATCH = 32


def _load_tokenizer():
    from specfleet.engine.model_source import resolve_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("bundled://smollm2-135m-instruct").path)


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=16)

    def fill(self, m, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, token):
        assert m.accept_token(token), token

    def fill_batch(self, matchers, bitmask):
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher(max_threads=2)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
        )
        # llguidance compiles lazily; the first matcher is where the cost lands
        return grammar, self.ll.LLMatcher(self.tok, grammar)

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled[0])

    def fill(self, m, bitmask, row):
        self.ll.torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m, token):
        assert m.consume_token(token), m.get_error()

    def fill_batch(self, matchers, bitmask):
        self.ll.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )


class _Outlines:
    name = "outlines"

    def __init__(self, tokenizer, vocab_size):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = oc
        self.regex_of = build_regex_from_schema
        decoder = _byte_decoder()
        eos = self.eos = tokenizer.eos_token_id
        by_bytes: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for piece, token_id in tokenizer.get_vocab().items():
            if token_id in special or token_id == eos:
                continue
            by_bytes.setdefault(bytes(decoder[c] for c in piece), []).append(token_id)
        self.vocabulary = oc.Vocabulary(eos, by_bytes)

    def compile(self):
        return self.oc.Index(self.regex_of(json.dumps(SCHEMA), whitespace_pattern=""), self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled, max_rollback=16)

    def fill(self, m, bitmask, row):
        view = bitmask[row]
        m.write_mask_into(view.data_ptr(), view.numel(), 4)

    def accept(self, m, token):
        if token == self.eos and m.is_finished():
            return  # the Guide ends at its final state; EOS is the engine's stop, not a transition
        m.advance(token)

    def fill_batch(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.fill(m, bitmask, i)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a vocab entry uses -> the byte it stands for."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BACKENDS = {b.name: b for b in (_Xgrammar, _Llguidance, _Outlines)}


def measure(backend, tokens: list[int], vocab_size: int, repeats: int) -> dict:
    compile_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = backend.compile()
        compile_s.append(time.perf_counter() - t0)
    bitmask = torch.zeros((BATCH, _words(vocab_size)), dtype=torch.int32)

    one = []
    for _ in range(repeats):
        m = backend.matcher(compiled)
        spent = 0.0
        for token in tokens:
            t0 = time.perf_counter()
            backend.fill(m, bitmask, 0)
            spent += time.perf_counter() - t0
            backend.accept(m, token)
        one.append(spent / len(tokens))

    def batch_step(parallel: bool) -> float:
        matchers = [backend.matcher(compiled) for _ in range(BATCH)]
        spent = 0.0
        for token in tokens:
            t0 = time.perf_counter()
            if parallel:
                backend.fill_batch(matchers, bitmask)
            else:
                for row, m in enumerate(matchers):
                    backend.fill(m, bitmask, row)
            spent += time.perf_counter() - t0
            for m in matchers:
                backend.accept(m, token)
        return spent / len(tokens)

    seq = [batch_step(False) for _ in range(repeats)]
    par = [batch_step(True) for _ in range(repeats)]
    return {
        "compile_ms": 1e3 * statistics.median(compile_s),
        "fill_us_batch1": 1e6 * statistics.median(one),
        "fill_us_step_batch32_sequential": 1e6 * statistics.median(seq),
        "fill_us_step_batch32_parallel": 1e6 * statistics.median(par),
    }


def apply_cost_us(tokenizer, vocab_size: int, tokens: list[int], repeats: int) -> dict:
    """The in-place application of real masks (those met along the instance) to float32 logits."""
    from specfleet.engine.structured_output import GrammarBackend, StructuredOutputSpec, apply_token_bitmask_

    backend = GrammarBackend(tokenizer, vocab_size, [tokenizer.eos_token_id])
    matcher = backend.matcher(StructuredOutputSpec.json_schema(SCHEMA))
    masks = backend.allocate_bitmask(len(tokens))
    for row, token in enumerate(tokens):
        matcher.fill_bitmask(masks, row)
        matcher.accept_token(token)
    import xgrammar as xgr

    appliers: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
        "apply": apply_token_bitmask_,
        "xgrammar_cpu_kernel_apply": lambda lg, bm: xgr.apply_token_bitmask_inplace(lg, bm, backend="cpu"),
    }
    out = {}
    for name, apply in appliers.items():
        for rows in (1, BATCH):
            logits = torch.randn(rows, vocab_size)
            batches = [
                masks[[(start + r) % len(tokens) for r in range(rows)]] for start in range(len(tokens))
            ]
            spent = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for bitmask in batches:
                    apply(logits, bitmask)
                spent.append((time.perf_counter() - t0) / len(tokens))
            out[f"{name}_us_step_batch{rows}"] = 1e6 * statistics.median(spent)
    return out


def engine_overhead(batches: tuple[tuple[int, int], ...] = ((1, 24), (BATCH, 16))) -> dict:
    """End to end (needs the engine integration): the share of generation time spent in grammar work
    (building the step's mask, applying it, advancing matchers), measured with cProfile inside one run, so
    that it does not depend on how loaded the machine was between two runs. The schema's one field is a
    long free string: every sequence stays in the grammar for all its tokens, with real mixed masks."""
    import cProfile
    import pstats

    from specfleet.engine import LLM, SamplingParams

    schema = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 2000}},
        "required": ["story"],
    }
    grammar_functions = {"bitmask", "filter_proposals", "apply_token_bitmask_", "accept"}
    llm = LLM()
    out: dict = {}
    for batch, steps in batches:
        params = SamplingParams(
            temperature=0, max_tokens=steps, ignore_eos=True, structured_outputs={"json": schema}
        )
        prompts = [f"Tell story {i} about a lighthouse keeper, as JSON." for i in range(batch)]
        llm.generate(prompts[:1], params)  # compiled and cached, as for every later request with this schema
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        llm.generate(prompts, params)
        profile.disable()
        total = time.perf_counter() - start
        grammar = sum(
            ct
            # typeshed's Stats lacks `stats`, the (file, line, name) -> (cc, nc, tt, ct, callers) table
            for (_, _, fn), (_, _, _, ct, _) in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
            if fn in grammar_functions
        )
        out[f"batch{batch}"] = {
            "total_ms": 1e3 * total,
            "grammar_ms": 1e3 * grammar,
            "steps": steps,
            "grammar_ms_per_step": 1e3 * grammar / steps,
            "grammar_pct": 100 * grammar / total,
        }
        print(
            f"batch {batch}: grammar work {1e3 * grammar / steps:.1f} ms a step, {100 * grammar / total:.2f}% of "
            f"generation ({1e3 * total:.0f} ms for {steps} steps)",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also the grammar share of generation time in the engine (loads the model)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = _load_tokenizer()
    vocab_size = len(tokenizer)
    tokens = tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":"))) + [tokenizer.eos_token_id]
    results: dict = {
        "vocab_size": vocab_size,
        "tokens": len(tokens),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
    }
    for name in args.backends.split(","):
        print(f"measuring {name} ...", flush=True)
        backend = BACKENDS[name](tokenizer, vocab_size)
        results[name] = measure(backend, tokens, vocab_size, args.repeats)
    results.update(apply_cost_us(tokenizer, vocab_size, tokens, args.repeats))
    print(
        f"{'backend':<12} {'compile ms':>11} {'fill us b=1':>12} {'step us b=32 seq':>17} {'step us b=32 par':>17}"
    )
    for name in args.backends.split(","):
        r = results[name]
        print(
            f"{name:<12} {r['compile_ms']:>11.1f} {r['fill_us_batch1']:>12.1f} "
            f"{r['fill_us_step_batch32_sequential']:>17.1f} {r['fill_us_step_batch32_parallel']:>17.1f}"
        )
    if args.engine:
        results["engine"] = engine_overhead()
    for name in ("apply", "xgrammar_cpu_kernel_apply"):
        print(
            f"{name} (mask to logits), us a step: batch 1 {results[f'{name}_us_step_batch1']:.1f}, "
            f"batch {BATCH} {results[f'{name}_us_step_batch32']:.1f}"
        )
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
