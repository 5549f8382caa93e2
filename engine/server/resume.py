"""A stream resumed from another engine, on this engine's side (the router's half: router/resume.py).

When an engine dies or drains mid-stream, the router sends the request again to another engine with
`resume_token_ids`, the tokens the client already has. The engine prefills prompt + those tokens and counts
them as output (SamplingParams.resume_token_ids), so the text, seeded draws, stop strings and usage go on
as if it had generated them; here the stream's cursor starts after them, so they are not sent twice.

The router learns which tokens the client has from the `token_ids` each streamed choice carries when the
request has the `TOKEN_IDS_HEADER` header (an extension the router strips before the client sees it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specfleet.engine.detokenizer import IncrementalDetokenizer, replay
from specfleet.engine.outputs import CompletionOutput
from specfleet.engine.sampling_params import SamplingParams

from .errors import APIError
from .protocol import CompletionRequest, SamplingFields
from .serving import ChoiceCursor

# Streamed choices carry the output token ids they cover (opt-in, sent by the router: router/resume.py).
TOKEN_IDS_HEADER = "x-specfleet-token-ids"


def wants_token_ids(headers: Any) -> bool:
    return headers.get(TOKEN_IDS_HEADER) == "1"


def check(body: SamplingFields, shaped: bool = False) -> None:
    """A 400 naming `resume_token_ids` for a request this engine cannot continue (SamplingParams checks
    the sampling side: n, logprobs, grammars)."""
    if body.resume_token_ids is None:
        return
    problem = None
    if not body.stream:
        problem = "needs stream=true (it continues a stream)"
    elif isinstance(body, CompletionRequest) and (body.echo or len(body.prompts()) != 1):
        problem = "needs one prompt and echo=false"
    elif shaped:
        problem = "cannot continue a reply read by tools or a reasoning parser"
    elif body.kv_transfer_params:
        problem = "cannot be combined with kv_transfer_params"
    if problem is not None:
        raise APIError(400, f"resume_token_ids {problem}", "resume_token_ids", "invalid_value")


@dataclass
class Resume:
    """Where a resumed stream's cursor starts: after the text the resumed tokens made on their engine."""

    tokenizer: Any
    params: SamplingParams

    @classmethod
    def of(cls, tokenizer: Any, params: SamplingParams) -> Resume | None:
        return None if params.resume_token_ids is None else cls(tokenizer, params)

    def cursor(self, prompt_ids: list[int]) -> ChoiceCursor:
        p = self.params
        resumed = list(p.resume_token_ids or [])
        detok = IncrementalDetokenizer(
            self.tokenizer, p.stop, p.include_stop_str_in_output, prompt_ids, p.skip_special_tokens
        )
        replay(detok, resumed, p.min_tokens)
        return ChoiceCursor(text_len=len(detok.visible_text(False)), started=True, num_tokens=len(resumed))


def add_token_ids(choice: dict[str, Any], output: CompletionOutput, cursor: ChoiceCursor) -> None:
    """The output tokens this chunk's text covers, on the chunk's choice (the router's extension)."""
    choice["token_ids"] = list(output.token_ids[cursor.num_tokens :])
    cursor.num_tokens = len(output.token_ids)
