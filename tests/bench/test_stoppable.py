"""SIGTERM stops a benchmark as Ctrl-C does: its cleanup (stopping the local fleet's engines) runs."""

from __future__ import annotations

import signal
import subprocess
import textwrap

import pytest
from specfleet.bench import stoppable
from specfleet.engine.python_child import python_command

BENCH = textwrap.dedent(
    """
    import asyncio
    from specfleet.bench import stoppable

    async def bench():
        try:
            print("started", flush=True)
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # the cleanup awaits, as LocalFleet.stop does
            print("engines stopped", flush=True)

    stoppable.run(bench())
    print("not reached", flush=True)
    """
)


def test_sigterm_runs_the_cleanup_and_exits_143() -> None:
    proc = subprocess.Popen(
        python_command("-c", BENCH), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == stoppable.EXIT_ON_SIGTERM == 143, err
    assert out.splitlines() == ["engines stopped"]


def test_a_result_and_an_error_pass_through() -> None:
    async def value() -> int:
        return 7

    async def failing() -> None:
        raise ValueError("bad grid")

    assert stoppable.run(value()) == 7
    with pytest.raises(ValueError, match="bad grid"):
        stoppable.run(failing())
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler does not outlive the run
