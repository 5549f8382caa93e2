"""docs/tuner.md's KEDA example scales one InferenceService: each query names metrics the engines and the
router export, and sums over that service's pods only, never over the namespace."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from specfleet.engine.server.metrics import ServerMetrics
from specfleet.operator.resources import router_name
from specfleet.router.metrics import RouterMetrics

DOC = Path(__file__).parents[2] / "docs" / "tuner.md"
QUERY = re.compile(r"^sum\((?P<metric>\w+)\{(?P<matchers>[^}]*)\}\)$")
MATCHER = re.compile(r'(?P<label>\w+)(?P<op>=~|=)"(?P<value>[^"]*)"')


def scaled_object() -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    (block,) = [b for b in blocks if "kind: ScaledObject" in b]
    return yaml.safe_load(block)


def names(registry) -> set[str]:
    return {family.name for family in registry.collect()}


def test_each_trigger_sums_one_services_series() -> None:
    obj = scaled_object()
    target = obj["spec"]["scaleTargetRef"]["name"]
    exported = {"router": names(RouterMetrics().registry), "engine": names(ServerMetrics("m").registry)}
    queries = {}
    for trigger in obj["spec"]["triggers"]:
        parsed = QUERY.match(trigger["metadata"]["query"])
        assert parsed, trigger["metadata"]["query"]
        matchers = {m["label"]: (m["op"], m["value"]) for m in MATCHER.finditer(parsed["matchers"])}
        assert matchers.get("namespace", ("", ""))[0] == "=", matchers  # one namespace
        queries[parsed["metric"]] = matchers
    router = queries.pop("specfleet_router_queued")
    assert "specfleet_router_queued" in exported["router"]
    op, pattern = router["pod"]
    assert op == "=~"
    # Prometheus anchors the regex: this service's router pods, not another's, not its engines
    pods = re.compile(pattern)
    assert pods.fullmatch(f"{router_name(target)}-7d9f8b6c4d-x2x9k")
    for other in (f"{router_name(target + '-router-b')}-5c6d7f8b9-abcde", f"{target}-7d9f8b6c4d-x2x9k"):
        assert not pods.fullmatch(other), other
    ((metric, engines),) = queries.items()
    assert metric in exported["engine"] and engines["service"] == ("=", f"{target}-engines")
