"""Cores of their own for local engines (fleet/cores.py): the pool hands out the least-held cores, says when
it ran short, takes them back; a started engine process is pinned and sized to its cores."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from specfleet.engine.python_child import python_command
from specfleet.fleet.cores import CorePool
from specfleet.fleet.engines import EngineProcess
from specfleet.fleet.local import main as up_main


def test_the_pool_hands_out_exclusive_cores_until_it_runs_short_then_the_least_held() -> None:
    pool = CorePool(frozenset({0, 1, 2}))
    assert pool.take(2) == (frozenset({0, 1}), True)
    assert pool.take(1) == (frozenset({2}), True)
    assert pool.take(2) == (frozenset({0, 1}), False)  # every core held once: shares the lowest
    pool.give_back(frozenset({0, 1}))
    pool.give_back(frozenset({0, 1}))
    assert pool.take(2) == (frozenset({0, 1}), True)
    pool.give_back(frozenset({2}))
    with pytest.raises(ValueError, match="core 2 is not held"):
        pool.give_back(frozenset({2}))


@pytest.mark.parametrize("n", [0, 4])
def test_a_count_the_pool_lacks_is_refused_naming_the_limit(n: int) -> None:
    with pytest.raises(ValueError, match=r"cpus per engine=\d must be in \[1, 3\]"):
        CorePool(frozenset({0, 1, 2})).take(n)


def test_specfleet_up_refuses_more_cores_per_engine_than_the_machine_has(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = Path(__file__).parents[2] / "examples" / "smollm2-cpu.yaml"
    too_many = len(os.sched_getaffinity(0)) + 1
    assert up_main(["-f", str(example), "--cpus-per-engine", str(too_many)]) == 2
    assert f"--cpus-per-engine: cpus per engine={too_many} must be in [1, " in capsys.readouterr().err


def test_a_pinned_process_runs_on_its_cores_with_as_many_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From its first instruction: here the parent gets the CPU back only once its child has run to its end
    (as a loaded host may keep it off for a while), so a child pinned after its start reads every core."""
    real_popen = subprocess.Popen

    def parent_off_the_cpu(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        child = real_popen(*args, **kwargs)
        child.wait(30)
        return child

    monkeypatch.setattr(subprocess, "Popen", parent_off_the_cpu)
    own = os.sched_getaffinity(0)
    core = min(own)
    report = tmp_path / "report.json"
    probe = (
        "import json, os, sys; "
        "json.dump({'cores': sorted(os.sched_getaffinity(0)), 'omp': os.environ.get('OMP_NUM_THREADS')}, "
        "open(sys.argv[1], 'w'))"
    )
    engine = EngineProcess(
        0,
        0,
        python_command("-c", probe, str(report)),
        dict(os.environ),
        tmp_path / "engine.log",
        cpus=frozenset({core}),
    )
    engine.start()
    assert engine.proc is not None
    assert engine.proc.wait(timeout=30) == 0, engine.tail()
    assert json.loads(report.read_text()) == {"cores": [core], "omp": "1"}
    assert os.sched_getaffinity(0) == own  # the thread that started it runs where it ran before
    unpinned = EngineProcess(1, 0, python_command("-c", probe, str(report)), {}, tmp_path / "e1.log")
    unpinned.start()
    assert unpinned.proc is not None and unpinned.proc.wait(timeout=30) == 0
    assert json.loads(report.read_text()) == {"cores": sorted(os.sched_getaffinity(0)), "omp": None}
