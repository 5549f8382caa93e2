"""Shared fixtures: the bundled model, loaded once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUNDLED = "bundled://smollm2-135m-instruct"


@pytest.fixture(scope="session")
def bundled_path():
    from specfleet.engine.model_loader import resolve_model

    return resolve_model(BUNDLED).path
