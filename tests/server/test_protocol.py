"""Model-free checks of the request models and of turning cumulative outputs into stream deltas."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from specfleet.engine.outputs import CompletionOutput, PositionLogprobs
from specfleet.engine.server import serving
from specfleet.engine.server.protocol import ChatCompletionRequest, CompletionRequest


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_shapes(prompt: object, expected: list[object]) -> None:
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_sampling_defaults_and_aliases() -> None:
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_params().max_tokens == 16
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        max_tokens=9,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=3,
        stop="END",
    )
    params = chat.to_sampling_params()
    assert params.max_tokens == 5 and params.logprobs == 3 and params.stop == ["END"]
    assert (
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params().max_tokens
        is None
    )


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "logit_bias": {"x": 1.0}},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "min_p": 2},
        {"prompt": []},
        {"prompt": "x", "stop": [""]},
    ],
)
def test_rejected_bodies(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(**body)


def test_completion_deltas_concatenate_and_finish_once() -> None:
    text = serving.TokenText(FakeTokenizer())
    cursor = serving.ChoiceCursor()
    lps = [
        PositionLogprobs(0, -0.1, {0: -0.1}),
        PositionLogprobs(1, -0.2, {1: -0.2}),
        PositionLogprobs(2, -0.3, {2: -0.3}),
    ]
    states = [
        CompletionOutput(0, "a", [0], None, None, lps[:1]),
        CompletionOutput(0, "a", [0], None, None, lps[:1]),  # nothing new: no chunk
        CompletionOutput(0, "abc", [0, 1, 2], "length", None, lps),
    ]
    choices = [serving.completion_delta(s, cursor, 0, True, text) for s in states]
    assert choices[1] is None
    assert choices[0]["text"] + choices[2]["text"] == "abc"
    assert choices[2]["finish_reason"] == "length" and choices[0]["finish_reason"] is None
    assert choices[2]["logprobs"]["tokens"] == ["b", "c"] and choices[2]["logprobs"]["text_offset"] == [1, 2]
    assert serving.completion_delta(states[2], cursor, 0, True, text) is None


def test_chat_deltas_start_with_the_role() -> None:
    text = serving.TokenText(FakeTokenizer())
    cursor = serving.ChoiceCursor()
    first = serving.chat_delta(CompletionOutput(0, "Hi", [7]), cursor, 1, None, text)
    last = serving.chat_delta(CompletionOutput(0, "Hi!", [7, 8], "stop"), cursor, 1, None, text)
    assert first["delta"] == {"role": "assistant", "content": "Hi"} and first["index"] == 1
    assert last["delta"] == {"content": "!"} and last["finish_reason"] == "stop"
