"""The test plant stands apart from the policy: its own measured step table, none of the policy's model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from specfleet.tuner.types import TunedConfig

from .plant import CPU_2CORES, Plant


def test_plant_does_not_import_the_policy() -> None:
    tree = ast.parse(Path(__file__).with_name("plant.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if "policy" in m or "goodput" in m], imported


@pytest.mark.parametrize(
    "tokens, ms", [(1, 18.0), (5, 21.6), (8, 30.0), (32, 105.0), (64, 197.0), (96, 289.0)]
)
def test_step_table_reads_the_measured_figures(tokens: float, ms: float) -> None:
    """Through the documented points, and past the last at the slope of the last two (2.875 ms a token)."""
    assert CPU_2CORES.seconds(tokens) == pytest.approx(ms / 1000)


def test_plant_step_is_the_table_at_the_tokens_of_the_step() -> None:
    """32 sequences, k=1, no prefill: 64 tokens in the forward pass, 197 ms."""
    plant = Plant(demand=32, prefill_tokens_per_request=0.0)
    obs = plant.observe(0.0, TunedConfig(1, 32, 1024))
    assert obs.step_duration_s == pytest.approx(0.197)
    assert obs.batch_size == 32 and obs.draft_token_rate == pytest.approx(32 / 0.197)
