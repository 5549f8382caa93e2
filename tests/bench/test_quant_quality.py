"""`bench quant quality`'s agreement figures are with float32's greedy tokens, whichever forms are asked for
(a run of `--kinds Q8_0,Q4_0` once compared Q4_0 with Q8_0 and Q8_0 with itself: "agree 1.0")."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest


def test_agreement_is_with_float32_even_when_float32_is_not_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from specfleet.bench import quant

    # Each form's greedy tokens: float32 [1, 2, 3, 4]; Q8_0 diverges at the third token; Q4_0 at the first.
    tokens = {"fp32": [1, 2, 3, 4], "Q8_0": [1, 2, 9, 9], "Q4_0": [7, 7, 7, 7]}
    loaded: list[str] = []

    @contextmanager
    def weights(kind: str) -> Any:
        yield {"kind": kind}

    class FakeLLM:  # the engine at its constructor: only which form it runs matters here
        def __init__(self, **kw: Any) -> None:
            self.kind = kw["kind"]
            loaded.append(self.kind)

    monkeypatch.setattr(quant, "weights", weights)
    monkeypatch.setattr(quant, "LLM", FakeLLM)
    monkeypatch.setattr(quant, "greedy", lambda llm, prompts: [tokens[llm.kind]] * len(prompts))
    monkeypatch.setattr(quant, "perplexity", lambda llm: 1.0)

    out = quant.quality(["Q8_0", "Q4_0"])

    assert loaded == ["fp32", "Q8_0", "Q4_0"]  # the reference first
    assert "fp32" not in out  # not asked for, so not reported
    assert out["Q8_0"]["agree_prefix"] == 0.5 and out["Q8_0"]["exact"] == 0.0
    assert out["Q4_0"]["agree_prefix"] == 0.0
    both = quant.quality(["fp32", "Q8_0"])
    assert both["fp32"]["agree_prefix"] == 1.0 and both["Q8_0"]["agree_prefix"] == 0.5
