"""Incremental detokenisation and stop strings.

Text grows by decoding a short window of recent tokens and keeping what the window adds beyond its
already-emitted part, so multi-byte characters split across tokens come out whole (a trailing U+FFFD
means "wait for the next token"). The window starts in the prompt's last tokens, as vLLM's does, so a
SentencePiece tokenizer (Llama 2, Mistral) keeps the space its first generated word carries: decoded
alone, "▁Paris" loses it. Stop strings are searched in the newly grown tail, and while a sequence runs the
last len(longest stop) - 1 characters are held back, so a stop string that spans tokens never leaks into
streamed text.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens the first window starts with: enough to settle a word boundary and a character split
# over up to four byte tokens (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET is the same 5).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        stop: list[str],
        include_stop: bool = False,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # Offsets into context + output: the window decoded last time, and where its new part began.
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.stopped: str | None = None

    def _ids(self, output_ids: list[int], start: int, end: int | None = None) -> list[int]:
        """Tokens [start, end) of context + output, without building the whole list."""
        c = len(self.context)
        end = c + len(output_ids) if end is None else end
        head = self.context[start:end] if start < c else []
        return head + output_ids[max(0, start - c) : max(0, end - c)]

    def update(self, output_ids: list[int], check_stop: bool = True) -> str | None:
        """Take the output so far; returns the stop string that matched, if any: the first (leftmost) one
        ending in the text this call added. `check_stop=False` grows the text without looking for stop
        strings (within the first `min_tokens` tokens, as vLLM ignores them there)."""
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        before = len(self.text)
        prefix = decode(self._ids(output_ids, self.prefix_offset, self.read_offset), skip_special_tokens=skip)
        full = decode(self._ids(output_ids, self.prefix_offset), skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.context) + len(output_ids)
        if check_stop and self.stop and len(self.text) > before:
            # Only a stop string that ends in the text this update added: one wholly inside text grown
            # unchecked (before `min_tokens`) must not match later (vLLM's `check_stop_strings` window).
            found = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
            if found:
                index, stop = min(found)
                self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
                self.stopped = stop
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        if finished or self.stopped is not None or not self.hold:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]


def replay(detok: IncrementalDetokenizer | TextCursor, token_ids: list[int], min_tokens: int) -> None:
    """Grow `detok` through output tokens generated elsewhere (a resumed request's), one token at a time
    as the engine that generated them did, so its text and held-back tail end where theirs did."""
    for pos in range(len(token_ids)):
        detok.update(token_ids[: pos + 1], pos + 1 > min_tokens)


class TokenText:
    """Token id -> its text alone (logprobs' decoded_token), cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


class TextCursor:
    """A detokenizer's stand-in in the engine core: it keeps no text, only how many output tokens the
    engine asked to turn into text, so the server's detokenizer covers the same tokens."""

    __slots__ = ("upto",)

    def __init__(self) -> None:
        self.upto = 0

    def update(self, output_ids: list[int], check_stop: bool = True) -> None:
        self.upto = len(output_ids)

    def visible_text(self, finished: bool) -> str:
        return ""
