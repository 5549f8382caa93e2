"""When a sequence ends: decided for each token as the scheduler appends it (vLLM's `update_from_output`,
nano-vllm's `postprocess`), so that a step's tokens past the end are never appended and nothing is taken
back afterwards.

Conditions, in order, for the token just appended (the first that holds wins, so that the text, the tokens
and finish_reason / stop_reason agree even when one speculative step yields several): a stop token, EOS
(unless `ignore_eos`), a stop string in the text, `max_tokens` or the model's context; as in vLLM, a stop
token counts from output token number `min_tokens` on, a stop string only when it ends after the first
`min_tokens` tokens (vLLM's detokenizer checks once `len(output) > min_tokens`, in the text the new token
added), and a stop token's text is not output unless `include_stop_str_in_output`. A structured sequence's grammar then takes the token: a token it refuses
aborts the sequence, and a grammar that ended (on a stop token `ignore_eos` let through) ends it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from specfleet.engine.sequence import Sequence

log = logging.getLogger("specfleet.engine")


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop token or string that matched


class Text(Protocol):
    """A sequence's text as its tokens grow (`IncrementalDetokenizer`): `update` returns the stop string
    the new text completed, if any (looked for only when `check_stop`)."""

    def update(self, output_ids: list[int], check_stop: bool = True) -> str | None: ...


class Grammars(Protocol):
    """`StructuredOutputManager.accept` (named by its shape, so that this module and the scheduler that
    imports it stay free of torch)."""

    def accept(self, seq: Sequence, token: int) -> str: ...

    def end_reasoning(self, seq: Sequence) -> None: ...


# The scheduler's question after each appended token: does the sequence end here?
StopCheck = Callable[[Sequence], Finish | None]


class StopChecker:
    def __init__(self, eos_token_ids: Collection[int], max_model_len: int, structured: Grammars):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.structured = structured

    def check(self, seq: Sequence, text: Text) -> Finish | None:
        """Whether `seq` ends at its last token; `text` is its detokenizer, brought up to that token."""
        params, pos = seq.params, seq.num_tokens - 1
        token, produced = seq.token_ids[pos], seq.num_output_tokens
        active = produced >= params.min_tokens
        finish = None
        if active and token in params.stop_token_ids:
            finish = Finish("stop", token)
        elif active and token in self.eos_token_ids and not params.ignore_eos:
            finish = Finish("stop")
        if finish is not None:
            if params.include_stop_str_in_output:
                text.update(seq.output_token_ids, check_stop=False)
            return finish
        if (matched := text.update(seq.output_token_ids, produced > params.min_tokens)) is not None:
            return Finish("stop", matched)
        if produced == params.max_tokens or pos + 1 >= self.max_model_len:
            return Finish("length")
        if seq.grammar_after_reasoning is not None:  # the grammar starts after the reasoning's end
            self.structured.end_reasoning(seq)
        elif seq.grammar is not None:
            verdict = self.structured.accept(seq, token)
            if verdict == "rejected":
                log.warning("event=grammar_rejected request_id=%s token=%d", seq.request_id, token)
                return Finish("abort")
            if verdict == "terminated":
                return Finish("stop")
        return None
