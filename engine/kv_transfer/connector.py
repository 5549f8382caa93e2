"""The engine's KV connector: the scheduler-side decisions (which blocks to hold, which to load) over the
worker-side transport (zmq_transport). One per engine; the engine calls it at four points: a sequence
finishing (`on_finish`), the start of each step (`poll` and `admit_remote`), and an abort (`abort`).

Decode side, per remote request: its own prefix-cache hits (chained block hashes, BlockManager.lookup_prefix)
are adopted and not transferred; the rest of the prompt's blocks are pulled. The sequence then joins the
running set with its prompt computed, so its first step is a decode of the first token. A failed pull
(prefill engine gone, hold expired) frees what was allocated and queues the sequence for a local prefill:
slower, same output.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from specfleet.engine.block_manager import BlockManager
from specfleet.engine.kv_transfer.base import KVTransferError, KVTransferParams
from specfleet.engine.kv_transfer.blocks import KVCaches, bytes_per_token
from specfleet.engine.kv_transfer.zmq_transport import KVConsumer, KVProducer
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
        return bool(self._remote)

    def admit_remote(self) -> None:
        """Load the KV of waiting remote requests, FCFS, while sequence slots and free blocks allow."""
        sched = self.scheduler
        while self._remote and len(sched.running) < sched.max_num_seqs and not sched.waiting:
            seq, params = self._remote[0]
            hits = self.kv.lookup_prefix(seq)
            if not self.kv.can_allocate(seq, seq.num_tokens, hits):
                return
            self._remote.popleft()
            self.kv.allocate(seq, seq.num_tokens, hits)
            wanted = seq.block_table[len(hits) : params.num_blocks]
            try:
                self.consumer.pull(params, len(hits), wanted)
            except KVTransferError as exc:
                log.warning(
                    "event=kv_pull_failed request_id=%s fallback=recompute error=%s", seq.request_id, exc
                )
                self.kv.free_seq(seq)
                self.stats.fallbacks += 1
                sched.add(seq)
                continue
            self._loaded(seq, params, len(hits), len(wanted))

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
        """Drop a remote request that has not loaded yet (True), releasing the prefill engine's hold."""
        for i, (queued, params) in enumerate(self._remote):
            if queued is seq:
                del self._remote[i]
                self.consumer.release(params)
                seq.status = Status.FINISHED
                seq.finish_reason = "abort"
                return True
        return False

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
