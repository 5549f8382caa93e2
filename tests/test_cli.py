"""The `specfleet` console script: offline generation prints text; bad input exits 2 with the message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXE = str(Path(sys.executable).parent / "specfleet")


@pytest.mark.slow
def test_generate_prints_the_answer():
    out = subprocess.run(
        [EXE, "generate", "--max-tokens", "12", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "finish_reason=" in out.stdout


def test_unknown_command_and_bad_model():
    out = subprocess.run([EXE, "frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr
    out = subprocess.run(
        [EXE, "generate", "--model", "gopher://x", "hi"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "unknown source scheme 'gopher'" in out.stderr
    out = subprocess.run([EXE, "bench", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "choose one of" in out.stderr
