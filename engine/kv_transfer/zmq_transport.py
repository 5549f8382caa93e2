"""The ZeroMQ transport: the prefill engine serves held blocks, the decode engine pulls them.

One ROUTER socket on the prefill engine, served by its own thread; a request is one JSON frame
{"transfer_id", "first_block"} (pull blocks first_block.. of the hold) or {"transfer_id", "release": true};
the answer is a JSON header {"ok", "shape", "dtype"} and, for a pull, the raw bytes of the blocks as
`blocks.read_blocks` lays them out. The engine thread owns the block manager, so the server thread never
touches it: it reports finished holds on a queue that the engine thread drains (`KVProducer.poll`).
Reading blocks while the engine computes is safe because held blocks are referenced: nothing writes them.
The blocks leave through a host copy (`.cpu()`), so a CUDA cache is served like a CPU one.

The server thread answers every message it can read and goes on: malformed JSON, wrong types, an unknown
transfer id or a frame layout no REQ socket sends get an error header, and anything else it raises is
logged and answered the same way. A message larger than `MAX_REQUEST_BYTES` makes ZeroMQ drop its sender.

The decode side is split in two (the connector runs them on two threads): `KVConsumer.fetch` (the network
round trip and the checks of the answer, on a pull's worker thread) and `KVConsumer.write` (into the paged
cache, on the engine thread).
"""

from __future__ import annotations

import json
import logging
import math
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
# A request is one small JSON object (a transfer id and a block index); ZeroMQ disconnects a peer sending
# more, so a garbage stream cannot make the server thread allocate without bound.
MAX_REQUEST_BYTES = 64 * 1024
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
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
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
                ended_hold = self._holds.pop(transfer_id, None)
                if ended_hold is not None:
                    freed.append(ended_hold.block_ids)
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
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                # A REQ peer's message is [identity, b"", body]; whatever precedes the body is the envelope
                # the answer goes back with.
                envelope, body = frames[:-1], frames[-1]
                try:
                    self._answer(envelope, body)
                except Exception as exc:  # a bug or a peer gone mid-answer: log, answer if possible, go on
                    log.exception("event=kv_serve_failed error=%s", type(exc).__name__)
                    self._reply(envelope, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            self._sock.close(linger=0)

    def _reply(self, envelope: list[bytes], header: dict, payload: memoryview | None = None) -> None:
        if not envelope:  # nothing to address an answer to
            return
        frames: list[bytes | memoryview] = [*envelope, json.dumps(header).encode()]
        if payload is not None:
            frames.append(payload)
        try:
            self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or not reading: it is the peer's loss
            log.warning("event=kv_reply_dropped error=%s", exc)

    def _answer(self, envelope: list[bytes], body: bytes) -> None:
        try:
            message = json.loads(body)
        except ValueError:  # UnicodeDecodeError too
            self._reply(envelope, {"ok": False, "error": "bad request: the body is not JSON"})
            return
        transfer_id = message.get("transfer_id") if isinstance(message, dict) else None
        if not isinstance(transfer_id, str) or not transfer_id:
            self._reply(
                envelope, {"ok": False, "error": "bad request: transfer_id must be a non-empty string"}
            )
            return
        with self._lock:
            hold = self._holds.get(transfer_id)
        if hold is None:
            error = f"no KV blocks held under transfer_id={transfer_id!r} (expired or already taken)"
            self._reply(envelope, {"ok": False, "error": error})
            return
        if message.get("release"):
            self._done.put(transfer_id)
            self._reply(envelope, {"ok": True})
            return
        first = message.get("first_block", 0)
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= len(hold.block_ids):
            error = (
                f"bad request: first_block must be an integer in [0, {len(hold.block_ids)}], got {first!r}"
            )
            self._reply(envelope, {"ok": False, "error": error})
            return
        data = read_blocks(self.kv_caches, hold.block_ids[first:]) if first < len(hold.block_ids) else None
        header = {
            "ok": True,
            "shape": list(data.shape) if data is not None else None,
            "dtype": str(self.kv_caches[0][0].dtype),
        }
        payload = None
        if data is not None:
            # A host copy first: `.numpy()` refuses a CUDA tensor (on CPU `.cpu()` returns the tensor itself).
            raw = data.cpu().contiguous().view(torch.uint8).numpy()
            payload = raw.data
            self.bytes_sent += raw.nbytes
        self._reply(envelope, header, payload)
        self._done.put(transfer_id)


class KVConsumer:
    """Decode side: pulls a hold's blocks into local blocks, or releases a hold it will not read."""

    def __init__(self, kv_caches: KVCaches, timeout_s: float):
        self.kv_caches, self.timeout_s = kv_caches, timeout_s
        self.bytes_received = 0
        self.blocks_received = 0
        self.seconds = 0.0

    def fetch(self, params: KVTransferParams, first_block: int, num_blocks: int) -> torch.Tensor | None:
        """Blocks first_block.. of the hold, as `read_blocks` lays them out (None when none are wanted).
        Touches no engine state: a pull's worker thread runs it. Any answer it cannot use is a
        KVTransferError, whatever the peer sent."""
        frames = _request(
            params, {"transfer_id": params.transfer_id, "first_block": first_block}, self.timeout_s
        )
        try:
            header = json.loads(frames[0])
        except ValueError as exc:
            raise KVTransferError(f"the prefill engine answered a header that is not JSON: {exc}") from exc
        if not isinstance(header, dict) or not header.get("ok"):
            error = header.get("error") if isinstance(header, dict) else None
            raise KVTransferError(str(error or f"the prefill engine refused the transfer: {header!r}"))
        if not num_blocks:
            return None
        shape = header.get("shape")
        if (
            len(frames) < 2
            or header.get("dtype") not in _DTYPES
            or not isinstance(shape, list)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
            or len(shape) < 3
            or shape[2] != num_blocks
        ):
            raise KVTransferError(f"the prefill engine sent no usable blocks for {num_blocks}: {header}")
        dtype = _DTYPES[header["dtype"]]
        if len(frames[1]) != math.prod(shape) * dtype.itemsize:
            raise KVTransferError(
                f"the prefill engine sent {len(frames[1])} bytes for blocks of shape {shape} in {dtype}"
            )
        return torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8).view(dtype).view(shape)

    def write(self, block_ids: list[int], data: torch.Tensor | None, seconds: float) -> None:
        """Write fetched blocks into `block_ids` (one local block each; engine thread)."""
        if data is not None:
            write_blocks(self.kv_caches, block_ids, data)
            self.bytes_received += data.numel() * data.element_size()
            self.blocks_received += len(block_ids)
        self.seconds += seconds

    def pull(self, params: KVTransferParams, first_block: int, block_ids: list[int]) -> None:
        """Blocks first_block.. of the hold into `block_ids`, on the calling thread (fetch, then write)."""
        start = time.perf_counter()
        data = self.fetch(params, first_block, len(block_ids))
        self.write(block_ids, data, time.perf_counter() - start)

    def release(self, params: KVTransferParams) -> None:
        release_hold(params, min(self.timeout_s, 1.0))
