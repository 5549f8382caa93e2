"""Incremental detokenisation and stop strings.

Text grows by decoding a short window of recent tokens and keeping what the window adds beyond its
already-emitted part, so multi-byte characters split across tokens come out whole (a trailing U+FFFD
means "wait for the next token"). Stop strings are searched in the newly grown tail, and while a
sequence runs the last len(longest stop) - 1 characters are held back, so a stop string that spans
tokens never leaks into streamed text.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped: str | None = None

    def update(self, output_ids: list[int]) -> str | None:
        """Take the output so far; returns the stop string that matched, if any."""
        decode = self.tokenizer.decode
        before = len(self.text)
        prefix = decode(output_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(output_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        if self.stop and len(self.text) > before:
            start = max(0, before - self.hold)
            found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
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
