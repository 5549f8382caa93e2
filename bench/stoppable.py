"""Running a benchmark's event loop so that `kill` stops it as Ctrl-C does.

`asyncio.run` turns SIGINT into the main task's cancellation, so a benchmark's `finally` stops the local
fleet it started; SIGTERM (`kill`, `timeout`, a CI runner's cancel) killed the process outright and left
the fleet's engine processes running. `run` gives SIGTERM the same path.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
EXIT_ON_SIGTERM = 128 + signal.SIGTERM  # the shell's convention for a process ended by a signal


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`; on SIGTERM the task is cancelled, its cleanup runs, and the process exits with
    143."""
    terminated = False

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def terminate() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, terminate)
        try:
            return await main
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if terminated:
            raise SystemExit(EXIT_ON_SIGTERM) from None
        raise
