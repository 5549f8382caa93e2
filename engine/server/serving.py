"""Turning cumulative RequestOutputs into OpenAI response bodies and stream chunks (pure functions)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specfleet.engine.detokenizer import TokenText
from specfleet.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(
    entries: list[PositionLogprobs], text: TokenText, offset: int, echo: Echo | None = None
) -> dict[str, Any]:
    """OpenAI's legacy logprobs; with echo, the prompt's tokens first (the very first has none)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    prompt = [(token, lp) for token, lp in zip(echo.token_ids, echo.logprobs)] if echo else []
    for token_id, entry in prompt + [(e.token_id, e) for e in entries]:
        token = text(token_id)
        tokens.append(token)
        token_logprobs.append(entry.logprob if entry else None)
        top.append(
            ({text(t): lp for t, lp in entry.top.items()} or {token: entry.logprob}) if entry else None
        )
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


@dataclass
class Echo:
    """A prompt to repeat before its completion (completions' echo=true)."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # [] unless logprobs were asked for

    @classmethod
    def of(cls, final: RequestOutput, text: TokenText) -> Echo:
        prompt = final.prompt if final.prompt is not None else text.tokenizer.decode(final.prompt_token_ids)
        return cls(prompt, list(final.prompt_token_ids), list(final.prompt_logprobs or []))


def prompt_logprobs_json(entries: list[PositionLogprobs | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, token id -> {logprob, rank, decoded_token}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in e.items()
        }
        for e in entries
    ]


def chat_logprobs(entries: list[PositionLogprobs], text: TokenText, num_top: int) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = []
    for entry in entries:
        top = sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(
            {**item(entry.token_id, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in top]}
        )
    return {"content": content}


@dataclass
class ChoiceCursor:
    """How much of one choice has been streamed so far."""

    text_len: int = 0
    num_logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    done: bool = False
    num_tokens: int = 0  # output tokens whose text has been sent (the router's token ids: server/resume.py)


@dataclass
class StreamState:
    cursors: dict[int, ChoiceCursor] = field(default_factory=dict)
    # a resumed stream's first cursor, from the prompt's token ids (server/resume.py); None: from the start
    first: Callable[[list[int]], ChoiceCursor] | None = None

    def cursor(self, index: int, prompt_ids: list[int] | None = None) -> ChoiceCursor:
        if index not in self.cursors:
            first = self.first
            self.cursors[index] = (
                first(prompt_ids) if first is not None and prompt_ids is not None else ChoiceCursor()
            )
        return self.cursors[index]


def completion_delta(
    output: CompletionOutput,
    cursor: ChoiceCursor,
    index: int,
    want_logprobs: bool,
    text: TokenText,
    echo: Echo | None = None,
) -> dict[str, Any] | None:
    """The next chunk choice for a completions stream, or None when nothing new. With echo, the first
    chunk of each choice starts with the prompt."""
    echo = echo if not cursor.started else None
    cursor.started = True
    delta = (echo.text if echo else "") + output.text[cursor.text_len :]
    new_logprobs = (output.logprobs or [])[cursor.num_logprobs :] if want_logprobs else []
    if not delta and not new_logprobs and not (output.finished and not cursor.done):
        return None
    choice: dict[str, Any] = {"index": index, "text": delta, "logprobs": None, "finish_reason": None}
    if want_logprobs:
        choice["logprobs"] = completion_logprobs(new_logprobs, text, cursor.text_offset, echo)
        cursor.num_logprobs += len(new_logprobs)
        cursor.text_offset += sum(len(token) for token in choice["logprobs"]["tokens"])
    cursor.text_len = len(output.text)
    if output.finished:
        choice["finish_reason"] = output.finish_reason
        choice["stop_reason"] = output.stop_reason
        cursor.done = True
    return choice


def chat_delta(
    output: CompletionOutput, cursor: ChoiceCursor, index: int, num_logprobs: int | None, text: TokenText
) -> dict[str, Any] | None:
    delta_text = output.text[cursor.text_len :]
    new_logprobs = (output.logprobs or [])[cursor.num_logprobs :] if num_logprobs is not None else []
    if not delta_text and not new_logprobs and not (output.finished and not cursor.done):
        return None
    delta: dict[str, Any] = {"content": delta_text}
    if not cursor.started:
        delta["role"] = "assistant"
        cursor.started = True
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    if num_logprobs is not None:
        choice["logprobs"] = chat_logprobs(new_logprobs, text, num_logprobs)
        cursor.num_logprobs += len(new_logprobs)
    cursor.text_len = len(output.text)
    if output.finished:
        choice["finish_reason"] = output.finish_reason
        choice["stop_reason"] = output.stop_reason
        cursor.done = True
    return choice


def completion_choices(
    finals: list[RequestOutput],
    n: int,
    want_logprobs: bool,
    text: TokenText,
    echo: bool = False,
    scoring: bool = False,
) -> list[dict[str, Any]]:
    """With `scoring` (echo and max_tokens 0), each choice is the prompt alone, as vLLM answers it."""
    choices = []
    for p, final in enumerate(finals):
        repeat = Echo.of(final, text) if echo else None
        for out in sorted(final.outputs, key=lambda o: o.index):
            generated = [] if scoring else out.logprobs or []
            choice = {
                "index": p * n + out.index,
                "text": (repeat.text if repeat else "") + ("" if scoring else out.text),
                "logprobs": completion_logprobs(generated, text, 0, repeat) if want_logprobs else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if final.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
            choices.append(choice)
    return choices


def chat_choices(final: RequestOutput, num_logprobs: int | None, text: TokenText) -> list[dict[str, Any]]:
    choices = []
    for out in sorted(final.outputs, key=lambda o: o.index):
        choices.append(
            {
                "index": out.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(out.logprobs or [], text, num_logprobs)
                if num_logprobs is not None
                else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,  # vLLM's: the stop string or token id that ended it
            }
        )
    return choices
