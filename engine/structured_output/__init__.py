"""Structured outputs: constrain generation to a JSON schema, a regex, a choice or an EBNF grammar.

spec.py (what to match) <- request_fields.py (request spellings) ; backend.py (compile, cache) ->
matcher.py (per-request state) -> bitmask.py (masks, applied to logits) ; speculative.py (k + 1 rows).
See docs/structured_outputs.md for the engine integration.

The names below load with their module on first use: the API server process reads requests with
request_fields.py and spec.py alone, and importing the backend (torch, xgrammar: about 3 s) there would sit
on every server's start-up path before the engine core is even spawned."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {  # exported name -> the submodule that defines it
    "GrammarBackend": "backend",
    "choice_grammar": "backend",
    "allocate_bitmask": "bitmask",
    "apply_token_bitmask_": "bitmask",
    "bitmask_words": "bitmask",
    "unpack_bitmask": "bitmask",
    "StructuredOutputError": "errors",
    "GrammarMatcher": "matcher",
    "spec_from_request": "request_fields",
    "spec_from_response_format": "request_fields",
    "spec_from_structured_outputs": "request_fields",
    "KINDS": "spec",
    "StructuredOutputSpec": "spec",
    "draft_bitmask": "speculative",
}

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
assert sorted(__all__) == sorted(_HOME), "each exported name has one home module"


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
