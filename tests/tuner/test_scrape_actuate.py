"""The direct-scrape source and the admin actuator against a real engine server process."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from specfleet.tuner.actuator import AdminActuator
from specfleet.tuner.sources import ScrapeSource
from specfleet.tuner.types import LiveSettings, TunedConfig

from .conftest import ADMIN_TOKEN

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


async def _requests(url: str, n: int) -> int:
    async with httpx.AsyncClient(timeout=120) as client:
        bodies = [
            {
                "model": "smollm2-135m-instruct",
                "prompt": f"Count from {i} to 20:",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            for i in range(n)
        ]
        responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return sum(r.json()["usage"]["completion_tokens"] for r in responses)


def test_scrape_source_computes_rates_latencies_and_config(engine_url: str) -> None:
    async def scenario() -> None:
        async def endpoints() -> list[str]:
            return [engine_url]

        source = ScrapeSource(endpoints)
        first = await source.observe()
        assert first.error and "second" in first.error  # rates need two scrapes
        generated = await _requests(engine_url, 3)
        obs = await source.observe()
        await source.close()
        assert obs.error is None and obs.pods == 1
        assert obs.config == TunedConfig(0, 16, 512)
        assert obs.request_rate and obs.request_rate > 0
        assert obs.generation_rate is not None
        elapsed = obs.time - first.time
        assert generated * 0.9 <= obs.generation_rate * elapsed <= generated * 1.1  # tokens in the window
        assert obs.tpot_p95_s is not None and 0 < obs.tpot_p95_s < 5
        assert obs.ttft_p95_s is not None and obs.tpot_cdf and obs.tpot_cdf[-1][1] == pytest.approx(1.0)
        assert obs.step_duration_s and obs.batch_size and obs.batch_size >= 1
        assert obs.demand is not None and obs.demand > 0  # Little's law over the window
        # k = 0: the engine scored n-gram lookups instead ("0, 1, 2, ..." repeats ", "); the share found
        # and P(first i + 1 tokens came out), one per position up to the engine's ceiling, non-increasing
        assert obs.shadow_lookup_rate and obs.shadow_share and 0 < obs.shadow_share <= 1
        acc = obs.shadow_accepted_per_pos
        assert len(acc) == 8 and all(1 >= a >= b >= 0 for a, b in zip(acc, acc[1:])), acc

    asyncio.run(scenario())


def test_scrape_window_reaches_back_to_the_last_finished_requests(engine_url: str) -> None:
    """A window in which no request finished (requests under heavy load finish in waves) takes its latency
    from the last ones that did, up to max_window_factor windows back; a plain window reports none."""

    async def scenario() -> None:
        async def endpoints() -> list[str]:
            return [engine_url]

        reaching, plain = (
            ScrapeSource(endpoints, window_s=1.0, max_window_factor=30.0),
            ScrapeSource(endpoints, window_s=1.0, max_window_factor=1.0),
        )
        for source in (reaching, plain):
            await source.observe()
        await _requests(engine_url, 2)
        for source in (reaching, plain):
            assert (await source.observe()).tpot_p95_s is not None
        await asyncio.sleep(1.2)  # a window with no finished request
        later = await reaching.observe()
        assert later.tpot_p95_s is not None and later.ttft_p95_s is not None
        assert (await plain.observe()).tpot_p95_s is None
        await reaching.close()
        await plain.close()

    asyncio.run(scenario())


def test_actuator_patches_verifies_and_reapplies(engine_url: str) -> None:
    async def scenario() -> None:
        actuator = AdminActuator(ADMIN_TOKEN)
        target = TunedConfig(3, 12, 600)
        first = await actuator.ensure([engine_url], target)
        assert first.ok and first.patched == [engine_url]
        again = await actuator.ensure([engine_url], target)
        assert again.unchanged == [engine_url] and not again.patched  # idempotent: no PATCH
        # a restarted pod comes back with the spec's values: the next interval re-applies
        async with httpx.AsyncClient() as client:
            reset = await client.patch(
                f"{engine_url}/admin/config",
                json=TunedConfig(0, 16, 512).as_admin(),
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            )
            assert reset.status_code == 200
        healed = await actuator.ensure([engine_url], target)
        assert healed.patched == [engine_url] and await actuator.read(engine_url) == target
        guard = {"speculative_disable_by_batch_size": 6}  # an extra admin setting, verified the same way
        guarded = await actuator.ensure([engine_url], LiveSettings(target, **guard))
        assert guarded.patched == [engine_url]
        assert (await actuator.ensure([engine_url], LiveSettings(target, **guard))).unchanged == [engine_url]
        async with httpx.AsyncClient() as client:
            now = (
                await client.get(
                    f"{engine_url}/admin/config", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
                )
            ).json()
        assert now == {**target.as_admin(), **guard}
        refused = await actuator.ensure([engine_url], TunedConfig(99, 12, 600))
        assert engine_url in refused.refused and "num_speculative_tokens" in refused.refused[engine_url]
        wrong = AdminActuator("not-the-token-at-all")
        denied = await wrong.ensure([engine_url], target)
        assert "admin token" in denied.failed[engine_url]
        restored = await actuator.ensure(
            [engine_url], LiveSettings(TunedConfig(0, 16, 512), speculative_disable_by_batch_size=0)
        )
        assert restored.ok
        await actuator.close()
        await wrong.close()

    asyncio.run(scenario())
