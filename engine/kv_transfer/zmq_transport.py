"""The ZeroMQ transport: the prefill engine serves held blocks, the decode engine pulls them.

One ROUTER socket on the prefill engine, served by its own thread; a request is one JSON frame
{"transfer_id", "first_block"} (pull blocks first_block.. of the hold) or {"transfer_id", "release": true};
the answer is a JSON header {"ok", "shape", "dtype"} and, for a pull, the raw bytes of the blocks as
`blocks.read_blocks` lays them out. The engine thread owns the block manager, so the server thread never
touches it: it reports finished holds on a queue that the engine thread drains (`KVProducer.poll`).
Reading blocks while the engine computes is safe because held blocks are referenced: nothing writes them.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq
from specfleet.engine.kv_transfer.base import KVTransferError, KVTransferParams
from specfleet.engine.kv_transfer.blocks import KVCaches, read_blocks, write_blocks
from specfleet.engine.kv_transfer.wire import _request, release_hold

log = logging.getLogger("specfleet.engine.kv_transfer")

# How often the server thread checks for shutdown while idle; a pull waits at most this long extra.
POLL_MS = 100
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


@dataclass
class _Hold:
    block_ids: list[int]
    num_tokens: int
    deadline: float


class KVProducer:
    """Prefill side: holds finished prompts' blocks and serves them until pulled, released or expired."""

    def __init__(self, kv_caches: KVCaches, host: str, port: int, timeout_s: float):
        self.kv_caches, self.host, self.timeout_s = kv_caches, host, timeout_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._holds: dict[str, _Hold] = {}
        self._lock = threading.Lock()
        self._done: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ids = 0
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._serve, name="kv-producer", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------------
    def hold(
        self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
    ) -> KVTransferParams:
        """Keep `block_ids` (the caller has referenced them) for a decoder; returns where they wait."""
        with self._lock:
            self._ids += 1
            transfer_id = f"{request_id}#{self._ids}"
            self._holds[transfer_id] = _Hold(list(block_ids), num_tokens, time.monotonic() + self.timeout_s)
        return KVTransferParams(self.host, self.port, transfer_id, num_tokens, len(block_ids), first_token_id)

    def poll(self) -> list[list[int]]:
        """Holds that ended (pulled, released, expired): their blocks, for the caller to unreference."""
        ended = []
        while True:
            try:
                ended.append(self._done.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        freed = []
        with self._lock:
            for transfer_id, hold in list(self._holds.items()):
                if hold.deadline <= now:
                    log.warning(
                        "event=kv_hold_expired transfer_id=%s blocks=%d", transfer_id, len(hold.block_ids)
                    )
                    ended.append(transfer_id)
            for transfer_id in ended:
                hold = self._holds.pop(transfer_id, None)
                if hold is not None:
                    freed.append(hold.block_ids)
        return freed

    @property
    def num_holds(self) -> int:
        with self._lock:
            return len(self._holds)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # -- server thread -----------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    continue
                identity, _, body = self._sock.recv_multipart()
                self._answer(identity, body)
        finally:
            self._sock.close(linger=0)

    def _answer(self, identity: bytes, body: bytes) -> None:
        try:
            message = json.loads(body)
            transfer_id = str(message["transfer_id"])
        except (ValueError, KeyError, TypeError):
            self._sock.send_multipart(
                [identity, b"", json.dumps({"ok": False, "error": "bad request"}).encode()]
            )
            return
        with self._lock:
            hold = self._holds.get(transfer_id)
        if hold is None:
            error = f"no KV blocks held under transfer_id={transfer_id!r} (expired or already taken)"
            self._sock.send_multipart([identity, b"", json.dumps({"ok": False, "error": error}).encode()])
            return
        if message.get("release"):
            self._done.put(transfer_id)
            self._sock.send_multipart([identity, b"", json.dumps({"ok": True}).encode()])
            return
        first = int(message.get("first_block", 0))
        data = read_blocks(self.kv_caches, hold.block_ids[first:]) if first < len(hold.block_ids) else None
        header = {
            "ok": True,
            "shape": list(data.shape) if data is not None else None,
            "dtype": str(self.kv_caches[0][0].dtype),
        }
        frames = [identity, b"", json.dumps(header).encode()]
        if data is not None:
            raw = data.contiguous().view(torch.uint8).numpy()
            frames.append(raw)
            self.bytes_sent += raw.nbytes
        self._sock.send_multipart(frames, copy=False)
        self._done.put(transfer_id)


class KVConsumer:
    """Decode side: pulls a hold's blocks into local blocks, or releases a hold it will not read."""

    def __init__(self, kv_caches: KVCaches, timeout_s: float):
        self.kv_caches, self.timeout_s = kv_caches, timeout_s
        self.bytes_received = 0
        self.blocks_received = 0
        self.seconds = 0.0

    def pull(self, params: KVTransferParams, first_block: int, block_ids: list[int]) -> None:
        """Blocks first_block.. of the hold into `block_ids` (one local block each)."""
        start = time.perf_counter()
        frames = _request(
            params, {"transfer_id": params.transfer_id, "first_block": first_block}, self.timeout_s
        )
        header = json.loads(frames[0])
        if not header.get("ok"):
            raise KVTransferError(header.get("error", "the prefill engine refused the transfer"))
        if not block_ids:
            return
        if header.get("shape") is None or len(frames) < 2 or header.get("dtype") not in _DTYPES:
            raise KVTransferError(f"the prefill engine sent no usable blocks: {header}")
        data = torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8).view(_DTYPES[header["dtype"]])
        write_blocks(self.kv_caches, block_ids, data.view(header["shape"]))
        self.bytes_received += len(frames[1])
        self.blocks_received += len(block_ids)
        self.seconds += time.perf_counter() - start

    def release(self, params: KVTransferParams) -> None:
        release_hold(params, min(self.timeout_s, 1.0))
