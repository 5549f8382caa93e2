"""Structured outputs: constrain generation to a JSON schema, a regex, a choice or an EBNF grammar.

spec.py (what to match) <- request_fields.py (request spellings) ; backend.py (compile, cache) ->
matcher.py (per-request state) -> bitmask.py (masks, applied to logits) ; speculative.py (k + 1 rows).
See docs/structured_outputs.md for the engine integration."""

from specfleet.engine.structured_output.backend import GrammarBackend, choice_grammar
from specfleet.engine.structured_output.bitmask import (
    allocate_bitmask,
    apply_token_bitmask_,
    bitmask_words,
    unpack_bitmask,
)
from specfleet.engine.structured_output.errors import StructuredOutputError
from specfleet.engine.structured_output.matcher import GrammarMatcher
from specfleet.engine.structured_output.request_fields import (
    spec_from_request,
    spec_from_response_format,
    spec_from_structured_outputs,
)
from specfleet.engine.structured_output.spec import KINDS, StructuredOutputSpec
from specfleet.engine.structured_output.speculative import draft_bitmask

__all__ = [
    "KINDS",
    "GrammarBackend",
    "GrammarMatcher",
    "StructuredOutputError",
    "StructuredOutputSpec",
    "allocate_bitmask",
    "apply_token_bitmask_",
    "bitmask_words",
    "choice_grammar",
    "draft_bitmask",
    "spec_from_request",
    "spec_from_response_format",
    "spec_from_structured_outputs",
    "unpack_bitmask",
]
