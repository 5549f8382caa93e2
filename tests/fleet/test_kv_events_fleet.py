"""`specfleet up`'s fleet with the engines' KV events (LocalFleet `kv_events`): every engine publishes on
sockets of its own, and with "route" the router's prefix policy reads the exact index they give. Real
engines (a tiny random-weight llama with the bundled tokenizer), the real router, real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import yaml
from specfleet.bench.route_workload import prefix_counters, system_prompt
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator.inference_service import load_inference_service
from specfleet.router.policies import PrefixAffinity
from specfleet.router.prefix import BlockHasher

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml"
# 24 blocks of 16 tokens: one ~100-token prompt holds 7 of them, three other prompts of ~130 push it out;
# the engine refuses a cache shorter than one sequence of max_model_len, hence 256 tokens (16 blocks)
NUM_KV_BLOCKS = 24
MAX_MODEL_LEN = 256


def _fleet(source: str | None = None, **options: object) -> LocalFleet:
    doc = yaml.safe_load(EXAMPLE.read_text())
    if source is not None:
        doc["spec"]["model"]["source"] = source
        doc["spec"]["model"]["maxModelLen"] = MAX_MODEL_LEN
    doc["spec"]["replicas"] = 2
    doc["spec"]["engine"]["drainTimeoutSeconds"] = 2
    return LocalFleet(
        load_inference_service(doc),
        tune=False,
        engine_extra_args=[f"--num-kv-blocks={NUM_KV_BLOCKS}"],
        **options,
    )


def _yaml_fleet(tmp_path: Path, routing: dict[str, object], **options: object) -> LocalFleet:
    """The example's fleet with `routing` in its YAML, built as `specfleet up` builds it; no engine starts."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["replicas"] = 2
    doc["spec"]["routing"] = routing
    fleet = LocalFleet(
        load_inference_service(doc), tune=False, log_dir=tmp_path, say=lambda _: None, **options
    )
    # the engines' tokenizer, as start() installs it once they converted the model (characters here)
    fleet.router.hasher = BlockHasher(16, lambda text: [ord(c) for c in text], fleet.router.hasher.seed)
    return fleet


def _plan(fleet: LocalFleet) -> list[list[str]]:
    """Both engines' command lines as the fleet would start them, their addresses recorded as _new_engine
    records them (no process starts), then the router wired as start() wires it once they are ready."""
    commands = []
    for index, port in enumerate((18101, 18102)):
        commands.append(fleet.engine_command(index, port, port + 100))
        if fleet.kv_events != "off":
            fleet.kv_event_addresses[f"http://127.0.0.1:{port}"] = fleet._kv_event_sockets(index)
    fleet._subscribe_kv_events()
    return commands


def _events_config(command: list[str]) -> dict[str, object] | None:
    flags = [a for a in command if a.startswith("--kv-events-config")]
    assert len(flags) <= 1, flags
    return json.loads(flags[0].split("=", 1)[1]) if flags else None


@pytest.mark.parametrize("routing", [{}, {"kvEvents": True}, {"policy": "prefix", "kvEvents": True}])
def test_up_routes_on_kv_events_as_the_yaml_says_by_default(tmp_path: Path, routing: dict) -> None:
    """routing.kvEvents, on by default with the prefix policy, as the operator reads it: every engine
    publishes on sockets of its own and the router subscribes to each and routes on the exact index."""
    fleet = _yaml_fleet(tmp_path, routing)
    assert fleet.kv_events == "route"
    commands = _plan(fleet)
    configs = [_events_config(c) for c in commands]
    assert configs == [
        {"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay}
        for pub, replay in (fleet._kv_event_sockets(0), fleet._kv_event_sockets(1))
    ]
    feeds = fleet.router.kv_feeds
    assert feeds is not None and dict(feeds.addresses or {}) == fleet.kv_event_addresses
    assert len(fleet.kv_event_addresses) == 2
    assert isinstance(fleet.router.policy, PrefixAffinity) and fleet.router.policy.exact is not None
    feeds.subscriber.close()


@pytest.mark.parametrize(
    ("routing", "options"),
    [
        ({"kvEvents": False}, {}),
        ({"policy": "least-loaded"}, {}),  # kvEvents is the prefix policy's, as in the operator
        ({}, {"policy": "round-robin"}),  # `specfleet up --policy` overrides the YAML's policy
        ({}, {"kv_events": "off"}),  # `specfleet up --kv-events off` overrides the YAML
    ],
)
def test_up_without_kv_events_starts_no_publisher_and_no_subscription(
    tmp_path: Path, routing: dict, options: dict
) -> None:
    fleet = _yaml_fleet(tmp_path, routing, **options)
    assert fleet.kv_events == "off"
    assert [_events_config(c) for c in _plan(fleet)] == [None, None]
    assert fleet.kv_event_addresses == {} and fleet.router.kv_feeds is None


def test_the_flag_overrides_the_yaml_and_an_explicit_route_needs_the_tokenizer(tmp_path: Path) -> None:
    """`--kv-events publish` on a YAML with kvEvents false: the engines publish, the router estimates. Without
    a tokenizer the router can read, the YAML's default routes on the estimate with a line saying so, where
    `--kv-events route` is refused by name."""
    fleet = _yaml_fleet(tmp_path / "publish", {"kvEvents": False}, kv_events="publish")
    assert all(_events_config(c) is not None for c in _plan(fleet)) and fleet.router.kv_feeds is None
    said: list[str] = []
    fleet = _yaml_fleet(tmp_path / "default", {})
    fleet.say, fleet.router.hasher = said.append, BlockHasher(16, None, 0)
    _plan(fleet)
    assert fleet.router.kv_feeds is None
    assert len(said) == 1 and "no tokenizer.json" in said[0] and "routes on its estimate" in said[0]
    fleet = _yaml_fleet(tmp_path / "explicit", {}, kv_events="route")
    fleet.router.hasher = BlockHasher(16, None, 0)
    with pytest.raises(ValueError, match="kv_events='route' needs the model's tokenizer.json"):
        _plan(fleet)
    assert fleet.router.kv_feeds is None


def test_route_needs_the_prefix_policy_and_the_mode_is_one_of_three() -> None:
    with pytest.raises(ValueError, match="kv_events='route' needs the prefix policy.*'round-robin'"):
        _fleet(policy="round-robin", kv_events="route")
    with pytest.raises(ValueError, match="kv_events='sideways' is not one of off, publish, route"):
        _fleet(kv_events="sideways")


def test_each_engine_publishes_on_ipc_sockets_of_its_own_in_the_log_folder() -> None:
    fleet = _fleet(policy="prefix", kv_events="publish")
    assert fleet._kv_event_sockets(1) == (
        f"ipc://{fleet.log_dir}/engine-1-kv-pub.sock",
        f"ipc://{fleet.log_dir}/engine-1-kv-replay.sock",
    )
    assert fleet._kv_event_sockets(0) != fleet._kv_event_sockets(1)


async def _until(what: str, check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _matched(fleet: LocalFleet) -> float:
    return fleet.router.metrics.prefix_blocks.labels("matched")._value.get()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_router_predicts_the_engines_prefix_hits_through_an_eviction(tiny_llama: str) -> None:
    """A prompt served once is matched in full on its engine; after that engine's cache evicts it (other
    prompts sent to it directly), the router's index says so, where its estimate still holds it all: each
    time the blocks the router predicted equal the tokens the engines found, over the block size. A chat
    request too: the router renders it with the model's chat template as the engines do, so its second
    run is matched on the events in full."""

    async def run() -> None:
        pinned = 1 if len(os.sched_getaffinity(0)) >= 2 else None
        fleet = _fleet(tiny_llama, policy="prefix", kv_events="route", cpus_per_engine=pinned)
        await fleet.start(ready_timeout_s=120)
        try:
            assert fleet.router.kv_feeds is not None
            subscriber = fleet.router.kv_feeds.subscriber
            prompt = system_prompt(0, 3) + "\nUser: hi\nAssistant:"
            hashes = fleet.router.hasher.hashes(prompt)
            block_size = fleet.router.hasher.block_size
            assert 5 <= len(hashes) <= 8, len(hashes)
            # not a whole number of blocks: the engine then looks up every full block (it never caches the
            # last prompt token, so a prompt of exactly n blocks can hit at most n - 1)
            assert fleet.router.hasher.encode is not None
            assert len(fleet.router.hasher.encode(prompt)) % block_size != 0
            async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                body = {"model": model, "prompt": prompt, "max_tokens": 2}

                async def routed_once(
                    payload: dict = body, path: str = "/v1/completions"
                ) -> tuple[float, float]:
                    """(blocks the router predicted, prompt tokens the engines found) for one request."""
                    matched0, (hits0, _) = _matched(fleet), await prefix_counters(fleet.engine_urls)
                    assert (await client.post(path, json=payload)).status_code == 200
                    matched1, (hits1, _) = _matched(fleet), await prefix_counters(fleet.engine_urls)
                    return matched1 - matched0, hits1 - hits0

                assert await routed_once() == (0, 0)  # cold
                await _until(
                    "the engine's stored blocks in the router's index",
                    lambda: any(subscriber.match(u, hashes) == len(hashes) for u in fleet.engine_urls),
                )
                home = next(u for u in fleet.engine_urls if subscriber.match(u, hashes) == len(hashes))
                assert await routed_once() == (len(hashes), len(hashes) * block_size)
                for tenant in (1, 2, 3):  # straight to its engine: the router sees none of them
                    other = {"model": model, "prompt": system_prompt(tenant, 4), "max_tokens": 1}
                    assert (await client.post(f"{home}/v1/completions", json=other)).status_code == 200
                await _until(
                    "the eviction in the router's index", lambda: subscriber.match(home, hashes) < len(hashes)
                )
                applied, deadline = -1, time.monotonic() + 30  # settled: a second without a new batch
                while applied != (applied := sum(f.next_seq or 0 for f in subscriber.feeds.values())):
                    assert time.monotonic() < deadline, "the engines' events never settled"
                    await asyncio.sleep(1.0)
                assert isinstance(fleet.router.policy, PrefixAffinity)
                assert fleet.router.policy.index.match(home, hashes) == len(
                    hashes
                )  # the LRU of what was sent there sees no eviction
                predicted = max(subscriber.match(u, hashes) or 0 for u in fleet.engine_urls)
                assert predicted < len(hashes)
                matched, hits = await routed_once()
                assert (matched, hits) == (predicted, predicted * block_size)
                # A chat request: the router renders it with the model's chat template as the engines do
                # (router/chat_template.py), so the events name its blocks and the exact index matches them
                system = {"role": "system", "content": system_prompt(5, 2)}
                chat = {
                    "model": model,
                    "messages": [system, {"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                }
                route = fleet.router.route_request(json.dumps(chat).encode(), {})
                assert (
                    fleet.router.chat_template is not None and route.engine_hashes and len(route.hashes) >= 3
                )
                assert (
                    len(fleet.router.hasher.encode(fleet.router.chat_template.render(chat))) % block_size != 0
                )
                assert await routed_once(chat, "/v1/chat/completions") == (0, 0)  # cold
                await _until(
                    "the chat prompt's blocks in the router's index",
                    lambda: any(
                        subscriber.match(u, route.hashes) == len(route.hashes) for u in fleet.engine_urls
                    ),
                )
                full = len(route.hashes)
                assert await routed_once(chat, "/v1/chat/completions") == (full, full * block_size)
        finally:
            await fleet.stop(drain_timeout_s=5)

    asyncio.run(run())


@pytest.mark.parametrize(("flag", "expected"), [([], "route"), (["--kv-events", "publish"], "publish")])
def test_up_command_line_passes_kv_events_through(tmp_path: Path, flag: list[str], expected: str) -> None:
    """`specfleet up -f FILE` leaves the choice to the YAML (the example's default: route); `--kv-events`
    overrides it."""
    from specfleet.fleet.local import build_fleets, build_parser, load_services

    args = build_parser().parse_args(["-f", str(EXAMPLE), *flag])
    (fleet,) = build_fleets(args, load_services(args.file))
    assert fleet.kv_events == expected
