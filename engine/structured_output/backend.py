"""`GrammarBackend`: compiles specs to grammars for one tokenizer (xgrammar), with a cache keyed by spec.

Why xgrammar (measured against llguidance and outlines-core): see docs/decisions/016-xgrammar.md.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch
import xgrammar as xgr
from specfleet.engine.structured_output.admission import AdmissionCheck
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

    `check` is the engine thread's cheap admission (parse, empty language, a prefix the grammar refuses:
    400s); `compile` is the expensive part, thread-safe, which the engine runs in its compile pool (xgrammar
    releases the GIL while it compiles) while the request waits for its grammar."""

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
        self._admission = AdmissionCheck(self._info, cache_size)
        self._cache: OrderedDict[StructuredOutputSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # kind -> (what it is, in error messages; how its grammar is built: parsing only, cheap)
        self._builders: dict[str, tuple[str, Callable[[StructuredOutputSpec], xgr.Grammar]]] = {
            "json_object": (
                "JSON object grammar",
                lambda spec: xgr.Grammar.from_json_schema(
                    '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS
                ),
            ),
            "json_schema": (
                "JSON schema",
                lambda spec: xgr.Grammar.from_json_schema(
                    _text(spec), any_whitespace=False, separators=JSON_SEPARATORS
                ),
            ),
            "regex": ("regular expression", lambda spec: xgr.Grammar.from_regex(_text(spec))),
            "choice": (
                "choice list",
                lambda spec: xgr.Grammar.from_ebnf(choice_grammar(_choices(spec))),
            ),
            "grammar": ("EBNF grammar", lambda spec: xgr.Grammar.from_ebnf(_text(spec))),
        }

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._builders)

    def describe(self, spec: StructuredOutputSpec) -> str:
        """What `spec` is, for messages: "the regular expression in structured_outputs.regex"."""
        where = f" in {spec.source}" if spec.source else ""
        return f"the {self._builders[spec.kind][0]}{where}"

    def grammar(self, spec: StructuredOutputSpec) -> xgr.Grammar:
        """`spec` parsed into xgrammar's grammar (no tokenizer work); StructuredOutputError names what failed."""
        try:
            return self._builders[spec.kind][1](spec)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(
                f"cannot compile {self.describe(spec)}: {_clean(e)}", spec.source
            ) from None

    def check(
        self, spec: StructuredOutputSpec, prefix: Sequence[int] = (), prefix_param: str | None = None
    ) -> None:
        """Admission, cheap enough for the engine thread: `spec` parses, matches some output, and accepts
        `prefix` (output tokens the request brings, the prefill's first token) as its start. Errors name
        the field (`spec.source`, or `prefix_param` for a refused prefix token). See admission.py."""
        self._admission.check(spec, self.grammar, self.describe(spec), prefix, prefix_param)

    def cached(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar | None:
        """The compiled grammar of `spec` if it is in the cache (and then most recently used), else None."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        return None

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (cached, LRU); StructuredOutputError names what failed.
        The expensive part (the token masks of every grammar state: 30 ms to 0.4 s) runs in xgrammar's C++
        with the GIL released, so the engine calls this from its compile pool (manager.py)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        grammar = self.grammar(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(
                f"cannot compile {self.describe(spec)}: {_clean(e)}", spec.source
            ) from None
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(
        self, spec: StructuredOutputSpec, compiled: xgr.CompiledGrammar | None = None
    ) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar (`compiled`, or compiled here unless cached)."""
        return GrammarMatcher(compiled or self.compile(spec), self.max_rollback_tokens)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return allocate_bitmask(num_rows, self.vocab_size)


def choice_grammar(choices: Iterable[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _text(spec: StructuredOutputSpec) -> str:
    assert isinstance(spec.value, str), f"a {spec.kind} spec holds its value as text"
    return spec.value


def _choices(spec: StructuredOutputSpec) -> tuple[str, ...]:
    assert isinstance(spec.value, tuple), "a choice spec holds its strings as a tuple"
    return spec.value


def _clean(error: Exception) -> str:
    return " ".join(_XGR_NOISE.sub("", str(error)).split())
