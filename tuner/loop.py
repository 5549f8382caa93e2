"""One tuning loop for one service: observe, decide, actuate. The local fleet and the operator share it.

`tick()` runs one interval: read the source, let the policy decide, then make every ready engine run the
policy's config (a restarted pod is brought back to it), and report what happened.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from specfleet.operator.spec import InferenceServiceSpec

from .actuator import AdminActuator, ApplyResult
from .policy import Policy, PolicyParams
from .sources import Endpoints, PrometheusSource, ScrapeSource, Source
from .types import SLO, Decision, LiveSettings, Observation, TuneBounds, TunedConfig

logger = logging.getLogger("specfleet.tuner")


def params_from_spec(spec: InferenceServiceSpec, interval_s: float | None = None,
                     window_s: float | None = None) -> PolicyParams:
    """Policy settings from an InferenceService spec: SLO, bounds (k pinned to 0 without a method)."""
    interval = float(interval_s if interval_s is not None else spec.autotune.interval_seconds)
    return PolicyParams(
        slo=SLO(spec.slo.ttft_p95_ms / 1000.0, spec.slo.tpot_p95_ms / 1000.0),
        bounds=TuneBounds(**spec.tuned_bounds()),
        interval_s=interval,
        window_s=float(window_s if window_s is not None else max(interval, 10.0)),
    )


def spec_config(spec: InferenceServiceSpec) -> TunedConfig:
    """The config a pod starts with (what the engine's command line says)."""
    return TunedConfig(**spec.start_values())


def build_tuner(name: str, spec: InferenceServiceSpec, endpoints: Endpoints, admin_token: str, *,
                prometheus_url: str = "", prometheus_selector: str = "", interval_s: float | None = None,
                window_s: float | None = None) -> ServiceTuner:
    """The one wiring of a service's tuner, shared by the operator's timer and the local fleet: the policy
    from the spec, metrics from Prometheus when a URL is given (else a direct scrape of `endpoints`), and
    the admin API of the same endpoints with the service's admin token."""
    params = params_from_spec(spec, interval_s, window_s)
    source: Source = (PrometheusSource(prometheus_url, prometheus_selector, params.window_s) if prometheus_url
                      else ScrapeSource(endpoints, window_s=params.window_s))
    return ServiceTuner(name, Policy(params, spec_config(spec)), source, AdminActuator(admin_token), endpoints)


@dataclass
class Tick:
    decision: Decision
    observation: Observation
    applied: ApplyResult | None
    guard: int | None = None  # the engines' speculative_disable_by_batch_size (None: not managed)


class ServiceTuner:
    def __init__(self, name: str, policy: Policy, source: Source, actuator: AdminActuator,
                 endpoints: Endpoints) -> None:
        self.name = name
        self.policy = policy
        self.source = source
        self.actuator = actuator
        self.endpoints = endpoints

    async def tick(self) -> Tick:
        obs = await self.source.observe()
        decision = self.policy.decide(obs)
        applied = None
        desired = self.policy.current
        guard = self.policy.guard if self.policy.manages_guard else None
        if desired is not None:
            urls = await self.endpoints()
            applied = await self.actuator.ensure(urls, LiveSettings(desired, guard))
            if applied.refused:
                message = next(iter(applied.refused.values()))
                decision = self.policy.rejected(obs.time, desired, message)
                if decision.config is not None:
                    applied = await self.actuator.ensure(urls, LiveSettings(decision.config, guard))
            if applied.failed:
                logger.warning("event=tuner_apply_failed service=%s %s", self.name,
                               " ".join(f"{u}={e!r}" for u, e in applied.failed.items()))
        if decision.changed:
            logger.info("event=tuner_decision service=%s kind=%s reason=%r", self.name, decision.kind,
                        decision.reason)
        return Tick(decision, obs, applied, guard)

    async def close(self) -> None:
        await self.source.close()
        await self.actuator.close()
