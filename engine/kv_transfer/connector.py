"""The engine's KV connector: the scheduler-side decisions (which blocks to hold, which to load) over the
worker-side transport (zmq_transport). One per engine; the engine calls it at four points: a sequence
finishing (`on_finish`), the start of each step (`poll` and `admit_remote`), an empty step (`wait`) and an
abort (`abort`).

Decode side, per remote request: its own prefix-cache hits (chained block hashes, BlockManager.lookup_prefix)
are adopted and not transferred; blocks are allocated for the rest, and the sequence waits in
WAITING_FOR_REMOTE_KVS (vLLM's connector state) while a worker thread pulls them: the engine keeps stepping
its other sequences meanwhile. When the pull's bytes are in, the engine thread writes them into the blocks
(no step reads a waiting sequence's blocks, and no other sequence can find them: they enter the prefix cache
only once written) and the sequence joins the running set with its prompt computed, so its first step is a
decode of the first token. A failed pull (prefill engine gone, hung past `kv_transfer_timeout_s`, hold
expired, an answer that is not blocks) frees what was allocated and queues the sequence for a local
prefill: slower, same output. So does any error while admitting a remote request: it is that request's
fallback, never the engine's failure.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.kv_transfer.base import KVTransferError, KVTransferParams
from specfleet.engine.kv_transfer.blocks import KVCaches, bytes_per_token
from specfleet.engine.kv_transfer.zmq_transport import KVConsumer, KVProducer
from specfleet.engine.outputs import KVTransferMetrics
from specfleet.engine.scheduler import Scheduler
from specfleet.engine.sequence import Sequence, Status

log = logging.getLogger("specfleet.engine.kv_transfer")


@dataclass
class KVTransferStats:
    transfers: int = 0
    blocks_loaded: int = 0
    blocks_skipped: int = 0  # decode-side prefix hits that needed no transfer
    bytes_loaded: int = 0
    seconds: float = 0.0
    fallbacks: int = 0  # pulls that failed and were recomputed locally
    waiting_for_remote_kvs: int = 0  # requests whose pull is in flight now


# The worker's socket timeouts end a pull within kv_transfer_timeout_s (send, then receive); past twice that
# plus this margin the engine stops waiting for a worker stuck elsewhere and recomputes the prompt itself.
PULL_DEADLINE_MARGIN_S = 1.0


@dataclass(eq=False)
class _Pull:
    """One remote request's pull: set up by the engine thread, filled by its worker thread."""

    seq: Sequence
    params: KVTransferParams
    num_hits: int
    block_ids: list[int]  # local blocks the pulled ones go to
    deadline: float
    start: float = field(default_factory=time.perf_counter)
    began: float = field(default_factory=time.monotonic)  # the request's trace (KVTransferMetrics)
    data: torch.Tensor | None = None
    error: BaseException | None = None


def _timing(pull: _Pull, fallback: bool) -> KVTransferMetrics:
    """What the request's trace says of its pull (engine/server/tracing.py: the kv_transfer span)."""
    data = pull.data
    return KVTransferMetrics(
        pull.began,
        time.monotonic(),
        0 if fallback else len(pull.block_ids),
        pull.num_hits,
        0 if fallback or data is None else data.numel() * data.element_size(),
        fallback,
        f"{pull.params.remote_host}:{pull.params.remote_port}",
    )


class KVConnector:
    def __init__(
        self,
        role: str,
        kv: BlockManager,
        scheduler: Scheduler,
        kv_caches: KVCaches,
        host: str,
        port: int,
        timeout_s: float,
    ):
        self.role, self.kv, self.scheduler = role, kv, scheduler
        self.producer = KVProducer(kv_caches, host, port, timeout_s) if role == "prefill" else None
        self.consumer = KVConsumer(kv_caches, timeout_s)
        self._remote: deque[tuple[Sequence, KVTransferParams]] = deque()
        self._pulls: dict[int, _Pull] = {}  # seq_id -> pull in flight (WAITING_FOR_REMOTE_KVS)
        self._pulled: queue.SimpleQueue[_Pull] = queue.SimpleQueue()  # filled by the workers
        self._wake = threading.Event()  # set by a worker when its pull ended
        self.held: dict[int, KVTransferParams] = {}  # seq_id -> params of a finished prefill's hold
        self.stats = KVTransferStats()
        self.bytes_per_token = bytes_per_token(kv_caches)

    # -- prefill side --------------------------------------------------------------------------------
    def on_finish(self, seq: Sequence, reason: str, remote_decode: bool) -> None:
        """Before the scheduler frees a finished sequence: a prefill that ended on its one token keeps its
        prompt's blocks (own references) for the decoder."""
        if self.producer is None or not remote_decode or reason != "length" or seq.num_output_tokens != 1:
            return
        blocks = seq.block_table[: self.kv.blocks_for(seq.num_prompt_tokens)]
        self.kv.hold(blocks)
        self.held[seq.seq_id] = self.producer.hold(
            seq.request_id, blocks, seq.num_prompt_tokens, seq.token_ids[seq.num_prompt_tokens]
        )

    def poll(self) -> None:
        """Unreference the blocks of holds that ended (engine thread)."""
        if self.producer is not None:
            for blocks in self.producer.poll():
                self.kv.release(blocks)

    @property
    def num_holds(self) -> int:
        return self.producer.num_holds if self.producer is not None else 0

    # -- decode side ---------------------------------------------------------------------------------
    def add_remote(self, seq: Sequence, params: KVTransferParams) -> None:
        if params.num_tokens != seq.num_prompt_tokens or params.num_blocks != self.kv.blocks_for(
            params.num_tokens
        ):
            raise ValueError(
                f"kv_transfer_params num_tokens={params.num_tokens} num_blocks={params.num_blocks} do "
                f"not match the prompt's {seq.num_prompt_tokens} tokens at block size "
                f"{self.kv.block_size}"
            )
        self._remote.append((seq, params))

    def has_remote(self) -> bool:
        return bool(self._remote or self._pulls)

    def admit_remote(self) -> None:
        """Take the pulls that ended, then start pulls for waiting remote requests, FCFS, while sequence
        slots (running plus pulling) and free blocks allow. Never raises for one request's sake."""
        self._collect()
        sched = self.scheduler
        while (
            self._remote and len(sched.running) + len(self._pulls) < sched.max_num_seqs and not sched.waiting
        ):
            seq, params = self._remote[0]
            if seq.is_finished:  # ended while queued (a stop string in the first token's text)
                self._remote.popleft()
                self._release(params)
                continue
            hits = self.kv.lookup_prefix(seq)
            if not self.kv.can_allocate(seq, seq.num_tokens, hits):
                return
            self._remote.popleft()
            try:
                self.kv.allocate(seq, seq.num_tokens, hits)
                wanted = seq.block_table[len(hits) : params.num_blocks]
                now = time.monotonic()
                pull = _Pull(
                    seq, params, len(hits), wanted, now + 2 * self.consumer.timeout_s + PULL_DEADLINE_MARGIN_S
                )
                threading.Thread(target=self._fetch, args=(pull,), name="kv-pull", daemon=True).start()
            except Exception as exc:
                self._fall_back(seq, exc)
                continue
            seq.status = Status.WAITING_FOR_REMOTE_KVS
            self._pulls[seq.seq_id] = pull
        self.stats.waiting_for_remote_kvs = len(self._pulls)

    def _fetch(self, pull: _Pull) -> None:
        """A pull's worker thread: the network part only; the engine thread writes the blocks."""
        try:
            pull.data = self.consumer.fetch(pull.params, pull.num_hits, len(pull.block_ids))
        except BaseException as exc:  # whatever it is, the engine thread falls back on it
            pull.error = exc
        finally:
            self._pulled.put(pull)
            self._wake.set()

    def _collect(self) -> None:
        """Engine thread: write the blocks of pulls that ended and admit their sequences, or fall back."""
        self._wake.clear()
        while True:
            try:
                pull = self._pulled.get_nowait()
            except queue.Empty:
                break
            if self._pulls.get(pull.seq.seq_id) is not pull:
                continue  # aborted, or given up at its deadline: its blocks are already free
            del self._pulls[pull.seq.seq_id]
            seq = pull.seq
            if seq.is_finished:  # ended while it waited (a stop string in the first token's text)
                continue
            if pull.error is not None:
                self._fall_back(seq, pull.error, pull)
                continue
            try:
                self.consumer.write(pull.block_ids, pull.data, time.perf_counter() - pull.start)
                self._loaded(seq, pull.params, pull.num_hits, len(pull.block_ids))
                seq.kv_transfer = _timing(pull, False)
            except Exception as exc:
                self._fall_back(seq, exc, pull)
        now = time.monotonic()
        for pull in [p for p in self._pulls.values() if p.deadline <= now]:
            del self._pulls[pull.seq.seq_id]
            if not pull.seq.is_finished:
                error = KVTransferError("the pull's worker did not return by its deadline")
                self._fall_back(pull.seq, error, pull)
        self.stats.waiting_for_remote_kvs = len(self._pulls)

    def _fall_back(self, seq: Sequence, exc: BaseException, pull: _Pull | None = None) -> None:
        """The prompt is recomputed here: free what the pull had, queue the sequence for a local prefill."""
        if pull is not None:
            seq.kv_transfer = _timing(pull, True)
        log.warning(
            "event=kv_pull_failed request_id=%s fallback=recompute error=%s",
            seq.request_id,
            f"{type(exc).__name__}: {exc}",
        )
        self.kv.free_seq(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = Status.WAITING
        self.stats.fallbacks += 1
        self.scheduler.add(seq)

    def wait(self, timeout_s: float) -> None:
        """An empty step while pulls are in flight: wait up to `timeout_s` for one to end, instead of the
        caller spinning (engine thread)."""
        if self._pulls and self._pulled.empty():
            self._wake.wait(timeout_s)

    def _loaded(self, seq: Sequence, params: KVTransferParams, num_hits: int, num_loaded: int) -> None:
        cached = num_hits * self.kv.block_size
        if self.kv.debug:
            self.kv.note_computed(seq, cached, seq.token_ids[cached : params.num_tokens])
        seq.num_computed_tokens, seq.num_cached_tokens = params.num_tokens, cached
        self.kv.cache_full_blocks(seq)
        self.scheduler.add_running(seq, cached)
        s = self.stats
        s.transfers += 1
        s.blocks_loaded += num_loaded
        s.blocks_skipped += num_hits
        s.bytes_loaded = self.consumer.bytes_received
        s.seconds = self.consumer.seconds

    def abort(self, seq: Sequence) -> bool:
        """Drop a remote request that has not loaded yet (True): queued, its prefill engine's hold is
        released; pulling, its blocks are freed now and the pull's answer (which ends the hold) discarded."""
        for i, (queued, params) in enumerate(self._remote):
            if queued is seq:
                del self._remote[i]
                self._release(params)
                seq.status = Status.FINISHED
                seq.finish_reason = "abort"
                return True
        if self._pulls.pop(seq.seq_id, None) is not None:
            self.kv.free_seq(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = "abort"
            self.stats.waiting_for_remote_kvs = len(self._pulls)
            return True
        return False

    def _release(self, params: KVTransferParams) -> None:
        """Tell the prefill engine to drop a hold, off the engine thread (a hung peer costs a timeout)."""
        threading.Thread(target=self.consumer.release, args=(params,), name="kv-release", daemon=True).start()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
