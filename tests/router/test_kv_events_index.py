"""KV events from the engine's block manager to the router's exact index, over real ZeroMQ sockets on
loopback (no model: blocks are cached and evicted by hand, as the block manager's own tests do).

The index must hold exactly the router-scheme hashes of the blocks the engine's prefix cache holds, after
stores, evictions and a subscriber that joins late (its gap filled from the replay socket)."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    salt_digest,
)
from specfleet.engine.kv_events_config import KVEventsConfig
from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.sequence import Sequence
from specfleet.router.kv_index import ExactPrefixIndex
from specfleet.router.kv_subscriber import KVEventSubscriber
from specfleet.router.prefix import BlockHasher, chain_hashes, stable_hash, token_blocks

BS = 4
URL = "http://engine-a"
SEED = stable_hash("bundled://tiny")


def _prompt(i: int, blocks: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(blocks * BS + 1)]  # distinct per prompt, a one-token tail


def _cache(kv: BlockManager, seq_id: int, prompt: list[int], salt: str | None = None) -> None:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt), len(prompt), SamplingParams(cache_salt=salt))
    kv.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(seq)
    kv.free_seq(seq)


def _expected(kv: BlockManager, prompts: list[tuple[list[int], str | None]]) -> set[int]:
    """The router-scheme hashes of the blocks the engine holds: per prompt its leading cached blocks (the
    prompts share no block, so their count must add up to every block the engine holds)."""
    hasher, out, total = BlockHasher(BS, None, SEED), set(), 0
    for i, (prompt, salt) in enumerate(prompts):
        probe = Sequence(10_000 + i, "probe", 0, list(prompt), len(prompt), SamplingParams(cache_salt=salt))
        n = len(kv.lookup_prefix(probe))
        out |= set(chain_hashes(token_blocks(prompt, BS), hasher.salted_seed(salt))[:n])
        total += n
    assert total == len(kv.hash_to_block)
    return out


def _wait_for(subscriber: KVEventSubscriber, url: str, batches: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        feed = subscriber.feeds.get(url)
        if feed is not None and feed.next_seq is not None and feed.next_seq >= batches:
            return
        time.sleep(0.02)
    raise AssertionError(
        f"subscriber at {subscriber.feeds.get(url)} after {timeout}s, want {batches} batches"
    )


@pytest.fixture
def publisher():
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
        '"replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@engine-a"}'
    )
    pub = ZmqEventPublisher(config)
    yield pub
    pub.close()


def _step(kv: BlockManager, pub: ZmqEventPublisher) -> None:
    pub.publish(kv.take_events())


def test_index_follows_stores_and_evictions_and_a_late_subscriber_replays(publisher) -> None:
    kv = BlockManager(12, BS, debug=False)
    kv.events = []
    prompts: list[tuple[list[int], str | None]] = []
    # published before any subscriber exists: only the replay socket can return these
    for i in range(2):
        prompts.append((_prompt(i, 2), None))
        _cache(kv, i, prompts[-1][0])
        _step(kv, publisher)
    index = ExactPrefixIndex(SEED)
    sub = KVEventSubscriber(index, topic="kv@engine-a")
    try:
        sub.add(URL, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.5)  # the SUB socket's connection (ZeroMQ's slow joiner); later batches go over PUB
        # a salted prompt, then enough prompts that the 12-block cache evicts the oldest
        prompts.append((_prompt(2, 2), "tenant-a"))
        _cache(kv, 2, prompts[-1][0], "tenant-a")
        _step(kv, publisher)
        for i in range(3, 8):
            prompts.append((_prompt(i, 2), None))
            _cache(kv, i, prompts[-1][0])
            _step(kv, publisher)
        _wait_for(sub, URL, 8)
        feed = sub.feeds[URL]
        assert feed.replayed >= 2 and feed.lost == 0, feed  # the batches before it joined
        with sub.lock:
            held = index.hashes(URL)
        expected = _expected(kv, prompts)
        assert held == expected
        assert len(expected) < 2 * len(prompts)  # evictions happened, and the index dropped those blocks
        # the router's hashes of the salted prompt match only with the salt
        salted = chain_hashes(
            token_blocks(prompts[2][0], BS), BlockHasher(BS, None, SEED).salted_seed("tenant-a")
        )
        unsalted = chain_hashes(token_blocks(prompts[2][0], BS), SEED)
        assert sub.match(URL, salted) == len(kv.lookup_prefix(_probe(prompts[2])))
        assert sub.match(URL, unsalted) == 0
        assert sub.match("http://publishes-nothing", unsalted) is None  # the estimate's case
    finally:
        sub.close()


def _probe(prompt: tuple[list[int], str | None]) -> Sequence:
    tokens, salt = prompt
    return Sequence(99_999, "probe", 0, list(tokens), len(tokens), SamplingParams(cache_salt=salt))


def test_the_wire_is_vllms_framing(publisher) -> None:
    """(topic, 8-byte big-endian seq, msgpack array-encoded tagged structs), read with a plain SUB socket
    and a decoder that knows only vLLM's field order."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.endpoint)
    try:
        time.sleep(0.5)  # slow joiner
        stored = BlockStored([11, 12], None, list(range(2 * BS)), BS, None, "GPU", None, None)
        publisher.publish([stored, BlockRemoved([11], "GPU"), AllBlocksCleared()])
        assert sub.poll(30_000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@engine-a" and seq == (0).to_bytes(8, "big")
        raw = msgspec.msgpack.decode(payload)
        ts, events, rank = raw
        assert isinstance(ts, float) and rank == 0
        assert events[0][:7] == ["BlockStored", [11, 12], None, list(range(2 * BS)), BS, None, "GPU"]
        assert events[1] == ["BlockRemoved", [11], "GPU"] and events[2] == ["AllBlocksCleared"]
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
        assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    finally:
        sub.close(linger=0)


def test_the_salt_digest_is_the_routers_stable_hash() -> None:
    assert salt_digest("tenant-a") == stable_hash("tenant-a")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "kv_events_config is not JSON"),
        ("[]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown fields ['port']"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher='kafka'"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps=0 must be an integer >= 1"),
        ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint='http://x:1'"),
    ],
)
def test_a_bad_config_names_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="kv_events_config") as exc:
        KVEventsConfig.parse(text)
    assert message in str(exc.value)


def test_events_are_off_by_default() -> None:
    assert not KVEventsConfig().publishes
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publisher == "zmq"
    kv = BlockManager(4, BS, debug=False)
    _cache(kv, 0, _prompt(0, 2))
    assert kv.take_events() == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-events-port", "5557"], "--kv-events-port needs --tokenizer"),
        (["--kv-events-port", "5557", "--policy", "round-robin"], "needs --policy prefix"),
    ],
)
def test_the_router_flag_says_what_it_needs(flags: list[str], message: str) -> None:
    from specfleet.router import cli as router_cli

    args = router_cli.build_parser().parse_args(["--endpoint", "http://127.0.0.1:1", *flags])
    with pytest.raises(ValueError, match=message):
        router_cli.build_router(args)


def test_a_subscribed_engine_is_routed_on_its_events_and_another_on_the_estimate() -> None:
    """The prefix policy reads the exact index for an engine that publishes, the LRU for one that does not."""
    from specfleet.router.endpoints import Endpoint
    from specfleet.router.policies import PrefixAffinity, RouteRequest

    index = ExactPrefixIndex(SEED)
    tokens = _prompt(0, 2)
    index.apply(URL, [BlockStored([7, 8], None, tokens[: 2 * BS], BS, None, "GPU")])
    index.apply(URL, [BlockRemoved([8], "GPU")])  # the engine evicted the second block
    policy = PrefixAffinity()
    policy.exact = lambda url, hashes: index.match(url, hashes) if index.tracks(url) else None
    hashes = tuple(chain_hashes(token_blocks(tokens, BS), SEED))
    policy.routed(RouteRequest(hashes), URL)  # the estimate alone would say both blocks are there
    policy.routed(RouteRequest(hashes), "http://engine-b")
    engines = [Endpoint(URL, ready=True), Endpoint("http://engine-b", ready=True)]
    assert policy._match(URL, hashes) == 1
    assert policy._match("http://engine-b", hashes) == 2
    assert policy.choose(RouteRequest(hashes), engines).url == "http://engine-b"


def test_the_router_subscribes_to_discovered_engines_and_drops_gone_ones(publisher) -> None:
    """Discovery's endpoint changes drive the subscriptions: an engine that appears is subscribed at its
    host on the fleet's event ports, one that leaves is unsubscribed and its index forgotten."""
    from specfleet.router.endpoints import EndpointSet
    from specfleet.router.kv_subscriber import KVEventFeeds
    from specfleet.router.policies import PrefixAffinity
    from specfleet.router.proxy import Router

    port = int(publisher.endpoint.rsplit(":", 1)[1])
    replay_port = int(publisher.replay_endpoint.rsplit(":", 1)[1])
    url = "http://127.0.0.1:8000"
    index = ExactPrefixIndex(SEED)
    feeds = KVEventFeeds(KVEventSubscriber(index, topic="kv@"), port, replay_port)
    router = Router(EndpointSet(), PrefixAffinity())
    router.kv_feeds = feeds
    try:
        router.endpoints.replace({url: (True, False)})
        router.endpoints_changed()
        tokens = _prompt(0, 1)
        publisher.publish([BlockStored([5], None, tokens[:BS], BS, None, "GPU")])
        time.sleep(1.0)  # a batch that beat the SUB connection comes back by replay with the next one's gap
        publisher.publish([])
        _wait_for(feeds.subscriber, url, 2)
        assert feeds.subscriber.match(url, chain_hashes(token_blocks(tokens, BS), SEED)) == 1
        removed = router.endpoints.replace({})
        router.endpoints_changed(removed)
        deadline = time.monotonic() + 30
        while url in feeds.subscriber.feeds and time.monotonic() < deadline:
            time.sleep(0.02)
        assert url not in feeds.subscriber.feeds and not index.tracks(url)
    finally:
        feeds.subscriber.close()


def test_feeds_with_addresses_subscribe_each_engine_at_its_own_sockets(publisher) -> None:
    """A local fleet's engines share one host, each on sockets of its own (`specfleet up`): the feeds
    subscribe an engine at the addresses noted for it and leave alone one that has none."""
    from specfleet.router.kv_subscriber import KVEventFeeds

    url, other = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
    index = ExactPrefixIndex(SEED)
    feeds = KVEventFeeds(
        KVEventSubscriber(index, topic="kv@"),
        addresses={url: (publisher.endpoint, publisher.replay_endpoint)},
    )
    try:
        feeds.sync([url, other])
        tokens = _prompt(0, 1)
        publisher.publish([BlockStored([5], None, tokens[:BS], BS, None, "GPU")])
        time.sleep(1.0)  # a batch that beat the SUB connection comes back by replay with the next one's gap
        publisher.publish([])
        _wait_for(feeds.subscriber, url, 2)
        assert feeds.subscriber.feeds[url].endpoint == publisher.endpoint
        assert other not in feeds.subscriber.feeds
        assert feeds.subscriber.match(url, chain_hashes(token_blocks(tokens, BS), SEED)) == 1
        assert feeds.subscriber.match(other, chain_hashes(token_blocks(tokens, BS), SEED)) is None
    finally:
        feeds.subscriber.close()


def test_a_sequence_gap_is_filled_from_the_replay_socket() -> None:
    """A PUB stream that skips batch 1 (what ZeroMQ does to a subscriber past its high-water mark): the
    subscriber asks the replay socket from 1, as vLLM's protocol says, and applies 1 before 2."""
    ctx = zmq.Context.instance()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port, replay_port = (
        pub.bind_to_random_port("tcp://127.0.0.1"),
        replay.bind_to_random_port("tcp://127.0.0.1"),
    )
    tokens = _prompt(0, 3)
    payloads = [
        msgspec.msgpack.encode(
            KVEventBatch(
                0.0, [BlockStored([i + 1], i or None, tokens[i * BS : (i + 1) * BS], BS, None, "GPU")], 0
            )
        )
        for i in range(3)
    ]
    index = ExactPrefixIndex(SEED)
    sub = KVEventSubscriber(index)
    asked: list[int] = []
    try:
        sub.add(URL, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
        asked.append(_answer_replay(replay, payloads[:0]))  # the catch-up on subscribing: nothing yet
        time.sleep(0.5)  # slow joiner
        pub.send_multipart((b"", (0).to_bytes(8, "big"), payloads[0]))
        _wait_for(sub, URL, 1)
        pub.send_multipart((b"", (2).to_bytes(8, "big"), payloads[2]))  # batch 1 never arrives over PUB
        asked.append(_answer_replay(replay, payloads, first=1))
        _wait_for(sub, URL, 3)
        assert asked == [0, 1]
        feed = sub.feeds[URL]
        assert (feed.gaps, feed.replayed, feed.lost) == (1, 1, 0)
        assert sub.match(URL, chain_hashes(token_blocks(tokens, BS), SEED)) == 3  # block 2 placed after 1
    finally:
        sub.close()
        pub.close(linger=0)
        replay.close(linger=0)


def _answer_replay(replay, payloads: list[bytes], first: int = 0) -> int:
    """Serve one replay request as vLLM's publisher does; returns the sequence number asked from."""
    assert replay.poll(30_000), "no replay request"
    identity, empty, start = replay.recv_multipart()
    assert empty == b"" and len(start) == 8
    asked = int.from_bytes(start, "big")
    for seq in range(asked, len(payloads)):
        if seq >= first:
            replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payloads[seq]))
    replay.send_multipart((identity, b"", (-1).to_bytes(8, "big", signed=True), b""))
    return asked


def test_a_chat_prompt_without_a_template_is_matched_on_the_estimate_even_where_the_engine_publishes() -> (
    None
):
    """A router without the model's chat template hashes a chat request's flattening of its messages, not
    what the engine prefilled, so the engines' events can never name them: the policy matches it on the
    estimate (an exact index would answer 0 for every engine). A completion's prompt is hashed by the
    model's tokenizer as the engine hashes it, and is matched on the events."""
    from specfleet.router.endpoints import EndpointSet
    from specfleet.router.policies import PrefixAffinity
    from specfleet.router.prefix import BlockHasher
    from specfleet.router.proxy import Router

    policy = PrefixAffinity()
    asked: list[str] = []

    def exact(url: str, hashes: object) -> int:  # an engine that publishes and holds none of these blocks
        asked.append(url)
        return 0

    policy.exact = exact
    router = Router(
        EndpointSet(["http://a", "http://b"], ready=True),
        policy,
        hasher=BlockHasher(block_size=4, encode=lambda t: list(t.encode())),
    )
    text = "You are a support agent for ACME. " * 4
    chat = router.route_request(json.dumps({"messages": [{"role": "user", "content": text}]}).encode(), {})
    completion = router.route_request(json.dumps({"prompt": text}).encode(), {})
    assert chat.hashes and not chat.engine_hashes and completion.engine_hashes
    first = router.choose(chat, set())
    assert first is not None and not asked  # the chat request never consulted the events
    again = router.choose(chat, set())
    assert again is not None and again.url == first.url and again.reason == "prefix"  # the estimate's match
    assert again.match_blocks == len(chat.hashes)
    router.choose(completion, set())
    assert sorted(asked) == ["http://a", "http://b"]  # a completion is matched on the events


def test_a_chat_prompt_rendered_with_the_models_template_is_matched_on_the_events(bundled_path: str) -> None:
    """With the model's chat template (router/chat_template.py) the router hashes a chat request as the
    engine renders and tokenizes it, so on an engine whose events stored what the engine prefilled for that
    request, the exact index matches every block of it (the other engine published nothing: estimate, 0). A
    request the router cannot render (its own `chat_template`) is flattened and matched on the estimate."""
    from pathlib import Path

    from specfleet.engine.checkpoint import load_tokenizer
    from specfleet.engine.server.chat import ChatOptions, render_with
    from specfleet.engine.server.protocol import ChatCompletionRequest
    from specfleet.router.chat_template import ChatTemplate
    from specfleet.router.cli import load_encoder
    from specfleet.router.endpoints import EndpointSet
    from specfleet.router.policies import PrefixAffinity
    from specfleet.router.proxy import Router

    folder, block_size = Path(bundled_path), 16
    body = {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "You are a support agent for ACME. Answer in one sentence. " * 3},
            {
                "role": "user",
                "content": [{"type": "text", "text": "My anvil "}, {"type": "text", "text": "fell."}],
            },
        ],
    }
    request = ChatCompletionRequest.model_validate(body)
    prompt = render_with(ChatOptions(), load_tokenizer(folder), request, None).prompt_ids  # the engine's
    assert len(prompt) % block_size != 0  # every full block is cached (the last token never is)
    kv = BlockManager(64, block_size, debug=False)
    kv.events = []
    _cache(kv, 0, prompt)
    index = ExactPrefixIndex(SEED)
    index.apply(URL, kv.take_events())
    policy = PrefixAffinity()
    policy.exact = lambda url, hashes: index.match(url, hashes) if index.tracks(url) else None
    router = Router(
        EndpointSet([URL, "http://engine-b"], ready=True),
        policy,
        hasher=BlockHasher(block_size, load_encoder(str(folder)), SEED),
    )
    router.chat_template = ChatTemplate.load(folder)
    route = router.route_request(json.dumps(body).encode(), {})
    assert route.engine_hashes and len(route.hashes) == len(prompt) // block_size >= 3
    choice = router.choose(route, set())
    assert choice is not None and (choice.url, choice.reason) == (URL, "prefix")
    assert choice.match_blocks == len(route.hashes)  # the exact index: nothing was routed there before
    unrenderable = router.route_request(json.dumps({**body, "chat_template": "{{ messages }}"}).encode(), {})
    assert unrenderable.hashes and not unrenderable.engine_hashes
    chat_prompts = router.metrics.chat_prompts
    assert [chat_prompts.labels(o)._value.get() for o in ("rendered", "request_template")] == [1, 1]
