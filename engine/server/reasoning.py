"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's output split into the reasoning
(`<think>...</think>`) and the answer.

- deepseek_r1 (DeepSeek-R1 and its distills, QwQ): the template ends the prompt with `<think>` (or the model
  writes it); everything up to `</think>` is reasoning, and an output that never closes it is all reasoning.
- qwen3 (Qwen3): the model opens `<think>` itself when it thinks; an output that does not start with it is
  all answer (`chat_template_kwargs: {"enable_thinking": false}` makes the template close an empty think
  block in the prompt).

Read over the output so far, both parts only grow as it grows, so a stream sends the difference; a tail
that could be the start of `</think>` waits until it is known. A structured output (or a tool grammar)
constrains only what follows the reasoning: the server hands the engine the end marker's token ids
(`SamplingParams.reasoning_end_token_ids`) unless the prompt has closed the reasoning already.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_parsers import held_back

START, END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str
    ended: bool  # the reasoning is over: what follows is the answer


class ReasoningParser:
    name = ""

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether generation after `prompt` starts inside the reasoning (not closed in the prompt)."""
        return prompt.rfind(END) <= prompt.rfind(START) or START not in prompt

    def split(self, text: str, final: bool) -> ReasoningSplit:
        raise NotImplementedError

    @staticmethod
    def _until_end(text: str, final: bool) -> ReasoningSplit:
        body = text.lstrip()
        if not final and START.startswith(body):
            return ReasoningSplit("", "", False)  # may be `<think>` being written
        body = body[len(START) :] if body.startswith(START) else text
        at = body.find(END)
        if at >= 0:
            return ReasoningSplit(body[:at], body[at + len(END) :].lstrip("\n"), True)
        if not final:
            body = body[: len(body) - held_back(body, END)]
        return ReasoningSplit(body, "", False)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> ReasoningSplit:
        return self._until_end(text, final)


class Qwen3Parser(ReasoningParser):
    name = "qwen3"

    def split(self, text: str, final: bool) -> ReasoningSplit:
        body = text.lstrip()
        if body.startswith(START):
            return self._until_end(text, final)
        if not final and START.startswith(body):
            return ReasoningSplit(None, "", False)  # may be `<think>` being written
        return ReasoningSplit(None, text, True)


REASONING_PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (DeepSeekR1Parser(), Qwen3Parser())}


def get_reasoning_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"--reasoning-parser {name!r} is not known; choose one of {', '.join(REASONING_PARSERS)}"
        )
    return parser
