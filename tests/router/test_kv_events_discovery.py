"""The cluster router's KV event subscriptions follow discovery: built from the flags the operator renders
(`--service`, `--tokenizer`, `--kv-events-port`, `--kv-events-replay-port`), its EndpointSlice watch on the
API double subscribes to each engine pod that joins, at the pod's IP on the fleet's ports, and drops one that
leaves along with its index.

The engines are fake publishers on real ZeroMQ sockets, one per loopback address (127.0.0.2, 127.0.0.3)
on the same two ports, as engine pods each bind the same ports on their own IP. They speak vLLM's wire
(multipart topic, 8-byte sequence, msgpack batch; the replay socket's protocol); the engine's side of it is
tested in tests/router/test_kv_events_index.py and tests/engine/test_kv_events_engine.py. What the double does
not model: the EndpointSlice controller (the test writes the slices as it would)."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import zmq
from fake_kube import FakeKube
from specfleet.engine.kv_events import BlockStored, KVEventBatch
from specfleet.router import cli as router_cli
from specfleet.router.discovery import EndpointSliceWatch, RoleStates
from specfleet.router.policies import PrefixAffinity, RouteRequest
from specfleet.router.prefix import chain_hashes, token_blocks

PREFIX = "/apis/discovery.k8s.io/v1"
SERVICE = "smollm2-engines"
BS = 16
HOSTS = ("127.0.0.2", "127.0.0.3")


class FakeEnginePublisher:
    """One engine pod's KV event sockets: PUB and the replay ROUTER bound on its own address (port 0: a
    free one), a thread that answers replay requests from the batches published so far."""

    def __init__(self, host: str, port: int = 0, replay_port: int = 0) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pub, self.replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        try:
            self.port = _bind(self.pub, host, port)
            self.replay_port = _bind(self.replay, host, replay_port)
        except zmq.ZMQError:
            self.pub.close(linger=0)
            self.replay.close(linger=0)
            raise
        self.sent: list[bytes] = []
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def store(self, tokens: list[int]) -> None:
        """One batch storing the full blocks of `tokens` as one chain (the engine's own block hashes)."""
        full = len(tokens) // BS
        stored = BlockStored(list(range(1, full + 1)), None, tokens[: full * BS], BS, None, "GPU")
        payload = msgspec.msgpack.encode(KVEventBatch(time.time(), [stored], 0))
        with self.lock:
            seq = len(self.sent)
            self.sent.append(payload)
        self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        while self.running:
            if not self.replay.poll(20):
                continue
            identity, _, start = self.replay.recv_multipart()
            with self.lock:
                batches = list(enumerate(self.sent))[int.from_bytes(start, "big") :]
            for seq, payload in batches:
                self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((identity, b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.pub.close(linger=0)
        self.replay.close(linger=0)


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


def start_engines() -> list[FakeEnginePublisher]:
    """One publisher per address, all on the same two ports (the first's free ones; retried where another
    process holds them on the second address)."""
    for _ in range(20):
        first = FakeEnginePublisher(HOSTS[0])
        try:
            return [first, *(FakeEnginePublisher(h, first.port, first.replay_port) for h in HOSTS[1:])]
        except zmq.ZMQError:
            first.close()
    raise AssertionError("no two ports free on every loopback address")


def endpoint_slice(hosts: list[str]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "addressType": "IPv4",
        "metadata": {
            "name": f"{SERVICE}-a",
            "namespace": "ns",
            "labels": {"kubernetes.io/service-name": SERVICE},
        },
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [h], "conditions": {"ready": True}} for h in hosts],
    }


def test_subscriptions_follow_the_engines_discovery_finds(bundled_path: str) -> None:
    engines = dict(zip(HOSTS, start_engines(), strict=True))
    port, replay_port = engines[HOSTS[0]].port, engines[HOSTS[0]].replay_port
    url = {host: f"http://{host}:8000" for host in HOSTS}
    prompts = {host: [1000 * (n + 1) + t for t in range(3 * BS + 1)] for n, host in enumerate(HOSTS)}
    for host, engine in engines.items():  # cached before the router starts: the catch-up replays them
        engine.store(prompts[host])
    args = router_cli.build_parser().parse_args(
        [
            *("--service", SERVICE, "--namespace", "ns", "--model", "bundled://smollm2-135m-instruct"),
            *("--block-size", str(BS), "--tokenizer", str(bundled_path)),
            *("--kv-events-port", str(port), "--kv-events-replay-port", str(replay_port)),
        ]
    )
    router = router_cli.build_router(args)
    assert router.kv_feeds is not None and isinstance(router.policy, PrefixAffinity)
    subscriber = router.kv_feeds.subscriber
    kube = FakeKube().start()

    def hashes(host: str) -> tuple[int, ...]:
        return tuple(chain_hashes(token_blocks(prompts[host], BS), router.hasher.seed))

    async def until(what: str, condition) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"never: {what} (feeds {subscriber.feeds})")

    async def scenario() -> None:
        watch = EndpointSliceWatch(kube.url, "ns", SERVICE, RoleStates(router).watcher(None), retry_s=0.1)
        task = asyncio.create_task(watch.run())
        a, b = HOSTS
        try:
            await until("a's blocks indexed", lambda: subscriber.match(url[a], hashes(a)) == 3)
            assert set(subscriber.feeds) == {url[a]}
            assert subscriber.feeds[url[a]].endpoint == f"tcp://{a}:{port}"
            await asyncio.to_thread(kube.put, PREFIX, "endpointslices", "ns", endpoint_slice([a, b]))
            await until("b's blocks indexed", lambda: subscriber.match(url[b], hashes(b)) == 3)
            assert subscriber.match(url[a], hashes(b)) == 0  # a holds none of b's blocks
            # routed on the events: b's prompt to b, though the estimate has never seen it anywhere
            choice = router.policy.choose(RouteRequest(hashes(b)), router.endpoints.routable())
            assert choice.url == url[b]
            await asyncio.to_thread(kube.put, PREFIX, "endpointslices", "ns", endpoint_slice([b]))
            await until("a unsubscribed", lambda: url[a] not in subscriber.feeds)
            assert subscriber.match(url[a], hashes(a)) is None  # forgotten: no index left for a
            assert subscriber.match(url[b], hashes(b)) == 3
        finally:
            task.cancel()

    try:
        kube.put(PREFIX, "endpointslices", "ns", endpoint_slice([HOSTS[0]]))
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        kube.stop()
        subscriber.close()
        for engine in engines.values():
            engine.close()
