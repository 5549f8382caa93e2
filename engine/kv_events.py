"""KV cache events in vLLM's wire format (vllm/distributed/kv_events.py), so a vLLM subscriber (llm-d's
indexer, vLLM's example subscriber) reads specfleet's stream, and specfleet's router reads a vLLM engine's.

- `--kv-events-config` takes vLLM's JSON: `enable_kv_cache_events` (off by default), `publisher` ("zmq"),
  `endpoint` (PUB, default `tcp://*:5557`), `replay_endpoint` (ROUTER, none by default), `buffer_steps`,
  `hwm`, `max_queue_size`, `topic`.
- The block manager records `BlockStored` when full blocks enter the prefix cache and `BlockRemoved` when a
  cached block is evicted; the engine hands each step's events to the publisher as one `KVEventBatch`,
  whose thread encodes and sends them (the step only appends to a list).
- Wire: msgpack of msgspec structs, arrays (`array_like`) with a tag naming each event; PUB multipart
  `(topic, seq, payload)` with `seq` an 8-byte big-endian counter from 0; the replay socket takes
  `(identity, "", start_seq)` and answers every buffered `(seq, payload)` from `start_seq` on, then
  `seq = -1` with an empty payload.

Hashes: `block_hashes` are the engine's own (process-local) chained hashes, good for pairing a removal with
its store; `token_ids` carry each block's tokens and `parent_block_hash` its chain, so a consumer re-hashes
in its own scheme (as llm-d does). A salted chain's first block carries `extra_keys` `[["cache_salt",
digest]]`, the salt's 64-bit blake2b (never the salt itself), which the router's salted seed is built from.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq
from specfleet.engine.kv_events_config import KVEventsConfig

logger = logging.getLogger("specfleet.engine.kv_events")

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # every block's tokens, concatenated
    block_size: int
    lora_id: int | None  # vLLM's deprecated field, kept for its position; always None here
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # per block; see the module's note on salts


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def salt_digest(salt: str) -> int:
    """The 64-bit digest of a cache_salt that events carry: the router's `stable_hash` (router/prefix.py),
    a test keeps the two equal."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local endpoint, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket plus a replay ROUTER, served by one thread that owns both sockets."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        self.dropped = 0  # batches the full queue refused
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """Called on the engine thread: never blocks; a full queue drops the batch (the subscriber sees the
        sequence gap it leaves only if the batch had been numbered, so it counts in `dropped`)."""
        batch = KVEventBatch(time.time(), events, self._rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("event=kv_events_bad_replay_request frames=%d", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))
