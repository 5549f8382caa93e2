"""Processes of a split model: rank 0 is the engine's own process, ranks 1.. are workers it spawns.

A model is split by tensor parallelism (`ShardedLlama`: every rank holds a slice of every layer), by
pipeline parallelism (`StageLlama`: every stage holds a run of layers), or both (each stage's run of
layers sliced over its own ranks). The engine's scheduler runs once, on rank 0. `SplitModel` stands where the runner expects
a model: each `forward` call (and with tensor parallelism each `logits` call) is sent to every worker over
a pipe (the step's ids, positions and attention metadata, a few KB), then run on rank 0's own part; the
communication inside the forward pass meets the workers' identical calls. Each rank keeps its own paged KV cache with its KV heads, allocated on the
first step with the block count rank 0 chose. Workers are started with the `spawn` method (a fork would
copy rank 0's threads and CUDA state) and load and slice the checkpoint themselves.

A worker that dies makes rank 0's next collective fail (gloo sees the closed connection; NCCL times out
after COLLECTIVE_TIMEOUT_S): rank 0 then raises `WorkerDied` naming the rank and its exit code, instead of
hanging; an idle engine finds out from `check_workers`. At start, each worker says on its pipe that it is
about to join the process group and, later, that its part is loaded; rank 0 waits for each message while
watching the worker's process, so a worker that dies before joining or while loading is a `WorkerDied` at
once, not a wait in the group's rendezvous or a raw EOFError. A worker whose pipe closes (rank 0 gone) exits.

The spawn method imports the main script again in every worker before the worker's function runs. A script
that creates its `LLM(tensor_parallel_size=2)` at top level, without an `if __name__ == "__main__":`
guard, thus makes each worker build an engine of its own, which tries to spawn ranks while still
bootstrapping, and Python's error says so only in the worker's stderr. A `SplitModel` made in a worker
that is still bootstrapping leaves a note for rank 0 and raises; rank 0 turns the worker's exit into a
`WorkerDied` that names the script and says what to do, as vLLM's troubleshooting guide does.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from specfleet.engine.attention.base import AttentionMetadata
from specfleet.engine.attention.registry import get_attention_backend
from specfleet.engine.distributed import WorkerDied
from specfleet.engine.distributed.comm import GroupAddress, RankGroup, backend_for
from specfleet.engine.distributed.pipeline import StageLlama
from specfleet.engine.distributed.sharded_llama import ShardedLlama, split_class
from specfleet.engine.ports import free_port

log = logging.getLogger("specfleet.engine.distributed")

# How long rank 0 waits for a live worker to join the group, and then to load its slice, before giving up:
# a 70B checkpoint read from a network volume takes minutes.
STARTUP_TIMEOUT_S = 600.0
# How long a failed collective or pipe waits for a worker to exit, to name it and its exit code: a peer's
# death closes its sockets and its sentinel at once, so this is only spent when the failure was something
# else (every worker then still runs).
EXIT_WAIT_S = 5.0
# How often rank 0 looks at a worker's process while it waits for the worker's next start-up message: a
# dead worker is reported within this (its pipe's EOF usually wakes the wait at once).
STARTUP_POLL_S = 0.1


def _bootstrap_note(parent_pid: int) -> str:
    """Where a worker still importing the main script tells rank 0 (pid `parent_pid`) so."""
    return os.path.join(tempfile.gettempdir(), f"specfleet-unguarded-main-{parent_pid}")


def _unguarded_main_message(script: str) -> str:
    return (
        f"the script {script} creates the engine at its top level, without an "
        '`if __name__ == "__main__":` guard: a split model starts its ranks with the spawn method, which '
        "imports the main script again in every rank, so each rank ran the script and tried to start an "
        'engine of its own. Put the code that creates the LLM under `if __name__ == "__main__":` '
        "(https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods)"
    )


def _refuse_while_bootstrapping() -> None:
    """In a spawned worker that is still importing the main script: leave the note and raise (the error a
    spawn here would raise, Python's "An attempt has been made to start a new process before the current
    process has finished its bootstrapping phase", does not say which code to move)."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main script"
    try:  # spawn starts the worker as rank 0's direct child (fork + exec); parent_process() is not set yet
        with open(_bootstrap_note(os.getppid()), "w") as f:
            f.write(script)
    except OSError:
        pass  # rank 0 then reports the bare exit code; this worker's stderr has the message below
    raise RuntimeError(_unguarded_main_message(script))


def _threads_per_rank(size: int) -> int:
    """CPU ranks share the machine's cores: each gets an equal budget, at least one thread."""
    return max(1, (os.cpu_count() or 1) // size)


def _load_part(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    group: RankGroup,
    native: bool | None,
    quantization: str | None,
    gguf: str | None,
    max_model_len: int | None = None,
) -> ShardedLlama | StageLlama:
    """The rank's part of the checkpoint: a tensor-parallel slice, a pipeline stage, or a stage's slice, of
    the architecture's own model class (split_class)."""
    from pathlib import Path

    from specfleet.engine.checkpoint import checkpoint_state, load_hf_config
    from specfleet.engine.models import model_class

    path, hf_config = Path(model_path), load_hf_config(Path(model_path))
    state = checkpoint_state(path, Path(gguf) if gguf else None, hf_config, quantization)
    cls = split_class(StageLlama if group.stages > 1 else ShardedLlama, model_class(hf_config.architectures))
    return cls(hf_config, state, dtype, device, group, native, quantization, max_model_len=max_model_len)


def _worker_main(
    rank: int,
    address: GroupAddress,
    model_path: str,
    dtype: torch.dtype,
    device_type: str,
    native: bool | None,
    quantization: str | None,
    gguf: str | None,
    max_model_len: int | None,
    conn: multiprocessing.connection.Connection,
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    torch.set_num_threads(_threads_per_rank(address.size))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(("joining", rank))
    group = RankGroup(address, rank)
    model = _load_part(model_path, dtype, device, group, native, quantization, gguf, max_model_len)
    conn.send(("ready", rank))
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    attn = None
    try:
        with torch.inference_mode():
            while True:
                try:
                    command, *payload = conn.recv()
                except EOFError:
                    return  # rank 0 is gone
                if command == "stop":
                    return
                if command == "forward":
                    input_ids, positions, meta, (num_blocks, block_size, backend) = payload
                    if not kv_caches:
                        a = model.args
                        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
                        kv_caches = [
                            (
                                torch.zeros(shape, dtype=dtype, device=device),
                                torch.zeros(shape, dtype=dtype, device=device),
                            )
                            for _ in range(a.num_layers)
                        ]
                        attn = get_attention_backend(backend, device, dtype)
                    meta = _received(meta, device)
                    assert attn is not None, "made with the KV caches on the first forward"
                    attn.prepare(meta)
                    input_ids = torch.from_numpy(input_ids).to(device)
                    positions = torch.from_numpy(positions).to(device)
                    model.forward(input_ids, positions, kv_caches, meta, attn)
                elif command == "logits":
                    (hidden,) = payload
                    model.logits(hidden.to(device))
    finally:
        group.close()


_META_TENSORS = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")


def _by_value(tensor: torch.Tensor) -> np.ndarray:
    """A step's integer input as a numpy copy, pickled by value through the pipe. A tensor would go through
    torch.multiprocessing's shared-memory handover, which moves the sender's storage into a shared segment:
    per step a segment and a file descriptor for each input, and the runner's persistent input buffers
    (engine/input_buffers.py) would lose the memory their numpy views write to."""
    return tensor.cpu().numpy().copy()


def _step_message(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache) -> tuple:
    # numpy arrays in the tensor fields for the journey: `_received` makes them tensors again
    arrays: dict[str, Any] = {f: _by_value(getattr(meta, f)) for f in _META_TENSORS}
    meta = replace(meta, backend_state=None, **arrays)
    return ("forward", _by_value(input_ids), _by_value(positions), meta, cache)


def _received(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    tensors: dict[str, Any] = {f: torch.from_numpy(getattr(meta, f)).to(device) for f in _META_TENSORS}
    return replace(meta, **tensors)


class SplitModel:
    """Rank 0's model: its own part, and the workers driven in lockstep with it.

    `tp` ranks per stage (tensor parallelism), `pp` stages (pipeline parallelism), `tp * pp` processes."""

    def __init__(
        self,
        model_path: str,
        tp: int,
        pp: int,
        dtype: torch.dtype,
        device: torch.device,
        native: bool | None = None,
        quantization: str | None = None,
        gguf: str | None = None,
        max_model_len: int | None = None,
    ):
        size = tp * pp
        _refuse_while_bootstrapping()
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {size} CUDA devices; "
                f"{torch.cuda.device_count()} visible"
            )
        self.tp, self.pp = tp, pp
        self.split = "tensor" if pp == 1 else "pipeline" if tp == 1 else "tensor-and-pipeline"
        address = GroupAddress("127.0.0.1", free_port(), size, backend_for(device), tp)
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                name=f"specfleet-tp-rank{rank}",
                daemon=True,
                args=(
                    rank,
                    address,
                    model_path,
                    dtype,
                    device.type,
                    native,
                    quantization,
                    gguf,
                    max_model_len,
                    theirs,
                ),
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        self.group: RankGroup | None = None
        try:
            self._await_workers("joining", "joining the process group")
            try:
                self.group = RankGroup(address, 0)
            except RuntimeError as exc:  # the rendezvous timed out: a worker died after saying it joins
                raise WorkerDied(self._death(f"the process group did not form: {exc}")) from exc
            self.local = _load_part(
                model_path, dtype, device, self.group, native, quantization, gguf, max_model_len
            )
            self._await_workers("ready", "loading its part of the model")
        except BaseException:
            self._stop_workers(grace_s=0)  # the others wait in the rendezvous or load: nothing to finish
            raise
        self.args, self.embed = self.local.args, self.local.embed
        self.dtype, self.device = self.local.dtype, self.local.device
        log.info(
            "event=split_model_ready tp=%d pp=%d backend=%s rank0=%s workers=%s",
            tp,
            pp,
            address.backend,
            self.local.describe(),
            ",".join(f"rank{r}:pid{p.pid}" for r, p in enumerate(self._procs, 1)),
        )

    def _await_workers(self, message: str, what: str) -> None:
        """Wait for `message` from every worker (`what` it is doing meanwhile), at most STARTUP_TIMEOUT_S
        for each, watching its process: `WorkerDied` as soon as one exits instead."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not conn.poll(STARTUP_POLL_S):
                if not proc.is_alive() and not conn.poll(0):
                    break  # dead without a word: reported below
                if time.monotonic() > deadline:
                    raise WorkerDied(
                        self._death(f"rank {rank} was still {what} after {STARTUP_TIMEOUT_S:.0f}s")
                    )
            try:
                got = conn.recv()
            except (EOFError, OSError) as exc:
                raise WorkerDied(self._death(f"rank {rank} was {what}")) from exc
            assert got == (message, rank), f"rank {rank} sent {got!r} where {message!r} was due"

    def _send(self, message: tuple, ranks: int | None = None) -> None:
        """To every worker, or to ranks 1..ranks-1 only."""
        for conn in self._conns[: None if ranks is None else ranks - 1]:
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
                raise WorkerDied(self._death(f"could not send a step: {exc}")) from exc

    def _death(self, what: str) -> str:
        """The message of a `WorkerDied`: `what` failed, and which ranks have exited with which code.

        A dying process closes its files (its sockets, its sentinel pipe) before it can be reaped, and a
        large one on a loaded host takes a while in between: wait for a sentinel, then reap its process."""
        ready = multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=EXIT_WAIT_S)
        for proc in self._procs:
            if proc.sentinel in ready:
                proc.join()  # exiting: a blocking waitpid, done once the kernel has torn it down
        dead = [
            f"rank {r} exited with code {p.exitcode}"
            for r, p in enumerate(self._procs, 1)
            if not p.is_alive()
        ]
        note = _bootstrap_note(os.getpid())
        if os.path.exists(note):  # a worker re-ran an unguarded main script (see the module's docstring)
            try:
                with open(note) as f:
                    script = f.read()
                os.unlink(note)
            except OSError:
                script = "the main script"
            return f"{', '.join(dead) or 'a worker failed'} while starting: {_unguarded_main_message(script)}"
        return (
            f"{self.split}-parallel worker failure: {', '.join(dead) or 'all workers still running'} ({what})"
        )

    def _run(self, call, *args):
        try:
            return call(*args)
        except RuntimeError as exc:  # a collective that lost a peer
            raise WorkerDied(
                self._death(
                    f"a collective failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                )
            ) from exc

    @property
    def pipeline_depth(self) -> int:
        """How many micro-batches can usefully be in flight at once: one per pipeline stage (tensor
        parallelism runs every rank on the same batch: one)."""
        return self.pp

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata, attn
    ):
        self._send_step(input_ids, positions, kv_caches, meta, attn)
        return self._run(self.local.forward, input_ids, positions, kv_caches, meta, attn)

    def launch(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata, attn
    ) -> None:
        """Pipeline: start a micro-batch through the stages without waiting for its output (`collect`)."""
        self._send_step(input_ids, positions, kv_caches, meta, attn)
        self._run(self._stage().launch, input_ids, positions, kv_caches, meta, attn)

    def collect(self, num_tokens: int) -> torch.Tensor:
        """Pipeline: the hidden states of the oldest micro-batch launched and not collected yet."""
        return self._run(self._stage().collect, num_tokens)

    def _stage(self) -> StageLlama:
        assert isinstance(self.local, StageLlama), (
            "launch/collect need pipeline stages (pipeline_parallel_size > 1)"
        )
        return self.local

    def _send_step(self, input_ids, positions, kv_caches, meta: AttentionMetadata, attn) -> None:
        cache = (kv_caches[0][0].shape[0], kv_caches[0][0].shape[1], attn.name)
        self._send(_step_message(input_ids, positions, meta, cache))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:  # vocab-parallel lm_head: every rank of stage 0 computes its shard
            self._send(("logits", hidden.cpu()), ranks=self.tp)
        return self._run(self.local.logits, hidden)

    def check_workers(self) -> None:
        """`WorkerDied` if a worker has exited: the engine core asks while idle, when no collective would
        tell it."""
        if not all(proc.is_alive() for proc in self._procs):
            raise WorkerDied(self._death("found while the engine was idle"))

    def close(self) -> None:
        self._stop_workers(grace_s=10)

    def _stop_workers(self, grace_s: float) -> None:
        """Tell every worker to stop, give each `grace_s` to exit, then kill it."""
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        if self.group is not None:
            self.group.close()
