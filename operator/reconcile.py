"""The one reconcile path: read what exists, converge it to what is rendered, report status.

Level-based and idempotent: it runs on create, update, resume and on a timer with the same code, and
running it twice in a row changes nothing the second time. It never writes the InferenceService's spec;
it returns the status to write and the Events to post, and the kopf handlers do both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .conditions import Cond, build_status, invalid_spec_conditions, merge_conditions
from .config import OperatorConfig
from .inference_service import InferenceService, InvalidInferenceService, parse_inference_service
from .kube import ApiError, KubeClient, object_path
from .render import (
    new_admin_token,
    render_deployment,
    render_pdb,
    render_router_children,
    render_secret,
    render_service,
    render_servicemonitor,
)
from .render.common import owner_reference
from .resources import admin_secret_name, engines_service_name, router_name

T = TypeVar("T")
CONFLICT_ATTEMPTS = 4


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


class Reconciler:
    def __init__(self, client: KubeClient, config: OperatorConfig) -> None:
        self.client = client
        self.config = config

    async def reconcile(self, body: Mapping[str, Any], now: str) -> Outcome:
        previous = dict(body.get("status") or {})
        try:
            isvc = parse_inference_service(body, f"{body['metadata'].get('namespace')}/{body['metadata']['name']}")
        except InvalidInferenceService as error:
            return self._invalid(body, previous, str(error), now)

        events: list[Event] = []
        children: dict[str, dict[str, Any]] = {}
        await retry_on_conflict(lambda: self._converge_secret(isvc, events), "secret")
        children["Deployment"] = await retry_on_conflict(
            lambda: self._apply(render_deployment(isvc, self.config), events), "deployment")
        children["Service"] = await retry_on_conflict(lambda: self._apply(render_service(isvc), events), "service")
        await self._converge_router(isvc, children, events)
        pdb = render_pdb(isvc)
        if pdb is not None:
            children["PodDisruptionBudget"] = await retry_on_conflict(lambda: self._apply(pdb, events), "pdb")
        else:
            await self._delete_owned("PodDisruptionBudget", isvc, events)
        if await self.client.has_api("monitoring.coreos.com/v1"):
            children["ServiceMonitor"] = await retry_on_conflict(
                lambda: self._apply(render_servicemonitor(isvc), events), "servicemonitor")

        status = build_status(isvc, children["Deployment"], previous, now)
        events += transition_events(previous, status)
        return Outcome(status=status, events=events, children=children)

    def _invalid(self, body: Mapping[str, Any], previous: dict[str, Any], message: str, now: str) -> Outcome:
        meta = body["metadata"]
        generation = meta.get("generation", 0)
        conds: list[Cond] = invalid_spec_conditions(message)
        status = {
            "observedGeneration": generation,
            "conditions": merge_conditions(previous.get("conditions") or [], conds, generation, now),
        }
        before = {c.get("type"): c for c in previous.get("conditions") or []}.get("Degraded", {})
        repeated = before.get("reason") == "InvalidSpec" and before.get("message") == message
        events = [] if repeated else [Event("Warning", "InvalidSpec", message)]  # once per distinct problem
        return Outcome(status=status, events=events, invalid=message)

    async def _converge_secret(self, isvc: InferenceService, events: list[Event]) -> None:
        """Create the admin token once; afterwards only make sure we own it. Its data is never rewritten."""
        path = object_path("Secret", isvc.namespace, admin_secret_name(isvc.name))
        existing = await self.client.get(path)
        if existing is None:
            await self.client.create(render_secret(isvc, new_admin_token()))
            events.append(Event("Normal", "Created", f"created Secret {admin_secret_name(isvc.name)} (admin token)"))
            return
        owners = existing["metadata"].get("ownerReferences") or []
        if not any(o.get("uid") == isvc.metadata.uid for o in owners):
            await self.client.merge_patch(path, {"metadata": {"ownerReferences": [*owners, owner_reference(isvc)]}})

    async def _apply(self, obj: dict[str, Any], events: list[Event]) -> dict[str, Any]:
        meta = obj["metadata"]
        before = await self.client.get(object_path(obj["kind"], meta["namespace"], meta["name"]))
        after = await self.client.apply(obj)
        what = f"{obj['kind']} {meta['name']}"
        if before is None:
            events.append(Event("Normal", "Created", f"created {what}"))
        elif before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            if before["metadata"].get("generation") != after["metadata"].get("generation"):
                events.append(Event("Normal", "Updated", f"updated {what} to match the spec"))
        return after

    async def _converge_router(self, isvc: InferenceService, children: dict[str, dict[str, Any]],
                               events: list[Event]) -> None:
        """With routing on, the router's RBAC, the engines' headless Service and the router Deployment;
        with it off, none of them (deleted if this InferenceService owns them)."""
        wanted = render_router_children(isvc, self.config)
        for obj in wanted:
            applied = await retry_on_conflict(lambda obj=obj: self._apply(obj, events), obj["kind"])
            children[f"Router{obj['kind']}" if obj["kind"] != "Service" else "EnginesService"] = applied
        if not wanted:
            name = router_name(isvc.name)
            for kind, child in (("Deployment", name), ("Service", engines_service_name(isvc.name)),
                                ("RoleBinding", name), ("Role", name), ("ServiceAccount", name)):
                await self._delete_owned(kind, isvc, events, child, "routing is disabled")

    async def _delete_owned(self, kind: str, isvc: InferenceService, events: list[Event], name: str | None = None,
                            why: str = "not needed at this replica count") -> None:
        name = name or isvc.name
        path = object_path(kind, isvc.namespace, name)
        existing = await self.client.get(path)
        owners = (existing or {}).get("metadata", {}).get("ownerReferences") or []
        if existing is not None and any(o.get("uid") == isvc.metadata.uid for o in owners):
            await self.client.delete(path)
            events.append(Event("Normal", "Deleted", f"deleted {kind} {name} ({why})"))


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
