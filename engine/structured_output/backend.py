"""`GrammarBackend`: compiles specs to grammars for one tokenizer (xgrammar), with a cache keyed by spec.

Why xgrammar: docs/structured_outputs.md (measured on this machine against llguidance and outlines-core).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch
import xgrammar as xgr
from specfleet.engine.structured_output.bitmask import allocate_bitmask
from specfleet.engine.structured_output.errors import StructuredOutputError
from specfleet.engine.structured_output.matcher import GrammarMatcher
from specfleet.engine.structured_output.spec import StructuredOutputSpec

# JSON separators: no free whitespace between elements. xgrammar's default (any whitespace) lets a small
# model emit newlines and spaces until max_tokens (vLLM issue #38696); ", " and ": " read like json.dumps.
JSON_SEPARATORS = (", ", ": ")
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check
_XGR_NOISE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class GrammarBackend:
    """One per engine (the tokenizer's vocabulary is preprocessed once, ~0.5 s for 49k tokens).

    `compile` is thread-safe, so the server can compile a request's spec off the engine thread (xgrammar
    releases the GIL while it compiles) and answer 400 before the request is queued."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        max_rollback_tokens: int = 16,
        cache_size: int = 256,
    ):
        """tokenizer: a Hugging Face tokenizer; vocab_size: the model's (logits width, may exceed the
        tokenizer's); stop_token_ids: the engine's EOS ids, the tokens that end a complete output;
        max_rollback_tokens: at least the largest speculative k plus one."""
        self.vocab_size = vocab_size
        self.max_rollback_tokens = max_rollback_tokens
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        c = self._compiler
        # kind -> (what it is, in error messages; how it compiles)
        self._compilers = {
            "json_object": (
                "JSON object grammar",
                lambda spec: c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS
                ),
            ),
            "json_schema": (
                "JSON schema",
                lambda spec: c.compile_json_schema(
                    spec.value, any_whitespace=False, separators=JSON_SEPARATORS
                ),
            ),
            "regex": ("regular expression", lambda spec: c.compile_regex(spec.value)),
            "choice": ("choice list", lambda spec: c.compile_grammar(choice_grammar(spec.value))),
            "grammar": ("EBNF grammar", lambda spec: c.compile_grammar(spec.value)),
        }

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._compilers)

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (cached, LRU); StructuredOutputError names what failed."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        what, compile_ = self._compilers[spec.kind]
        try:
            compiled = compile_(spec)
        except (RuntimeError, ValueError) as e:
            where = f" in {spec.source}" if spec.source else ""
            raise StructuredOutputError(
                f"cannot compile the {what}{where}: {_clean(e)}", spec.source
            ) from None
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar (compiling it unless cached)."""
        return GrammarMatcher(self.compile(spec), self.max_rollback_tokens)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return allocate_bitmask(num_rows, self.vocab_size)


def choice_grammar(choices: Iterable[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(error: Exception) -> str:
    return " ".join(_XGR_NOISE.sub("", str(error)).split())
