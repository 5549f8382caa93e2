"""Engine fixtures shared by the engine tests (the checkpoints themselves come from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from specfleet.engine import LLM

# The offline engine the semantics tests share: 4-token blocks so short prompts span several blocks (prefix
# hits, trimming and preemption happen at block edges), and a context long enough for their prompts.
TINY_LLM_KWARGS: dict[str, Any] = {"block_size": 4, "max_model_len": 256}


@pytest.fixture(scope="module")
def tiny(tiny_llama: str) -> LLM:
    """An offline `LLM` on the random tiny Llama, one per test module."""
    return LLM(model=tiny_llama, **TINY_LLM_KWARGS)


@pytest.fixture
def make_tiny(tiny_llama: str) -> Callable[..., LLM]:
    """`tiny`'s settings with some changed, for a test that compares engine configurations."""
    return lambda **changes: LLM(model=tiny_llama, **{**TINY_LLM_KWARGS, **changes})
