"""Operator-wide settings, read once from the environment the Helm chart sets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_ENGINE_IMAGE = "ghcr.io/specfleet/engine:0.1.0-cuda"
DEFAULT_ENGINE_CPU_IMAGE = "ghcr.io/specfleet/engine:0.1.0"
# The router runs from the operator's image: it needs aiohttp and prometheus-client, which that image has.
DEFAULT_ROUTER_IMAGE = "ghcr.io/specfleet/operator:0.1.0"


@dataclass(frozen=True)
class OperatorConfig:
    engine_image: str = DEFAULT_ENGINE_IMAGE  # pods with resources.gpus > 0
    engine_cpu_image: str = DEFAULT_ENGINE_CPU_IMAGE  # pods with resources.gpus == 0
    prometheus_url: str = ""  # default for spec.autotune.prometheusURL
    reconcile_interval_seconds: float = 30.0  # the level-based timer; events also trigger a reconcile
    # Every child is watched and repaired at its event; each is also re-applied when its last apply is this
    # old, one per reconcile, in case a watch event was missed (the chart's resyncIntervalSeconds).
    # 30 min keeps 200 services under 2 API calls/s (~9 renewals each per period, measured: 200 * 9 /
    # 1800 s = 1.0/s; docs/operator.md, "API calls").
    resync_interval_seconds: float = 1800.0
    model_downloader_image: str = ""  # empty: the engine image runs the hf:// download step
    router_image: str = DEFAULT_ROUTER_IMAGE  # default for spec.routing.image
    # The chart's serviceMonitor.enabled: whether to apply a ServiceMonitor per service (its RBAC rule
    # exists only then). Off: none is applied, even where the Prometheus Operator's CRD is installed.
    service_monitor: bool = True
    # The chart's networkPolicy.enabled: a NetworkPolicy per service that lets only the operator's pods
    # (namespace `operator_namespace`, labels `operator_pod_labels`) reach the engines' admin port.
    network_policy: bool = False
    operator_namespace: str = ""
    operator_pod_labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.network_policy and not (self.operator_namespace and self.operator_pod_labels):
            raise ValueError(
                "a NetworkPolicy needs the operator's namespace and pod labels: set POD_NAMESPACE and "
                "SPECFLEET_OPERATOR_POD_LABELS (the Helm chart sets both)"
            )
        if self.reconcile_interval_seconds <= 0:
            raise ValueError(
                f"reconcile interval {self.reconcile_interval_seconds!r}s must be > 0; "
                "set SPECFLEET_RECONCILE_INTERVAL to a positive number of seconds"
            )
        if self.resync_interval_seconds <= 0:
            raise ValueError(
                f"resync interval {self.resync_interval_seconds!r}s must be > 0; "
                "set SPECFLEET_RESYNC_INTERVAL to a positive number of seconds"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        seconds = _seconds(env, "SPECFLEET_RECONCILE_INTERVAL", "30")
        return cls(
            engine_image=env.get("SPECFLEET_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
            engine_cpu_image=env.get("SPECFLEET_ENGINE_CPU_IMAGE", DEFAULT_ENGINE_CPU_IMAGE),
            prometheus_url=env.get("SPECFLEET_PROMETHEUS_URL", ""),
            reconcile_interval_seconds=seconds,
            resync_interval_seconds=_seconds(env, "SPECFLEET_RESYNC_INTERVAL", "1800"),
            model_downloader_image=env.get("SPECFLEET_MODEL_DOWNLOADER_IMAGE", ""),
            router_image=env.get("SPECFLEET_ROUTER_IMAGE", DEFAULT_ROUTER_IMAGE),
            service_monitor=_flag(env, "SPECFLEET_SERVICE_MONITOR", True),
            network_policy=_flag(env, "SPECFLEET_NETWORK_POLICY", False),
            operator_namespace=env.get("POD_NAMESPACE", ""),
            operator_pod_labels=_labels(env.get("SPECFLEET_OPERATOR_POD_LABELS", "")),
        )

    def image_for(self, gpus: int, override: str | None) -> str:
        if override:
            return override
        return self.engine_image if gpus > 0 else self.engine_cpu_image


def _seconds(env: Mapping[str, str], name: str, default: str) -> float:
    value = env.get(name, default)
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number; set it to seconds, e.g. {default}") from None


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value not in ("true", "false"):
        raise ValueError(f"{name}={env[name]!r} must be true or false")
    return value == "true"


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` -> ((k, v), (k2, v2)); a part without `=` is refused naming it."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"SPECFLEET_OPERATOR_POD_LABELS: {part!r} is not key=value")
        pairs.append((name, value))
    return tuple(pairs)
