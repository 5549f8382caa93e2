"""The one reconcile path: read what exists, converge it to what is rendered, report status.

Level-based and idempotent: it runs on create, update, resume and on a timer with the same code, and
running it twice in a row changes nothing the second time. It never writes the InferenceService's spec;
it returns the status to write and the Events to post, and the kopf handlers do both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .conditions import (
    Cond,
    Workload,
    build_status,
    condition_entries,
    deployment_conditions,
    invalid_spec_conditions,
)
from .config import OperatorConfig
from .inference_service import InferenceService, InvalidInferenceService, parse_inference_service
from .kube import ApiError, KubeClient, object_path
from .registry import ChildKey, ServiceMemory, digest, owned_shape
from .render import (
    new_admin_token,
    render_engine_workloads,
    render_network_policy,
    render_pdb,
    render_prefill_key_secret,
    render_router_children,
    render_secret,
    render_service,
    render_servicemonitor,
)
from .render.common import child_metadata, owner_reference
from .resources import (
    LABEL_ISVC,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    MANAGED_BY,
    ROLES,
    TUNER_FIELD_MANAGER,
    admin_secret_name,
    engine_workload_name,
    engines_service_name,
    epp_service_name,
    prefill_key_secret_name,
    router_name,
    tuned_config_name,
)

T = TypeVar("T")
LWS_API = "leaderworkerset.x-k8s.io/v1"
ADMIN_TOKEN = "admin-token"  # the Secret's memory entry: its data is never rewritten, only its ownership
PREFILL_KEY = "pd-key"  # the same for the endpoint picker's signing key (spec.disaggregation behind it)
CONFLICT_ATTEMPTS = 4
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    invalid: str | None = None  # set when the spec cannot be reconciled until the user changes it
    children: dict[str, dict[str, Any]] = field(default_factory=dict)


async def retry_on_conflict(action: Callable[[], Awaitable[T]], what: str) -> T:
    """A 409 means someone else wrote first: read again and converge again, a few times."""
    for attempt in range(CONFLICT_ATTEMPTS):
        try:
            return await action()
        except ApiError as error:
            if error.status != 409 or attempt == CONFLICT_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.05 * 2**attempt)
    raise AssertionError(f"unreachable: {what}")


@dataclass(frozen=True)
class GeneratedSecret:
    """A Secret the operator generates once and never rewrites: its name, what it is for (in the conflict's
    message), the conditions' reason when a Secret of that name is someone else's, its memory entry, and
    how to render it with a fresh value."""

    name: str
    purpose: str
    conflict_reason: str
    entry: str
    render: Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class SecretConflict:
    reason: str
    message: str


@dataclass(frozen=True)
class Refusal:
    """A child the API server refused (403, 422, ...): reported in status, not raised."""

    kind: str
    name: str
    status: int
    message: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: the API server answered {self.status}: {self.message}"


def _refusal(obj: dict[str, Any], error: ApiError) -> Refusal:
    return Refusal(obj["kind"], obj["metadata"]["name"], error.status, error.message)


def _fatal(error: ApiError) -> bool:
    """Errors that end the pass (kopf retries it): conflicts left after retries, throttling, 5xx, 401."""
    return error.retryable or error.status == 401


# Stale children (unchanged, last applied over a resync period ago) and stale discovery answers renewed
# per pass: one keeps every steady reconcile at <= 2 API calls (one renewal, one status write when
# something moved) and still renews a service's ~10 children within ~10 timer ticks (5 min at 30 s), well
# inside the 30 min period.
RENEWALS_PER_PASS = 1


class Reconciler:
    """One pass over one InferenceService. With the operator's `ServiceMemory` it applies only what
    changed since its last apply (and one stale child per pass); without one (a fresh memory) it applies
    every child, reading each first, as a first pass after the operator starts does."""

    def __init__(
        self,
        client: KubeClient,
        config: OperatorConfig,
        memory: ServiceMemory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.config = config
        self.memory = memory if memory is not None else ServiceMemory()
        self._clock = clock
        self._renewals = RENEWALS_PER_PASS

    async def reconcile(self, body: Mapping[str, Any], now: str) -> Outcome:
        previous = dict(body.get("status") or {})
        self.memory.saw_generation(int(body["metadata"].get("generation") or 0))
        try:
            isvc = parse_inference_service(
                body, f"{body['metadata'].get('namespace')}/{body['metadata']['name']}"
            )
        except InvalidInferenceService as error:
            return self._invalid(body, previous, str(error), now)

        events: list[Event] = []
        children: dict[str, dict[str, Any]] = {}
        refused: list[Refusal] = []
        conflict = await self._converge_secret(isvc, _admin_secret(isvc), events, refused)
        if conflict is None:
            conflict = await self._converge_prefill_key(isvc, events, refused)
        workloads, deployment_refused = await self._converge_workloads(
            isvc, conflict is None, children, events, refused
        )
        service = await self._child(render_service(isvc), events, refused)
        if service is not None:
            children["Service"] = service
        router = await self._converge_router(isvc, children, events, refused)
        workloads = [*workloads, *router]  # the router is in the data path: one more workload to be Ready
        pdb = render_pdb(isvc)
        if pdb is not None:
            applied = await self._child(pdb, events, refused)
            if applied is not None:
                children["PodDisruptionBudget"] = applied
        else:
            await self._delete_owned("PodDisruptionBudget", isvc, events)
        if self.config.network_policy:
            policy = await self._child(render_network_policy(isvc, self.config), events, refused)
            if policy is not None:
                children["NetworkPolicy"] = policy
        monitored = await self._service_monitor(isvc, children)
        if (
            not isvc.spec.autotune.enabled
        ):  # the tuner writes it (tuner/handlers.py); untuned, no pod reads it
            await self._delete_owned(
                "ConfigMap",
                isvc,
                events,
                tuned_config_name(isvc.name),
                "autotune is off: pods start on the spec",
            )
            self.memory.tuned, self.memory.tuned_deleted = None, False
        else:
            await self._restore_tuned(isvc, events, refused)

        conds = deployment_conditions(isvc, workloads)
        if conflict is not None or refused:
            conds = _refused_conditions(conds, conflict, refused, deployment_refused or conflict is not None)
        if monitored is not None:
            conds.append(monitored)
        status = build_status(
            isvc,
            workloads,
            previous,
            now,
            conds,
            observed=True if conflict is not None or deployment_refused else None,
        )
        events += transition_events(previous, status)
        return Outcome(status=status, events=events, children=children)

    def _invalid(self, body: Mapping[str, Any], previous: dict[str, Any], message: str, now: str) -> Outcome:
        meta = body["metadata"]
        generation = meta.get("generation", 0)
        conds: list[Cond] = invalid_spec_conditions(message)
        # The reconcile's other fields stay as they were (server-side apply would remove what it omits).
        status: dict[str, Any] = {
            key: previous[key]
            for key in ("replicas", "readyReplicas", "selector", "endpoint")
            if key in previous
        }
        status.update(
            {
                "observedGeneration": generation,
                "conditions": condition_entries(previous.get("conditions") or [], conds, generation, now),
            }
        )
        before = {c.get("type"): c for c in previous.get("conditions") or []}.get("Degraded", {})
        repeated = before.get("reason") == "InvalidSpec" and before.get("message") == message
        events = [] if repeated else [Event("Warning", "InvalidSpec", message)]  # once per distinct problem
        return Outcome(status=status, events=events, invalid=message)

    async def _converge_workloads(
        self,
        isvc: InferenceService,
        roll_out: bool,
        children: dict[str, dict[str, Any]],
        events: list[Event],
        refused: list[Refusal],
    ) -> tuple[list[Workload], bool]:
        """The engine workloads: one Deployment, one per role (spec.disaggregation), or a LeaderWorkerSet
        (engine.nodes > 1); the shapes not wanted now are deleted (a switch leaves no stale engines behind).
        Nothing is applied unless `roll_out`; a refused workload is reported from what runs now. Returns
        the workloads and whether any was not rolled out."""
        wanted = render_engine_workloads(isvc, self.config)
        workloads, not_rolled_out = [], False
        lws_served = await self._has_api(LWS_API)
        for obj in wanted:
            name = obj["metadata"]["name"]
            missing = obj["kind"] == "LeaderWorkerSet" and not lws_served
            if missing and roll_out:
                refused.append(
                    Refusal(
                        "LeaderWorkerSet",
                        name,
                        404,
                        f"the cluster serves no {LWS_API}: engine.nodes "
                        "> 1 runs as a LeaderWorkerSet; install its controller "
                        "(https://lws.sigs.k8s.io) or set engine.nodes to 1",
                    )
                )
            applied = await self._child(obj, events, refused) if roll_out and not missing else None
            if applied is None:
                not_rolled_out = True
                applied = await self.client.get(object_path(obj["kind"], isvc.namespace, name))
            role = obj["metadata"]["labels"].get(LABEL_ROLE)
            if applied is not None:
                children[f"{obj['kind']}/{role}" if role else obj["kind"]] = applied
            workloads.append(Workload(f"{obj['kind']} {name}", obj["spec"]["replicas"], applied))
        if roll_out:
            keep = {(o["kind"], o["metadata"]["name"]) for o in wanted}
            shapes = [("Deployment", engine_workload_name(isvc.name, role)) for role in (None, *ROLES)]
            if lws_served:
                shapes.append(("LeaderWorkerSet", isvc.name))
            for kind, name in shapes:
                if (kind, name) not in keep:
                    await self._delete_owned(kind, isvc, events, name, "the engines' shape changed")
        return workloads, not_rolled_out

    async def _converge_prefill_key(
        self, isvc: InferenceService, events: list[Event], refused: list[Refusal]
    ) -> SecretConflict | None:
        """The endpoint picker's signing key (`NAME-pd-key`) while it signs for decode engines. Not deleted
        when it no longer does (the operator's RBAC has no delete on Secrets, and no pod mounts it then): it
        goes with the InferenceService, and a service that signs again finds the same key."""
        if not isvc.signs_prefill:
            return None
        secret = GeneratedSecret(
            prefill_key_secret_name(isvc.name),
            "the endpoint picker's prefill signing key",
            "PrefillKeySecretConflict",
            PREFILL_KEY,
            lambda: render_prefill_key_secret(isvc, new_admin_token()),
        )
        return await self._converge_secret(isvc, secret, events, refused)

    async def _converge_secret(
        self,
        isvc: InferenceService,
        wanted: GeneratedSecret,
        events: list[Event],
        refused: list[Refusal],
    ) -> SecretConflict | None:
        """Create the Secret once; afterwards only make sure we own it. Its data is never rewritten.

        A Secret of that name that specfleet did not create (without its labels) is never adopted: the
        returned conflict names it, and no pod is rolled out that would mount it."""
        name = wanted.name
        path = object_path("Secret", isvc.namespace, name)
        if self._skip(("Secret", name), wanted.entry):
            return None  # checked within the resync period: created by us, owned by this service
        existing = await self.client.get(path)
        if existing is None:
            secret = wanted.render()
            try:
                await retry_on_conflict(lambda: self.client.create(secret), "secret")
            except ApiError as error:
                if _fatal(error):
                    raise
                refused.append(_refusal(secret, error))
                return None
            events.append(Event("Normal", "Created", f"created Secret {name} ({wanted.purpose})"))
            return None  # checked again next pass (its answer holds the value: not kept in memory)
        labels = existing["metadata"].get("labels") or {}
        if labels.get(LABEL_MANAGED_BY) != MANAGED_BY or labels.get(LABEL_ISVC) != isvc.name:
            return SecretConflict(
                wanted.conflict_reason,
                f"Secret {name} already exists and specfleet did not create it (it lacks the labels "
                f"{LABEL_MANAGED_BY}={MANAGED_BY} and {LABEL_ISVC}={isvc.name}); the operator will not adopt "
                f"it as {wanted.purpose}. Rename or delete that Secret, or rename the InferenceService",
            )
        owners = existing["metadata"].get("ownerReferences") or []
        if not any(o.get("uid") == isvc.metadata.uid for o in owners):
            await self.client.merge_patch(
                path, {"metadata": {"ownerReferences": [*owners, owner_reference(isvc)]}}
            )
        # the token is not kept in memory: only what the watch compares (our labels) and the version
        ours = {k: labels.get(k) for k in (LABEL_MANAGED_BY, LABEL_ISVC)}
        stub = {"metadata": {"labels": ours, "resourceVersion": existing["metadata"].get("resourceVersion")}}
        self.memory.record(
            ("Secret", name), wanted.entry, stub, self._clock(), {"metadata": {"labels": ours}}
        )
        return None

    async def _restore_tuned(
        self, isvc: InferenceService, events: list[Event], refused: list[Refusal]
    ) -> None:
        """The tuned ConfigMap, deleted by hand, written again with the data its watch last saw, under the
        tuner's field manager (the tuner writes it only when its config in force changes: without this,
        pods that start meanwhile would start on the spec)."""
        if not self.memory.tuned_deleted or self.memory.tuned is None:
            return
        name = tuned_config_name(isvc.name)
        configmap = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": child_metadata(isvc, name),
            "data": self.memory.tuned,
        }
        try:
            await self.client.apply(configmap, TUNER_FIELD_MANAGER)
        except ApiError as error:
            if _fatal(error):
                raise
            refused.append(_refusal(configmap, error))
            return
        self.memory.tuned_deleted = False
        events.append(Event("Normal", "Restored", f"restored ConfigMap {name} (the tuner's config in force)"))

    async def _child(
        self, obj: dict[str, Any], events: list[Event], refused: list[Refusal]
    ) -> dict[str, Any] | None:
        """Apply one child; a refusal is recorded (and None returned), anything transient is raised."""
        try:
            return await retry_on_conflict(lambda: self._apply(obj, events), obj["kind"])
        except ApiError as error:
            if _fatal(error):
                raise
            refused.append(_refusal(obj, error))
            return None

    async def _service_monitor(
        self, isvc: InferenceService, children: dict[str, dict[str, Any]]
    ) -> Cond | None:
        """The optional ServiceMonitor, as the chart's serviceMonitor.enabled says: a problem with it is the
        `Monitored` condition, never a failed reconcile."""
        if not self.config.service_monitor:
            return None
        if not await self._has_api("monitoring.coreos.com/v1"):
            return Cond(
                "Monitored",
                "False",
                "PrometheusOperatorMissing",
                "the cluster serves no monitoring.coreos.com/v1 ServiceMonitor: install the Prometheus "
                "Operator, or set serviceMonitor.enabled=false in the Helm chart",
            )
        monitor = render_servicemonitor(isvc)
        try:
            children["ServiceMonitor"] = await retry_on_conflict(
                lambda: self._apply(monitor, []), "servicemonitor"
            )
        except ApiError as error:
            if _fatal(error):
                raise
            hint = (
                (
                    "the operator's RBAC has no rule for servicemonitors: upgrade the chart with "
                    "serviceMonitor.enabled=true, or set it to false"
                )
                if error.status == 403
                else "report it"
            )
            return Cond(
                "Monitored",
                "False",
                "Forbidden" if error.status == 403 else "Refused",
                f"ServiceMonitor {isvc.name}: the API server answered {error.status}: {error.message}; {hint}",
            )
        return Cond(
            "Monitored",
            "True",
            "ServiceMonitorApplied",
            f"ServiceMonitor {isvc.name} scrapes the engine pods",
        )

    def _skip(self, key: ChildKey, rendered: str) -> bool:
        """Whether the child is as last applied: unchanged render, unchanged on the server as far as the
        watches tell, and applied within the resync period (or stale, with this pass's renewals spent)."""
        state = self.memory.state(key, rendered, self._clock(), self.config.resync_interval_seconds)
        if state == "stale" and self._renewals > 0:
            self._renewals -= 1
            return False
        return state != "changed"

    async def _has_api(self, group_version: str) -> bool:
        """Discovery, asked again once a resync period (a CRD installed later is found then) as one of
        the pass's renewals; the operator's services share the answer."""
        served, at = self.memory.apis.get(group_version, (False, None))
        if at is not None:
            if self._clock() - at < self.config.resync_interval_seconds or self._renewals == 0:
                return served
            self._renewals -= 1
            self.memory.apis[group_version] = (served, self._clock())  # others keep it meanwhile
        served = await self.client.has_api(group_version)
        self.memory.apis[group_version] = (served, self._clock())
        return served

    async def _apply(self, obj: dict[str, Any], events: list[Event]) -> dict[str, Any]:
        """Server-side apply of one child; a child as last applied is not sent again. The state before
        (for the Created and Updated events) is the one the memory holds, read only when it holds none."""
        meta = obj["metadata"]
        key, rendered = (obj["kind"], meta["name"]), digest(obj)
        if self._skip(key, rendered):
            return self.memory.objects[key]
        before = self.memory.objects.get(key)
        if before is None:
            before = await self.client.get(object_path(obj["kind"], meta["namespace"], meta["name"]))
        after = await self.client.apply(obj)
        workload = obj["kind"] in WORKLOAD_KINDS  # watched for status and generation instead
        self.memory.record(key, rendered, after, self._clock(), None if workload else owned_shape(obj))
        what = f"{obj['kind']} {meta['name']}"
        if before is None:
            events.append(Event("Normal", "Created", f"created {what}"))
        elif before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            if before["metadata"].get("generation") != after["metadata"].get("generation"):
                events.append(Event("Normal", "Updated", f"updated {what} to match the spec"))
        return after

    async def _converge_router(
        self,
        isvc: InferenceService,
        children: dict[str, dict[str, Any]],
        events: list[Event],
        refused: list[Refusal],
    ) -> list[Workload]:
        """With routing on, the router's RBAC, the engines' headless Service, the router Deployment and its
        PDB; with it off, none of them (deleted if this InferenceService owns them). Returns the router
        Deployment as a workload for the conditions (a refused one as it runs now), or none."""
        wanted = render_router_children(isvc, self.config)
        router: list[Workload] = []
        for obj in wanted:
            applied = await self._child(obj, events, refused)
            if obj["kind"] == "Deployment":
                name = obj["metadata"]["name"]
                current = applied or await self.client.get(object_path("Deployment", isvc.namespace, name))
                selector = ",".join(f"{k}={v}" for k, v in obj["spec"]["selector"]["matchLabels"].items())
                router.append(
                    Workload(
                        f"Deployment {name}", obj["spec"]["replicas"], current, engines=False, pods=selector
                    )
                )
            if applied is not None:
                role = obj["metadata"]["labels"].get(LABEL_ROLE)
                key = (
                    "EndpointPickerService"
                    if obj["metadata"]["name"] == epp_service_name(isvc.name)
                    else "EnginesService" + (f"/{role}" if role else "")
                    if obj["kind"] == "Service"
                    else f"Router{obj['kind']}"
                )
                children[key] = applied
        keep = {o["metadata"]["name"] for o in wanted if o["kind"] == "Service"}
        for role in (None, *ROLES):  # engines' Services of another shape (roles added or removed)
            service = engines_service_name(isvc.name, role)
            if wanted and service not in keep:
                await self._delete_owned("Service", isvc, events, service, "the engines' roles changed")
        await self._delete_endpoint_picker(isvc, events, {(o["kind"], o["metadata"]["name"]) for o in wanted})
        if not wanted:
            name = router_name(isvc.name)
            services = [("Service", engines_service_name(isvc.name, role)) for role in (None, *ROLES)]
            for kind, child in (
                ("PodDisruptionBudget", name),
                ("Deployment", name),
                *services,
                ("RoleBinding", name),
                ("Role", name),
                ("ServiceAccount", name),
            ):
                await self._delete_owned(kind, isvc, events, child, "routing is disabled")
        return router

    async def _delete_endpoint_picker(
        self, isvc: InferenceService, events: list[Event], wanted: set[tuple[str, str]]
    ) -> None:
        """The endpoint-picker children that routing.mode (or its gateway) no longer asks for. A cluster that
        serves no InferencePool or HTTPRoute (404), or an operator without RBAC for them (403, a chart from
        before they existed), has none of ours: nothing to delete."""
        for kind, name in (
            ("HTTPRoute", isvc.name),
            ("InferencePool", isvc.name),
            ("Service", epp_service_name(isvc.name)),
        ):
            if (kind, name) in wanted:
                continue
            try:
                await self._delete_owned(kind, isvc, events, name, "routing.mode or its gateway changed")
            except ApiError as error:
                if error.status not in (403, 404):
                    raise
                self.memory.gone((kind, name))

    async def _delete_owned(
        self,
        kind: str,
        isvc: InferenceService,
        events: list[Event],
        name: str | None = None,
        why: str = "not needed at this replica count",
    ) -> None:
        name = name or isvc.name
        if (kind, name) in self.memory.absent:
            return  # checked since the spec last changed, and nothing of ours was there
        path = object_path(kind, isvc.namespace, name)
        existing = await self.client.get(path)
        owners = (existing or {}).get("metadata", {}).get("ownerReferences") or []
        if existing is not None and any(o.get("uid") == isvc.metadata.uid for o in owners):
            await self.client.delete(path)
            events.append(Event("Normal", "Deleted", f"deleted {kind} {name} ({why})"))
        self.memory.gone((kind, name))


def _admin_secret(isvc: InferenceService) -> GeneratedSecret:
    return GeneratedSecret(
        admin_secret_name(isvc.name),
        "the admin token",
        "AdminSecretConflict",
        ADMIN_TOKEN,
        lambda: render_secret(isvc, new_admin_token()),
    )


def _refused_conditions(
    conds: list[Cond], conflict: SecretConflict | None, refused: list[Refusal], not_rolled_out: bool
) -> list[Cond]:
    """Degraded=True with the server's words; Ready=False when the spec's pods cannot roll out."""
    if conflict is not None:
        reason, message = conflict.reason, conflict.message
    else:
        statuses = {r.status for r in refused}
        reason = {frozenset({403}): "ChildForbidden", frozenset({422}): "ChildInvalid"}.get(
            frozenset(statuses), "ChildRejected"
        )
        message = "; ".join(map(str, refused))
        if 403 in statuses:
            message += ". A 403 means the operator's RBAC lacks a permission: upgrade the Helm chart"
    out = []
    for cond in conds:
        if cond.type == "Degraded":
            cond = Cond("Degraded", "True", reason, message)
        elif cond.type == "Ready" and not_rolled_out:
            cond = Cond("Ready", "False", reason, message)
        elif cond.type == "Progressing" and not_rolled_out:
            cond = Cond("Progressing", "False", reason, "nothing is rolled out until the problem is fixed")
        out.append(cond)
    return out


def transition_events(previous: dict[str, Any], status: dict[str, Any]) -> list[Event]:
    """Events for condition changes a user should see in `kubectl describe isvc`."""
    before = {c["type"]: c.get("status") for c in previous.get("conditions") or []}
    events = []
    for cond in status["conditions"]:
        if before.get(cond["type"]) == cond["status"]:
            continue
        if cond["type"] == "Ready" and cond["status"] == "True":
            events.append(Event("Normal", "Ready", f"{cond['message']}; serving at {status.get('endpoint')}"))
        elif cond["type"] == "Degraded" and cond["status"] == "True":
            events.append(Event("Warning", cond["reason"], cond["message"]))
        elif cond["type"] == "Degraded" and before.get("Degraded") == "True":
            events.append(Event("Normal", "Recovered", "no longer degraded"))
    return events
