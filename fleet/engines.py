"""One local engine process as a Deployment's pod would be: started, watched, restarted with backoff.

Plain bookkeeping around `subprocess.Popen`; the supervisor (supervisor.py) decides when to call it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .cores import spawned_on

# Restart backoff, as the kubelet's CrashLoopBackOff but scaled to a laptop: the kubelet waits 10 s doubling
# to 5 min; a local engine loads in 2-10 s, so 1 s doubling to 30 s keeps a crash loop from eating the
# CPU while a one-off crash is back within seconds. An engine that ran this long resets the backoff.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0
LOG_TAIL_LINES = 15


def backoff_delay(consecutive_failures: int) -> float:
    """Seconds to wait before restart number `consecutive_failures` (1, 2, ...)."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, consecutive_failures - 1))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True)
class Startup:
    """One engine start that reached /ready: its cold start, from its process start to its first ready
    probe (model load included), as a pod's is from container start to Ready."""

    index: int
    cause: str  # EngineProcess.cause
    ready_at: float  # monotonic
    seconds: float


@dataclass
class EngineProcess:
    index: int
    port: int
    command: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive exits without a run of BACKOFF_RESET_AFTER_S
    restarts: int = 0
    restart_at: float | None = None  # when the pending restart is due
    retiring: bool = False  # being scaled down: its exit is expected, never restarted
    exit_codes: list[int] = field(default_factory=list)
    role: str | None = None  # "prefill"/"decode" with spec.disaggregation (its --kv-role), None: aggregated
    cause: str = "start"  # why its process last started: "start" (with the fleet), "scale-up", "restart"
    ready_at: float | None = None  # when it first answered /ready since that start (None: not yet)
    cpus: frozenset[int] | None = None  # the cores it is pinned to (cores.py), None: every core

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        env = self.env if self.cpus is None else {**self.env, "OMP_NUM_THREADS": str(len(self.cpus))}
        log = open(self.log_path, "ab")
        try:
            with spawned_on(self.cpus):  # on its cores before it imports torch, which sizes its pool to them
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            log.close()
        self.started_at = time.monotonic()
        self.restart_at = None
        self.ready_at = None

    def reap(self, now: float) -> int | None:
        """If the process exited: its code, with the restart scheduled (unless retiring); else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        self.exit_codes.append(code)
        self.proc = None
        if not self.retiring:
            self.failures = 1 if now - self.started_at >= BACKOFF_RESET_AFTER_S else self.failures + 1
            self.restart_at = now + backoff_delay(self.failures)
        return code

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_bytes()[-16384:].decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])

    def terminate(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()
