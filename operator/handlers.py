"""kopf handlers: every cause (create, update, resume, timer) runs the same level-based reconcile.

Extending: a per-service loop (the tuner) registers its own `@kopf.timer` or `@kopf.daemon` on the same
resource in its own module (see `cli.OPERATOR_MODULES`), gated with `when=autotune_enabled`; it reads
`status` and writes only `status.tuning` and the `Tuned` condition, never `spec`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf

from . import metrics
from .conditions import timestamp
from .config import OperatorConfig
from .kube import KINDS, ApiError, KubeClient, object_path
from .reconcile import WORKLOAD_KINDS, Outcome, Reconciler
from .registry import Registry
from .resources import (
    API_VERSION,
    FIELD_MANAGER,
    GROUP,
    KIND,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    PLURAL,
    VERSION,
    tuned_config_name,
)

CONFIG = OperatorConfig.from_env()
# (group, version, plural) of every kind of child (kube.KINDS), the workloads first: the operator watches
# them, so a hand edit or deletion is repaired at its event, not at the resync. Not the admin Secret:
# list/watch on Secrets would read every token in the namespace (the chart grants get on it by name only);
# it is checked at the resync (OperatorConfig.resync_interval_seconds).
UNWATCHED = (KIND, "Secret")
WATCHED = [
    (*api_version.rpartition("/")[::2], plural)
    for kind, (api_version, plural) in sorted(KINDS.items(), key=lambda k: k[0] not in WORKLOAD_KINDS)
    if kind not in UNWATCHED
]
TEMPORARY_DELAY_SECONDS = 10
_credentials: dict[str, Any] = {}


def autotune_enabled(spec: kopf.Spec, **_: Any) -> bool:
    """`when=` filter for per-service tuning timers."""
    return bool((spec.get("autotune") or {}).get("enabled"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Handler progress and the last-handled spec live in annotations: the CRD's structural schema
    # would prune kopf's default `status.kopf` field.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    for group, version, plural in WATCHED:  # only the operator's children: filtered by the API server
        settings.watching.label_selectors[group, version, plural] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    memo.config = CONFIG
    memo.registry = Registry()  # every object's memo is a shallow copy of this one: they share it
    drop_finalizer_requirements(kopf.get_default_registry())


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then the kubeconfig; the reconcile's client reuses these."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    _credentials["info"] = info
    return info


@kopf.on.cleanup()
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    client = registry_of(memo).client
    if client is not None:
        await client.close()


def registry_of(memo: kopf.Memo) -> Registry:
    """The operator-wide registry `configure` put on the memo (every object's memo shares it)."""
    registry = memo.get("registry")
    if not isinstance(registry, Registry):
        raise RuntimeError(
            "the memo has no operator registry: run the handlers under kopf with specfleet.operator.handlers "
            "loaded (its startup handler sets memo.registry), or pass kopf.Memo(registry=Registry(...))"
        )
    return registry


def kube_client(memo: kopf.Memo) -> KubeClient:
    """The operator's one API client, built from kopf's login on first use; other handler modules (the
    tuner's) share it through this function."""
    registry = registry_of(memo)
    if registry.client is None:
        if "info" not in _credentials:
            raise kopf.TemporaryError(
                "no Kubernetes credentials yet; retrying", delay=TEMPORARY_DELAY_SECONDS
            )
        registry.client = KubeClient.from_connection_info(_credentials["info"])
    return registry.client


async def converge(
    body: Mapping[str, Any], memo: kopf.Memo, logger: kopf.Logger, cause: str = "timer"
) -> Outcome:
    """Reconcile one InferenceService and write the reconcile's share of its status (server-side apply,
    field manager `specfleet-operator`) when it changed, then post the Events. One reconcile at a time per
    InferenceService, whatever started it (`cause`: the timer, a change, a workload's watch event)."""
    meta = body["metadata"]
    registry = registry_of(memo)
    memory = registry.service(meta["uid"])
    if memory is None:
        return Outcome(status={})  # deleted: its DELETED event was handled
    async with memory.lock:
        # the newest of: this body (kopf's, or the owner a workload's event names), the watch's last, the
        # answer to the last status write (the watch may not have delivered it yet)
        current = memory.see(copy.deepcopy(dict(body)))
        if registry.known(meta["uid"]) is not memory:
            return Outcome(status={})  # deleted meanwhile: nothing to report on
        client = kube_client(memo)
        try:
            metrics.saw_generation(
                meta["namespace"], meta["name"], int(current["metadata"].get("generation") or 0), meta["uid"]
            )
            outcome = await Reconciler(client, memo.config, memory).reconcile(current, now=timestamp())
            if memory.status_changed(dict(current.get("status") or {}), outcome.status):
                answer = await client.apply_status(
                    meta["namespace"], meta["name"], outcome.status, FIELD_MANAGER
                )
                memory.wrote(outcome.status)
                if answer is not None:
                    memory.see(answer)
            metrics.reconciled(meta["namespace"], meta["name"], outcome.status, meta["uid"])
        except ApiError as error:
            if error.status == 401:
                registry.client = None  # credentials rotated: rebuild from kopf's fresh login next time
            raise kopf.TemporaryError(f"{error}; retrying", delay=TEMPORARY_DELAY_SECONDS) from error
        except OSError as error:  # connection refused/reset: the API server is restarting
            raise kopf.TemporaryError(
                f"cannot reach the Kubernetes API: {error}", delay=TEMPORARY_DELAY_SECONDS
            ) from error
    for event in outcome.events:
        post = kopf.warn if event.type == "Warning" else kopf.info
        post(
            cast(kopf.Body, dict(current)), reason=event.reason, message=event.message
        )  # kopf reads it as a Body
    logger.debug(
        "reconciled cause=%s conditions=%s",
        cause,
        {c["type"]: c["status"] for c in outcome.status.get("conditions", [])},
    )
    return outcome


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=CONFIG.reconcile_interval_seconds,
    initial_delay=min(5.0, CONFIG.reconcile_interval_seconds),
    sharp=False,
)
async def reconcile(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, reason: Any = None, **_: Any
) -> None:
    if body["metadata"].get("deletionTimestamp"):
        return  # being deleted: the children go with it (owner references)
    outcome = await converge(body, memo, logger, cause=str(getattr(reason, "value", reason) or "timer"))
    if outcome.invalid:
        raise kopf.PermanentError(
            f"{outcome.invalid}\nFix the spec; the operator retries on the next change."
        )


def _owner(body: Mapping[str, Any]) -> dict[str, Any] | None:
    return next(
        (
            o
            for o in body["metadata"].get("ownerReferences") or []
            if o.get("kind") == KIND and o.get("apiVersion") == API_VERSION and o.get("controller")
        ),
        None,
    )


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGED_BY})
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels={LABEL_MANAGED_BY: MANAGED_BY})
async def deployment_changed(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, type: str | None = None, **_: Any
) -> None:
    """The Deployment (or LeaderWorkerSet) controller's progress reaches status within seconds, not at the
    next timer: a change to an owned workload that a reconcile reads (its status, its generation, which
    anyone's spec edit moves, a deletion) reconciles its owner; other events (the echo of the operator's
    own apply, label edits) do not. kopf watches leaderworkersets only where the cluster serves them."""
    owner = _owner(body)
    if owner is None:
        return
    memory = registry_of(memo).known(owner.get("uid", ""))
    if memory is not None:
        key = (str(body.get("kind")), str(body["metadata"]["name"]))
        if not memory.observe(key, copy.deepcopy(dict(body)), deleted=type == "DELETED"):
            return
        isvc = memory.isvc
    else:
        isvc = None  # not reconciled since the operator started: read its owner
    if isvc is None:
        namespace = body["metadata"]["namespace"]
        isvc = await kube_client(memo).get(object_path(KIND, namespace, owner["name"]))
    if (
        isvc is None
        or isvc["metadata"].get("uid") != owner.get("uid")
        or isvc["metadata"].get("deletionTimestamp")
    ):
        return
    await converge(isvc, memo, logger, cause=f"{body.get('kind')}/{body['metadata']['name']}")


def _watch_children(handler: Any) -> Any:
    """Registers `handler` for every kind of child but the workloads (kube.KINDS)."""
    for group, version, plural in WATCHED[2:]:
        handler = kopf.on.event(group, version, plural, labels={LABEL_MANAGED_BY: MANAGED_BY})(handler)
    return handler


@_watch_children
async def child_changed(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, type: str | None = None, **_: Any
) -> None:
    """A child the operator applied (Service, ServiceAccount, Role, RoleBinding, PodDisruptionBudget,
    NetworkPolicy, ServiceMonitor) deleted, or edited where the operator rendered a field,
    is applied again at once by a reconcile of its owner; the tuned ConfigMap, deleted, is restored. Events
    that change nothing the operator owns (another tool's annotation, the echo of the operator's own
    apply) make no API call. kopf watches servicemonitors only where the cluster serves them."""
    owner = _owner(body)
    memory = registry_of(memo).known((owner or {}).get("uid", ""))
    if owner is None or memory is None or memory.isvc is None:
        return  # not reconciled since the operator started: its first reconcile applies every child
    kind, name = str(body.get("kind")), str(body["metadata"]["name"])
    deleted = type == "DELETED"
    if kind == "ConfigMap" and name == tuned_config_name(owner["name"]):
        changed = memory.observe_tuned(copy.deepcopy(dict(body)), deleted)
    else:
        changed = memory.observe_child((kind, name), copy.deepcopy(dict(body)), deleted)
    if changed and not memory.isvc["metadata"].get("deletionTimestamp"):
        await converge(memory.isvc, memo, logger, cause=f"{kind}/{name}")


@kopf.on.event(GROUP, VERSION, PLURAL)
async def remember_service(event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """Every InferenceService event keeps its newest body in the registry (a workload's event reconciles
    from it, without a read); DELETED forgets the service: its lock, its memory."""
    registry = registry_of(memo)
    if event.get("type") == "DELETED":
        registry.forget(meta["uid"])
        return
    memory = registry.service(meta["uid"])
    if memory is not None:
        memory.see(dict(event["object"]))


def drop_finalizer_requirements(registry: Any) -> int:
    """kopf adds its finalizer to every object a timer or daemon runs for, so that it can stop them
    before the object goes. Ours need no cleanup (children are garbage-collected through their owner
    references; the tuner forgets a service on its DELETED event), and the finalizer would make every
    deletion hang while the operator is not running (uninstalled first, scaled to zero, crash-looping),
    including namespace and Argo CD app deletions. So the timers are registered without it. Returns how
    many handlers changed; tests/operator/test_op_semantics.py checks that no finalizer is ever added."""
    spawning = registry._spawning  # kopf has no public switch for this (timers hard-code requires_finalizer)
    changed = [h for h in spawning._handlers if getattr(h, "requires_finalizer", False)]
    spawning._handlers = [
        dataclasses.replace(h, requires_finalizer=False) if h in changed else h for h in spawning._handlers
    ]
    return len(changed)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def forget_metrics(type: str, meta: kopf.Meta, **_: Any) -> None:
    """A deleted service's series go (the watch's DELETED event: no finalizer needed)."""
    if type == "DELETED":
        metrics.forget(meta["namespace"], meta["name"], meta.get("uid"))


# Adapters (operator/adapters.py): a pod that turned ready is served its adapters within one tick; each tick
# asks every ready engine's /v1/models once, a cheap call.
ADAPTER_SYNC_SECONDS = 10.0


def adapters_listed(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    """Adapters to serve, or a status.adapters to clear."""
    return bool(spec.get("adapters")) or "adapters" in status


@kopf.timer(GROUP, VERSION, PLURAL, interval=ADAPTER_SYNC_SECONDS, when=adapters_listed, sharp=False)
async def sync_adapters(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    import httpx

    from .adapters import ADAPTERS_FIELD_MANAGER, ready_engine_pods
    from .adapters import sync_adapters as converge_adapters
    from .inference_service import InvalidInferenceService, parse_inference_service

    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        isvc = parse_inference_service(body, f"{namespace}/{name}")
    except InvalidInferenceService:
        return  # the reconcile reports it
    client = kube_client(memo)
    update: dict[str, Any] | None = {}  # no adapters: this manager's fields removed
    if isvc.spec.adapters:
        pods = await ready_engine_pods(client, namespace, name)
        async with httpx.AsyncClient(timeout=30.0) as http:
            status = dict(body.get("status") or {})
            update = await converge_adapters(client, http, isvc, status, timestamp(), pods)
    if update is not None:
        await client.apply_status(namespace, name, update, ADAPTERS_FIELD_MANAGER)
