"""The live knobs' limits in one engine: the admin API's 400 and `--live-config-file`'s check at start.

A module of its own, beside `config.py` rather than in it: `ParameterError` comes with `sampling_params`,
which imports torch, and the operator imports `config.py` (the speculative methods) without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specfleet.engine.config import EngineConfig
from specfleet.engine.knobs import live_limits, live_refusal
from specfleet.engine.sampling_params import ParameterError


def check_live(config: EngineConfig, changes: Mapping[str, int]) -> None:
    """Refuse live knob values outside [the knob's minimum, its ceiling fixed at start by `config`],
    naming the field and the limit."""
    limits = live_limits(lambda knob: getattr(config, knob.ceiling))
    for name, value in changes.items():
        why = live_refusal(limits, name, value)
        if why is not None:
            raise ParameterError(name, why)


def start_on(config: EngineConfig, changes: Mapping[str, int]) -> EngineConfig:
    """`config` starting on other live values (checked as `check_live` does). The ceilings stay the ones
    `config` fixes: a lower start value must not lower a default ceiling with it."""
    check_live(config, changes)
    values: dict[str, Any] = dict(changes)
    return replace(
        config,
        max_num_seqs_limit=config.seqs_limit,
        max_num_batched_tokens_limit=config.batched_tokens_limit,
        **values,
    )
