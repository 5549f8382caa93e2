"""`AdmissionCheck`: what makes a structured request a 400, decided on the engine thread before the real
compile, which runs in the compile pool (manager.py) while the request waits for its grammar.

A grammar is compiled a second time, against a vocabulary of the 256 single bytes and one stop token,
whose token masks cost a fraction of the real vocabulary's: 49 ms against 355 ms for a 60-property schema
with patterns, under 2 ms for a regex (measured on the 2-core machine against the 49152-token SmolLM2
vocabulary). Any output is a string of bytes, so on this vocabulary xgrammar's exact masks answer:

- **no output matches** (regex `[^\\s\\S]`): the initial mask allows no byte and not the stop token (so
  not even the empty output). Left to run, such a request would have no token to sample.
- **a prefix the grammar refuses**: the output tokens a request arrives with (the prefill engine's first
  token, through prefill/decode disaggregation) are accepted byte by byte; a stop token is the stop token,
  any other special token is refused (xgrammar never allows one).

A grammar that admits some start but dead-ends later (`a[^\\s\\S]`) passes: the runner ends such a request
at the dead end (model_runner.py), without sampling a token the grammar did not allow.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import xgrammar as xgr
from specfleet.engine.structured_output.errors import StructuredOutputError
from specfleet.engine.structured_output.spec import StructuredOutputSpec

BYTE_STOP = 256  # the byte vocabulary's stop token, after the 256 single bytes


class AdmissionCheck:
    def __init__(self, info: xgr.TokenizerInfo, cache_size: int):
        """info: the engine's tokenizer (for the bytes of prefix tokens); cache_size: byte-level grammars
        kept, by spec (as many as the backend keeps compiled grammars)."""
        self._info = info
        self._decoded: list[bytes] | None = None  # the vocabulary's bytes, read at the first prefix
        self._stop = set(info.stop_token_ids)
        self._special = set(info.special_token_ids)
        self._bytes = xgr.TokenizerInfo(
            [bytes([b]) for b in range(256)] + [b"<stop>"],
            vocab_type=xgr.VocabType.RAW,
            stop_token_ids=[BYTE_STOP],
        )
        # one thread: the byte vocabulary's masks are cheap, and the pool's compile may use both cores
        self._compiler = xgr.GrammarCompiler(self._bytes, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size

    def check(
        self,
        spec: StructuredOutputSpec,
        build: Callable[[StructuredOutputSpec], xgr.Grammar],
        what: str,
        prefix: Sequence[int] = (),
        prefix_param: str | None = None,
    ) -> None:
        """StructuredOutputError unless `spec` matches some output that starts with `prefix`'s tokens.
        build: spec -> its parsed grammar (errors already name the field); what: "the regular expression
        in structured_outputs.regex", for messages."""
        matcher = xgr.GrammarMatcher(self._compiled(spec, build, what))
        mask = xgr.allocate_token_bitmask(1, self._bytes.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        if not bool(mask.ne(0).any()):
            raise StructuredOutputError(
                f"{what} matches no output: no string satisfies it (not even the empty one), so no token "
                "could ever be generated",
                spec.source,
            )
        for n, token in enumerate(prefix):
            if not self._accept(matcher, int(token)):
                param = prefix_param or spec.source
                raise StructuredOutputError(
                    f"{param}={token} ({self._text(int(token))!r}, output token {n}) is not allowed by {what}: "
                    "the output so far cannot continue into anything it matches",
                    param,
                )

    def _compiled(
        self, spec: StructuredOutputSpec, build: Callable[[StructuredOutputSpec], xgr.Grammar], what: str
    ) -> xgr.CompiledGrammar:
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            return compiled
        grammar = build(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"cannot compile {what}: {e}", spec.source) from None
        self._cache[spec] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _accept(self, matcher: xgr.GrammarMatcher, token: int) -> bool:
        if token in self._stop:
            return matcher.accept_token(BYTE_STOP)
        decoded = self._vocabulary()
        if token in self._special or not 0 <= token < len(decoded) or not decoded[token]:
            return False
        return all(matcher.accept_token(byte) for byte in decoded[token])

    def _text(self, token: int) -> str:
        decoded = self._vocabulary()
        return decoded[token].decode("utf-8", "replace") if 0 <= token < len(decoded) else ""

    def _vocabulary(self) -> list[bytes]:
        if self._decoded is None:
            self._decoded = list(self._info.decoded_vocab)
        return self._decoded
