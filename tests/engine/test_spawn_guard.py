"""A script that creates a split model at its top level, without an `if __name__ == "__main__":` guard:
the spawn method re-runs it in every rank. The error must say so and what to do, not only
`WorkerDied: rank 1 exited with code 1` with Python's bootstrapping error buried in the worker's stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """\
import sys
from specfleet.engine import LLM

llm = LLM(model=sys.argv[1], tensor_parallel_size=2, max_model_len=128, kv_cache_gib=0.01)
print("engine started")
"""


@pytest.mark.slow
def test_an_unguarded_script_with_tensor_parallelism_says_to_add_the_main_guard(
    tmp_path: Path, tiny_llama: str
) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), tiny_llama], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode != 0, done.stdout[-2000:]
    last = done.stderr.strip().splitlines()[-1]  # the exception the user sees last
    assert last.startswith(
        "specfleet.engine.distributed.WorkerDied: rank 1 exited with code 1 while starting"
    ), done.stderr[-3000:]
    assert f"the script {script} creates the engine at its top level" in last
    assert 'Put the code that creates the LLM under `if __name__ == "__main__":`' in last
