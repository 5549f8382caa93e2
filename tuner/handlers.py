"""kopf: one tuning loop per InferenceService with `spec.autotune.enabled`.

A timer fires every few seconds for each such service and runs the service's `ServiceTuner` once its
`autotune.intervalSeconds` have passed. Pods come from the Kubernetes API (ready pods with the service's
selector label), the admin token from the `NAME-admin` Secret the reconcile creates, metrics from
`autotune.prometheusURL` (else the operator's default, else a direct scrape of the pods). It writes only
`status.tuning` and the `Tuned` condition (with autoscaling on, `status.autoscaling`: the replica count the
reconcile renders into the Deployment), plus an Event per change and per transition (frozen, resumed,
failing static, recovered); never `spec`.

Freeze: `spec.autotune.freeze: true` (in Git) or the annotation `specfleet.io/tuner-freeze: "true"` (a
`kubectl annotate`, no Git change) holds the config from the next interval on; the annotation is read at
every tick, so removing it resumes tuning within one interval too.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import quote

import kopf
from specfleet.operator import metrics
from specfleet.operator.conditions import timestamp
from specfleet.operator.handlers import autotune_enabled, kube_client
from specfleet.operator.inference_service import InvalidInferenceService, parse_inference_service
from specfleet.operator.kube import ApiError, KubeClient, object_path
from specfleet.operator.render.secret import read_admin_token
from specfleet.operator.resources import (
    ADMIN_PORT,
    ENGINE_PORT,
    GROUP,
    LABEL_ISVC,
    PLURAL,
    TUNER_FIELD_MANAGER,
    VERSION,
    admin_secret_name,
)
from specfleet.operator.spec import FREEZE_ANNOTATION

from .actuator import admin_on_port
from .loop import ServiceTuner, build_tuner, replica_params, tuner_fingerprint
from .policy.replicas import ReplicaPolicy
from .policy.resume import restore, snapshot
from .report import autoscaling_status, event_for, scale_event, status_patch, transition_events

TIMER_SECONDS = float(os.environ.get("SPECFLEET_TUNER_TICK_SECONDS", "5"))
# PromQL label matchers for a service's engine series; {namespace} and {name} are filled in. The default
# matches the labels the Prometheus Operator adds when scraping through our ServiceMonitor.
SELECTOR_TEMPLATE = os.environ.get(
    "SPECFLEET_PROMETHEUS_SELECTOR", 'namespace="{namespace}",service="{name}"'
)


async def ready_pod_urls(client: KubeClient, namespace: str, name: str) -> list[str]:
    """http://POD_IP:8000 of each pod of the service whose Ready condition is True."""
    selector = quote(f"{LABEL_ISVC}={name}")
    pods = await client.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}") or {}
    urls = []
    for pod in pods.get("items", []):
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            urls.append(f"http://{status['podIP']}:{ENGINE_PORT}")
    return sorted(urls)


def frozen_by(body: kopf.Body) -> str | None:
    """Who froze this service's tuner, or None: the spec field, else the annotation ("true", any case)."""
    if ((body.get("spec") or {}).get("autotune") or {}).get("freeze"):
        return "spec.autotune.freeze"
    value = (body["metadata"].get("annotations") or {}).get(FREEZE_ANNOTATION, "")
    return f"annotation {FREEZE_ANNOTATION}=true" if str(value).strip().lower() == "true" else None


def _restore(tuner: ServiceTuner, status: kopf.Status) -> None:
    """A rebuilt loop (spec change, operator restart) continues the transitions status last reported, so
    that lifting a freeze through the spec still posts TuningResumed."""
    tuner.frozen_by = (status.get("tuning") or {}).get("frozenBy") or None
    tuner.static = any(
        c.get("type") == "Tuned" and c.get("reason") == "MetricsUnavailable"
        for c in status.get("conditions") or []
    )


async def _build(client: KubeClient, body: kopf.Body, memo: kopf.Memo) -> ServiceTuner:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    isvc = parse_inference_service(body, f"{namespace}/{name}")
    secret = await client.get(object_path("Secret", namespace, admin_secret_name(name)))
    if secret is None:
        raise kopf.TemporaryError(
            f"Secret {admin_secret_name(name)} (admin token) does not exist yet; the reconcile creates it",
            delay=10,
        )

    async def endpoints() -> list[str]:
        return await ready_pod_urls(client, namespace, name)

    return build_tuner(
        f"{namespace}/{name}",
        isvc.spec,
        endpoints,
        read_admin_token(secret),
        admin_url=admin_on_port(ADMIN_PORT),
        prometheus_url=isvc.spec.autotune.prometheus_url or getattr(memo.config, "prometheus_url", "") or "",
        prometheus_selector=SELECTOR_TEMPLATE.format(namespace=namespace, name=name),
    )


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=TIMER_SECONDS,
    initial_delay=TIMER_SECONDS,
    sharp=False,
    when=autotune_enabled,
)
async def tune(
    body: kopf.Body, meta: kopf.Meta, status: kopf.Status, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    # uid -> (tuner, fingerprint of the spec fields it depends on, monotonic time of its last interval)
    tuners: dict[str, tuple[ServiceTuner, str, float]] = memo.setdefault("tuners", {})
    uid, generation = meta["uid"], int(meta.get("generation") or 0)
    try:
        fingerprint = tuner_fingerprint(
            parse_inference_service(body, f"{meta['namespace']}/{meta['name']}").spec
        )
    except InvalidInferenceService:
        return  # the reconcile reports InvalidSpec
    entry = tuners.get(uid)
    client = kube_client(memo)
    # Rebuilt only when a field the tuner depends on changed (bounds, SLO, method, model, ...): a /scale write
    # bumps the generation too, and must not make the tuner forget what it learned.
    if entry is None or entry[1] != fingerprint:
        if entry is not None:
            await entry[0].close()
        try:
            tuner = await _build(client, body, memo)
        except ApiError as error:
            raise kopf.TemporaryError(f"cannot read the admin Secret: {error}", delay=10) from error
        _restore(tuner, status)
        # a restarted operator continues from status.tuning, if it was learned under this same spec
        if entry is None and restore(
            tuner.policy, dict(status).get("tuning") or {}, time.monotonic(), fingerprint
        ):
            logger.info(
                "event=tuner_resumed config=%s", tuner.policy.current.short() if tuner.policy.current else ""
            )
        entry = tuners[uid] = (tuner, fingerprint, 0.0)
    tuner, _fingerprint, last = entry
    if time.monotonic() - last < tuner.policy.params.interval_s:
        await tuner.sync_new_pods()  # a pod of a scale-up gets the tuned config now, not at the next interval
        return
    tuners[uid] = (tuner, fingerprint, time.monotonic())
    tick = await tuner.tick(frozen_by(body))
    now = timestamp()
    # The tuner's share of status (status.tuning, the Tuned condition, with autoscaling status.autoscaling)
    # under its own field manager: the reconcile's conditions are another manager's entries of the same
    # list-map, which this cannot touch.
    update = status_patch(
        tick,
        tuner.policy.current,
        dict(status),
        generation,
        now,
        resume=snapshot(tuner.policy, time.monotonic(), fingerprint),
    )
    scaled = None
    replicas = _replica_policy(memo, uid, generation, body)
    if replicas is not None:  # the replica knob, from the same observation and model as the config
        obs = tick.observation
        decision = replicas.decide(
            time.monotonic(),
            obs,
            None if obs.error else tuner.policy.model(obs),
            tuner.policy.current,
            tuner.policy.params.slo,
        )
        update["autoscaling"] = autoscaling_status(decision, dict(status).get("autoscaling"), now)
        scaled = scale_event(decision)
    await client.apply_status(meta["namespace"], meta["name"], update, TUNER_FIELD_MANAGER)
    metrics.tuned(meta["namespace"], meta["name"], tuner.static_intervals, tick.frozen_by is not None, uid)
    if metrics.live(uid):
        metrics.set_conditions(
            meta["namespace"], meta["name"], [c for c in update["conditions"] if c["type"] == "Tuned"]
        )
    change = event_for(tick.decision)
    for kind, reason, message in [
        *transition_events(tick),
        *([change] if change else []),
        *([scaled] if scaled else []),
    ]:
        post = kopf.warn if kind == "Warning" else kopf.info
        post(body, reason=reason, message=message[:1000])
    logger.debug("tuner tick: %s", tick.decision.reason)


def _replica_policy(memo: kopf.Memo, uid: str, generation: int, body: kopf.Body) -> ReplicaPolicy | None:
    """One replica policy per service with autoscaling on, started from the count in force; reset by a
    spec change like the tuner."""
    policies: dict[str, tuple[ReplicaPolicy, int]] = memo.setdefault("replica_policies", {})
    isvc = parse_inference_service(body, f"{body['metadata'].get('namespace')}/{body['metadata']['name']}")
    if not isvc.spec.autoscaling.enabled:
        policies.pop(uid, None)
        return None
    entry = policies.get(uid)
    if entry is None or entry[1] != generation:
        entry = (ReplicaPolicy(replica_params(isvc.spec), isvc.desired_replicas), generation)
        policies[uid] = entry
    return entry[0]


@kopf.on.event(GROUP, VERSION, PLURAL)
async def forget(event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A deleted service's loop goes with it (an event handler: the timers hold no finalizer)."""
    if event.get("type") != "DELETED":
        return
    memo.setdefault("replica_policies", {}).pop(meta["uid"], None)
    entry = memo.setdefault("tuners", {}).pop(meta["uid"], None)
    if entry is not None:
        await entry[0].close()
