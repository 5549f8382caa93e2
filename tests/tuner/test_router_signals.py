"""The replica knob's reading of the routers: a real router registry's exposition, parsed and combined."""

from __future__ import annotations

from prometheus_client import generate_latest
from specfleet.router.endpoints import EndpointSet
from specfleet.router.metrics import RouterMetrics
from specfleet.tuner.router_signals import RouterSignals, combine, parse_router_metrics


def exposition(queued: int, cold: float | None, engines: int) -> str:
    metrics = RouterMetrics()
    metrics.queued.set(queued)
    if cold is not None:
        metrics.cold_start.set(cold)
    metrics.observe_endpoints(EndpointSet([f"http://e{i}" for i in range(engines)], ready=True))
    return generate_latest(metrics.registry).decode()


def test_one_router_before_and_after_a_cold_start() -> None:
    assert parse_router_metrics(exposition(3, None, 0)) == RouterSignals(
        queued=3, cold_start_s=None, replicas=0, routers=1
    )
    assert parse_router_metrics(exposition(0, 12.5, 1)) == RouterSignals(0, 12.5, 1, 1)


def test_several_routers_sum_their_queues_and_keep_the_longest_cold_start() -> None:
    parts = [parse_router_metrics(exposition(2, 8.0, 1)), parse_router_metrics(exposition(1, None, 1))]
    assert combine(parts) == RouterSignals(queued=3, cold_start_s=8.0, replicas=1, routers=2)
    assert combine([]) == RouterSignals()  # none answered: nothing queued is known, and routers says so
