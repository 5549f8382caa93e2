"""The request defaults the engine puts in force (--generation-config) as the HTTP models apply them: a
field left out or sent as null takes the engine's default, an explicit value keeps its meaning."""

from __future__ import annotations

import pytest
from specfleet.engine.server.protocol import ChatCompletionRequest, CompletionRequest

DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "make",
    [lambda **f: CompletionRequest(prompt="x", **f), lambda **f: ChatCompletionRequest(messages=CHAT, **f)],
)
def test_left_out_and_null_take_the_engines_defaults(make) -> None:
    for body in (make(), make(**dict.fromkeys(DEFAULTS))):
        params = body.to_sampling_params(DEFAULTS)
        assert {name: getattr(params, name) for name in DEFAULTS} == DEFAULTS


def test_explicit_values_win_one_by_one() -> None:
    explicit = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    for name, value in explicit.items():
        params = CompletionRequest.model_validate({"prompt": "x", name: value}).to_sampling_params(DEFAULTS)
        assert getattr(params, name) == value
        others = {k: getattr(params, k) for k in DEFAULTS if k != name}
        assert others == {k: v for k, v in DEFAULTS.items() if k != name}
