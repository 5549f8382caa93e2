"""The router's side of the engines' KV events: one thread, a ZeroMQ SUB socket per engine, each batch
applied in sequence order to the exact index (router/kv_index.py).

A batch's sequence number is the engine publisher's counter. The subscriber expects `next_seq`; a batch
past it is a gap (the PUB socket drops what a slow subscriber cannot take, or the subscriber joined late),
which it fills from the engine's replay socket (vLLM's protocol: send the first missing sequence number,
receive `(seq, payload)` for each buffered batch from there, then `seq = -1`) before applying the batch; a
batch before it was already applied and is dropped. A new subscription first asks for a replay from 0,
so a router that starts after its engines picks up what their buffers still hold without waiting for the
next batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
from specfleet.engine.kv_events import KVEventBatch  # the wire format, plain msgspec (engine/kv_events.py)

from .kv_index import ExactPrefixIndex

logger = logging.getLogger("specfleet.router.kv_events")

# How long one replay may take before the subscriber gives up on it and applies what it has: a replay is a
# few thousand small frames from a socket on the same network; 5 s covers a host as loaded as the test
# machines (load ~10 on 2 cores) with room.
REPLAY_TIMEOUT_S = 5.0
POLL_MS = 50  # the thread's wake-up for new engines and for close()


@dataclass
class EngineFeed:
    url: str
    endpoint: str
    replay_endpoint: str | None
    next_seq: int | None = None  # None: nothing received yet
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0  # batches a replay could not return (past the engine's buffer)
    socket: Any = field(default=None, repr=False)


def event_endpoints(url: str, port: int, replay_port: int | None) -> tuple[str, str | None]:
    """An engine's PUB and replay addresses from its HTTP address and the fleet's event ports (every engine
    publishes on the same ports, as llm-d's `socketPort`)."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"engine url {url!r} has no host to derive its KV events endpoint from")
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}" if replay_port else None


class KVEventSubscriber:
    def __init__(
        self, index: ExactPrefixIndex, topic: str = "", on_apply: Callable[[str], None] | None = None
    ) -> None:
        self.index = index
        self.topic = topic.encode()
        self.on_apply = on_apply
        self.feeds: dict[str, EngineFeed] = {}
        self.lock = threading.Lock()  # around the index: the event loop reads it while this thread writes
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)
        self._running = True
        self._subscribed: set[str] = set()  # urls given to add (the thread's `feeds` follow)
        self._thread.start()

    def add(self, url: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        self._subscribed.add(url)
        self._commands.put(("add", EngineFeed(url, endpoint, replay_endpoint)))

    def sync(self, urls: Iterable[str], port: int, replay_port: int | None) -> None:
        """Subscribe to each engine not yet subscribed, unsubscribe from those gone."""
        self.sync_to({url: event_endpoints(url, port, replay_port) for url in urls})

    def sync_to(self, endpoints: Mapping[str, tuple[str, str | None]]) -> None:
        """`sync` with each engine's own (PUB, replay) addresses, e.g. a local fleet's engines on one host."""
        for url in endpoints.keys() - self._subscribed:
            self.add(url, *endpoints[url])
        for url in self._subscribed - endpoints.keys():
            self.remove(url)

    def remove(self, url: str) -> None:
        self._subscribed.discard(url)
        self._commands.put(("remove", url))

    def close(self) -> None:
        self._running = False
        self._thread.join(5)

    def match(self, url: str, hashes: Any) -> int | None:
        """The exact match for an engine that publishes events, None for one that does not."""
        with self.lock:
            return self.index.match(url, hashes) if self.index.tracks(url) else None

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[Any, EngineFeed] = {}
        while self._running:
            while not self._commands.empty():
                op, arg = self._commands.get()
                if op == "add":
                    sock = self._ctx.socket(zmq.SUB)
                    sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                    sock.connect(arg.endpoint)
                    arg.socket = sock
                    self.feeds[arg.url] = arg
                    by_socket[sock] = arg
                    poller.register(sock, zmq.POLLIN)
                    self._catch_up(arg)
                elif (feed := self.feeds.pop(arg, None)) is not None:
                    poller.unregister(feed.socket)
                    by_socket.pop(feed.socket, None)
                    feed.socket.close(linger=0)
                    with self.lock:
                        self.index.forget(arg)
            for sock, _ in poller.poll(POLL_MS):
                feed = by_socket[sock]
                _topic, seq_bytes, payload = sock.recv_multipart()
                self._receive(feed, int.from_bytes(seq_bytes, "big"), payload)
        for feed in self.feeds.values():
            feed.socket.close(linger=0)

    def _receive(self, feed: EngineFeed, seq: int, payload: bytes) -> None:
        expected = 0 if feed.next_seq is None else feed.next_seq
        if seq < expected:
            return  # applied already (from a replay)
        if seq > expected:
            feed.gaps += 1
            missed = self._replay(feed, expected, seq)
            feed.lost += (seq - expected) - len(missed)
            for missed_seq, missed_payload in missed:
                self._apply(feed, missed_seq, missed_payload)
        self._apply(feed, seq, payload)

    def _catch_up(self, feed: EngineFeed) -> None:
        """A new subscription first replays what the engine's buffer holds, so the index does not wait for
        the engine's next batch (an idle engine sends none) to learn what it cached before."""
        for seq, payload in self._replay(feed, 0, 2**63):
            if feed.next_seq is None or seq >= feed.next_seq:
                self._apply(feed, seq, payload)

    def _apply(self, feed: EngineFeed, seq: int, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        with self.lock:
            self.index.apply(feed.url, batch.events)
        feed.next_seq, feed.batches = seq + 1, feed.batches + 1
        if self.on_apply is not None:
            self.on_apply(feed.url)

    def _replay(self, feed: EngineFeed, start: int, stop: int) -> list[tuple[int, bytes]]:
        """Batches start..stop-1 from the engine's replay socket (those its buffer still holds)."""
        if feed.replay_endpoint is None:
            return []
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(feed.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while time.monotonic() < deadline:
                if not sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
                    break
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    break
                if start <= seq < stop:
                    out.append((seq, payload))
            else:
                logger.warning("event=kv_events_replay_timeout url=%s start=%d", feed.url, start)
        finally:
            sock.close(linger=0)
        feed.replayed += len(out)
        return out


@dataclass
class KVEventFeeds:
    """The router's KV event subscriptions: every discovered engine on the fleet's event ports, or, with
    `addresses`, each engine on its own (a local fleet's engines share one host: `specfleet up`)."""

    subscriber: KVEventSubscriber
    port: int = 0
    replay_port: int | None = None
    # engine url -> its (PUB, replay) addresses; an engine not in it is not subscribed. None: the ports.
    addresses: Mapping[str, tuple[str, str | None]] | None = None

    def sync(self, urls: Iterable[str]) -> None:
        if self.addresses is None:
            self.subscriber.sync(urls, self.port, self.replay_port)
        else:
            self.subscriber.sync_to({u: self.addresses[u] for u in urls if u in self.addresses})
