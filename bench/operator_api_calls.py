"""The operator's API calls at scale: N InferenceServices on the strict API double (tests/fake_kube.py,
the Helm chart's RBAC), the real kopf operator in this process, every request the double answers counted.

Phases, each measured as a count of requests (watch streams excluded: one long-lived request per kind):
  converge   every service created, rolled out (the double plays the Deployment controller) and Ready;
  steady     every service reconciled `--ticks` more times by its timer, nothing changing;
  resync     the resync period has passed (the operator's memory aged by it): until every child the
             operator cannot watch has been re-applied once, one per reconcile;
  change     one service's spec changes and its new pods roll out, until it is Ready again.
The steady rate at production settings follows from the counts: calls per timer reconcile times N over
the 30 s timer, plus the resync's calls over its 30 min period.

    python -m specfleet.bench.operator_api_calls --services 200 --interval 4

prints one JSON object (docs/operator.md, "API calls", has the current figures).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NS = "team-a"
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
DEPLOY = ("/apis/apps/v1", "deployments")
# The double serves about 300 requests/s on one core: 200 services' first passes (~40 requests each, plus
# kopf's own) take ~1 min; the rest of a run waits on timer ticks.
CONVERGE_TIMEOUT_S = 900.0


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def _api_calls(requests: list[Any]) -> list[Any]:
    return [r for r in requests if r.query.get("watch") not in ("true", "1")]


def _by_verb(requests: list[Any]) -> dict[str, int]:
    """Calls by method and resource (`PATCH inferenceservices/status`, `GET apis` for discovery)."""

    def resource(path: str) -> str:
        parts = path.strip("/").split("/")
        if "namespaces" not in parts:
            return "apis"
        rest = parts[parts.index("namespaces") + 2 :]
        return "/".join(rest[:1] + rest[2:3])

    return dict(Counter(f"{r.method} {resource(r.path)}" for r in _api_calls(requests)))


def measure(services: int = 200, interval: float = 4.0, ticks: int = 2) -> dict[str, Any]:
    """Run the phases; the reconcile timer's interval must be set before the handlers are imported."""
    os.environ["SPECFLEET_RECONCILE_INTERVAL"] = str(interval)
    for path in (REPO / "tests", REPO / "tests" / "operator"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import yaml
    from fake_kube import FakeKube, Rbac
    from kopf.testing import KopfRunner
    from rollouts import report_rollout
    from specfleet.operator import handlers
    from specfleet.operator.config import OperatorConfig

    if handlers.CONFIG.reconcile_interval_seconds != interval:
        raise RuntimeError(
            f"the handlers were imported with a {handlers.CONFIG.reconcile_interval_seconds}s timer before "
            f"this run could set {interval}s: run the bench in a fresh process"
        )
    production = OperatorConfig()
    reconciles: Counter[str] = Counter()
    per_reconcile: list[int] = []  # each reconcile's own calls, in the order they ended
    registries: list[Any] = []
    converge = handlers.converge

    async def counted(body: Any, memo: Any, logger: Any, *args: Any, **kwargs: Any) -> Any:
        name = body["metadata"]["name"]
        reconciles[name] += 1
        if not registries:
            registries.append(memo.get("registry"))
        start = len(fake.requests)
        try:
            return await converge(body, memo, logger, *args, **kwargs)
        finally:  # one service's reconciles hold its lock: the requests naming it meanwhile are its own
            per_reconcile.append(sum(_names(r.path, name) for r in _api_calls(fake.requests[start:])))

    setattr(handlers, "converge", counted)  # noqa: B010  # the kopf handlers look it up at each call
    fake = FakeKube(rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}})).start()
    names = [f"svc-{i:03d}" for i in range(services)]
    figures: dict[str, Any] = {"services": services, "timer_interval_s": interval}
    try:
        kubeconfig = fake.write_kubeconfig(Path(tempfile.mkdtemp()) / "kubeconfig", NS)
        os.environ["KUBECONFIG"] = str(kubeconfig)
        fake.add_namespace(NS)
        doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
        for name in names:
            doc["metadata"]["name"] = name
            fake.put(*ISVC, NS, doc)

        def ready(name: str) -> bool:
            conditions = ((fake.get(*ISVC, NS, name) or {}).get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        def each_reconciled(times: int, since: Counter[str]) -> Callable[[], bool]:
            return lambda: all(reconciles[n] - since[n] >= times for n in names)

        args = ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"]
        with KopfRunner(args, timeout=CONVERGE_TIMEOUT_S) as runner:
            started = time.monotonic()
            for name in names:
                for child in (name, f"{name}-router"):
                    _wait(f"Deployment {child}", functools.partial(_exists, fake, child), 600)
                    report_rollout(fake, NS, child)
            _wait("every service Ready", lambda: all(map(ready, names)), CONVERGE_TIMEOUT_S)
            _wait("a timer reconcile of each after Ready", each_reconciled(1, Counter(reconciles)), 600)
            figures["converge"] = {"api_calls": len(_api_calls(fake.requests)), "seconds": _secs(started)}

            figures["steady"] = _steady(fake, reconciles, per_reconcile, each_reconciled, ticks, interval)
            figures["resync"] = _resync(
                fake, reconciles, per_reconcile, registries[0], production, interval, services
            )
            figures["change"] = _change(fake, names[0], reconciles, each_reconciled, interval)
        if runner.exception is not None:
            raise RuntimeError(runner.output[-4000:]) from runner.exception
    finally:
        setattr(handlers, "converge", converge)  # noqa: B010
        fake.stop()

    figures["production"] = _production(production, services, figures)
    return figures


def _steady(
    fake: Any,
    reconciles: Counter[str],
    per_reconcile: list[int],
    each_reconciled: Callable[[int, Counter[str]], Callable[[], bool]],
    ticks: int,
    interval: float,
) -> dict[str, Any]:
    """The steady phase: `ticks` timer reconciles of each converged service, nothing changed."""
    mark, since, started = len(fake.requests), Counter(reconciles), time.monotonic()
    first = len(per_reconcile)
    _wait(f"{ticks} timer reconciles of each", each_reconciled(ticks, since), 60 + 3 * ticks * interval)
    window = fake.requests[mark:]
    count = sum((reconciles - since).values())
    return {
        "reconciles": count,
        "api_calls": len(_api_calls(window)),
        "api_calls_per_reconcile": round(len(_api_calls(window)) / count, 4),
        "most_api_calls_in_one_reconcile": max(per_reconcile[first:], default=0),
        "seconds": _secs(started),
        "by_verb": _by_verb(window),
    }


def _resync(
    fake: Any,
    reconciles: Counter[str],
    per_reconcile: list[int],
    registry: Any,
    production: Any,
    interval: float,
    services: int,
) -> dict[str, Any]:
    """The resync phase: every applied child aged past the resync period, until each is re-applied."""
    if registry is None:  # an operator without the memory (before it) re-applies every pass
        return {"api_calls": 0, "api_calls_per_service": 0.0}
    period = production.resync_interval_seconds
    mark, since, started = len(fake.requests), Counter(reconciles), time.monotonic()
    first, aged_at = len(per_reconcile), time.monotonic()
    for memory in registry.memories():  # as if the resync period had passed
        for applied in memory.applied.values():
            applied.at -= period
    for group_version, (served, at) in list(registry.apis.items()):
        registry.apis[group_version] = (served, at - period)

    def renewed() -> bool:
        return all(a.at >= aged_at for m in registry.memories() for a in m.applied.values())

    _wait("every child re-applied once", renewed, 60 + 40 * interval)
    window = fake.requests[mark:]
    count = sum((reconciles - since).values())
    return {
        "reconciles": count,
        "api_calls": len(_api_calls(window)),
        "api_calls_per_service": round(len(_api_calls(window)) / services, 2),
        "api_calls_per_reconcile": round(len(_api_calls(window)) / max(count, 1), 4),
        "most_api_calls_in_one_reconcile": max(per_reconcile[first:], default=0),
        "seconds": _secs(started),
        "by_verb": _by_verb(window),
    }


def _change(
    fake: Any,
    changed: str,
    reconciles: Counter[str],
    each_reconciled: Callable[[int, Counter[str]], Callable[[], bool]],
    interval: float,
) -> dict[str, Any]:
    """The change phase: one service's spec changed, until it is Ready at the new generation."""
    from rollouts import report_rollout

    mark, since, started = len(fake.requests), Counter(reconciles), time.monotonic()
    isvc = fake.get(*ISVC, NS, changed)
    assert isvc is not None
    isvc["spec"]["batching"]["maxNumSeqs"] = 12
    fake.put(*ISVC, NS, isvc)
    _wait("the new template", lambda: "--max-num-seqs=12" in _args(fake, changed), 60)
    report_rollout(fake, NS, changed)
    _wait("Ready at the new generation", lambda: _observed(fake, changed), 60)
    _wait("two timer reconciles of each", each_reconciled(2, since), 60 + 6 * interval)
    window = fake.requests[mark:]
    return {
        "api_calls": len(_api_calls(window)),
        "seconds": _secs(started),
        "by_verb": _by_verb(window),
    }


def _production(production: Any, services: int, figures: dict[str, Any]) -> dict[str, Any]:
    """The steady API call rate at the production timer and resync intervals."""
    per_reconcile = figures["steady"]["api_calls_per_reconcile"]
    # an operator from before the memory has no resync (every pass re-applied everything): the bench
    # measures it too, for the comparison in docs/operator.md
    resync_s = getattr(production, "resync_interval_seconds", None)
    return {
        "timer_interval_s": production.reconcile_interval_seconds,
        "resync_interval_s": resync_s,
        "steady_api_calls_per_s": round(
            services * per_reconcile / production.reconcile_interval_seconds
            + (figures["resync"]["api_calls"] / resync_s if resync_s else 0.0),
            3,
        ),
    }


def _names(path: str, name: str) -> bool:
    """Whether a request is about service `name` or one of its children (`NAME`, `NAME-router`, ...).
    Discovery requests name no service: they count in the totals, not in one reconcile's."""
    parts = [p for p in path.strip("/").split("/") if p != "status"]
    return bool(parts) and (parts[-1] == name or parts[-1].startswith(name + "-"))


def _secs(started: float) -> float:
    return round(time.monotonic() - started, 1)


def _exists(fake: Any, deployment: str) -> bool:
    return fake.get(*DEPLOY, NS, deployment) is not None


def _args(fake: Any, name: str) -> str:
    """The engine container's arguments, joined as `--flag=value` pairs."""
    deployment = fake.get(*DEPLOY, NS, name) or {}
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return " ".join(f"{a}={b}" for a, b in zip(args, args[1:], strict=False))


def _observed(fake: Any, name: str) -> bool:
    isvc = fake.get(*ISVC, NS, name) or {}
    status = isvc.get("status") or {}
    return status.get("observedGeneration") == isvc["metadata"]["generation"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--services", type=int, default=200, help="InferenceServices (default: %(default)s)")
    parser.add_argument(
        "--interval", type=float, default=4.0, help="the reconcile timer in seconds (default: %(default)s)"
    )
    parser.add_argument("--ticks", type=int, default=2, help="timer reconciles per service in 'steady'")
    args = parser.parse_args(argv)
    if args.services < 1 or args.interval <= 0 or args.ticks < 1:
        parser.error("--services and --ticks must be >= 1 and --interval > 0")
    print(json.dumps(measure(args.services, args.interval, args.ticks), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
