"""What the operator keeps per InferenceService for its whole lifetime, and the one API client it shares.

kopf gives every object its own memo, a shallow copy of the operator-wide one: a lock or a client put on
an InferenceService's memo is not the one a handler for its Deployment sees. So the startup handler puts
one `Registry` on the operator-wide memo, and every copy holds that same instance: one client session, and
per InferenceService (by uid) one `ServiceMemory` with one lock, forgotten on its DELETED event.

The memory is a cache in the controller-runtime sense: what the reconcile last applied (a digest of the
rendered child and the server's answer) and what the watches reported since. A reconcile that renders
what it applied before, onto children the watches saw unchanged, writes nothing. Every kind of child but
the admin Secret is watched (handlers.py): a deletion, or an edit of a field the operator renders, forgets the apply so the
next reconcile (started by that event) applies it again; every child is also re-applied once
`resync_seconds` have passed, one per pass (`Reconciler`), in case a watch event was missed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .kube import KubeClient

ChildKey = tuple[str, str]  # (kind, name)
# Deleted uids remembered so that a reconcile racing the deletion does not bring a memory back; a uid is
# never reused, and 1024 covers any burst of deletions a reconcile can overlap (one pass takes < 1 s).
FORGOTTEN_UIDS = 1024


def digest(obj: dict[str, Any]) -> str:
    """The rendered child's identity: equal digests, equal applied configurations."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def newer(candidate: dict[str, Any], than: dict[str, Any] | None) -> bool:
    """Whether `candidate` is a later version of the same object. Kubernetes calls resourceVersion opaque,
    but every etcd-backed API server (and the API double) issues increasing integers (etcd's revision);
    a version that is not one counts as newer, the latest arrival winning as in a plain watch."""
    if than is None:
        return True
    try:
        return int(candidate["metadata"]["resourceVersion"]) >= int(than["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return True


def owned_part(obj: Any, shape: Any) -> Any:
    """The part of `obj` at the paths `shape` (a rendered child) sets: what the operator owns of it. Fields
    others add (an annotation, managedFields, resourceVersion, server defaults beside the rendered ones)
    are left out; a list is taken whole, except that its items are cut to the rendered items' shape when
    both lists are equally long (a Service's ports gain a defaulted protocol)."""
    if isinstance(shape, dict):
        if not isinstance(obj, dict):
            return obj
        return {k: owned_part(obj.get(k), v) for k, v in shape.items()}
    if isinstance(shape, list) and isinstance(obj, list) and len(obj) == len(shape):
        return [owned_part(o, s) for o, s in zip(obj, shape, strict=True)]
    return obj


def owned_shape(rendered: dict[str, Any]) -> dict[str, Any]:
    """What of a rendered child the watch compares: everything it renders but status, and of its metadata
    the labels, annotations and owner references (not its name, resourceVersion or managedFields)."""
    meta = rendered.get("metadata") or {}
    shape = {k: v for k, v in rendered.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    shape["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    return shape


def _watched_part(obj: dict[str, Any] | None) -> tuple[Any, ...]:
    """What a reconcile reads from a workload: its status, its generation (moved by anyone's spec edit)
    and whether it is being deleted."""
    if obj is None:
        return (None,)
    meta = obj.get("metadata") or {}
    return (obj.get("status"), meta.get("generation"), meta.get("deletionTimestamp"))


@dataclass
class Applied:
    digest: str
    generation: int | None  # metadata.generation in the server's answer to the apply
    at: float  # monotonic seconds
    # the answer's fields the operator renders (`owned_part`): a watch event that differs here is an edit
    # to undo; None for workloads, whose watch compares status and generation instead (`observe`)
    owned: Any = None


@dataclass
class ServiceMemory:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    applied: dict[ChildKey, Applied] = field(default_factory=dict)
    objects: dict[ChildKey, dict[str, Any]] = field(default_factory=dict)  # apply answers, watch events
    # children checked and found not ours to delete (absent, or someone else's); cleared when the spec's
    # generation moves, since only a spec change makes the reconcile delete a shape it applied before
    absent: set[ChildKey] = field(default_factory=set)
    generation: int | None = None
    isvc: dict[str, Any] | None = None  # the newest InferenceService body seen (watch, kopf, status answer)
    written: tuple[frozenset[str], frozenset[str]] | None = None  # status keys and condition types written
    apis: dict[str, tuple[bool, float]] = field(default_factory=dict)  # API group version -> served, when
    # the tuned ConfigMap (the tuner writes it, the reconcile only restores it): its last data seen by the
    # watch, and whether it was deleted since while the service still has autotune on
    tuned: dict[str, str] | None = None
    tuned_deleted: bool = False

    def saw_generation(self, generation: int) -> None:
        if generation != self.generation:
            self.absent.clear()
            self.generation = generation

    def state(self, key: ChildKey, rendered: str, now: float, resync_seconds: float) -> str:
        """`changed` (apply it), `stale` (unchanged, but older than the resync period) or `current`."""
        last = self.applied.get(key)
        obj = self.objects.get(key)
        if last is None or obj is None or last.digest != rendered:
            return "changed"
        if (obj.get("metadata") or {}).get("generation") != last.generation:
            return "changed"  # the watch saw someone else edit it
        return "current" if now - last.at < resync_seconds else "stale"

    def record(
        self, key: ChildKey, rendered: str, answer: dict[str, Any], now: float, shape: Any = None
    ) -> None:
        """An apply's answer; `shape` (`owned_shape` of the rendered child) is what its watch compares."""
        owned = None if shape is None else owned_part(answer, shape)
        self.applied[key] = Applied(rendered, (answer.get("metadata") or {}).get("generation"), now, owned)
        self.objects[key] = answer
        self.absent.discard(key)

    def gone(self, key: ChildKey) -> None:
        self.applied.pop(key, None)
        self.objects.pop(key, None)
        self.absent.add(key)

    def observe(self, key: ChildKey, obj: dict[str, Any], deleted: bool) -> bool:
        """A watch event of an owned workload; True when it changed what a reconcile reads from it."""
        before = self.objects.get(key)
        if deleted:
            self.applied.pop(key, None)
            return self.objects.pop(key, None) is not None
        if not newer(obj, before):
            return False  # an event older than the apply answer already recorded
        self.objects[key] = obj
        return _watched_part(obj) != _watched_part(before)

    def observe_child(self, key: ChildKey, obj: dict[str, Any], deleted: bool) -> bool:
        """A watch event of a child other than a workload; True when the operator must apply it again: it
        was deleted, or a field the operator rendered differs from the answer to its last apply. Other
        changes (an annotation another tool adds, the echo of the operator's own apply) change nothing."""
        last = self.applied.get(key)
        if last is None:
            return False  # not applied by this operator (yet), or deleted by the reconcile itself
        if deleted:
            self.applied.pop(key, None)
            self.objects.pop(key, None)
            return True
        if not newer(obj, self.objects.get(key)) or last.owned is None:
            return False
        self.objects[key] = obj
        if owned_part(obj, last.owned) == last.owned:
            return False
        self.applied.pop(key, None)  # applied again by the reconcile this event starts
        return True

    def observe_tuned(self, obj: dict[str, Any], deleted: bool) -> bool:
        """A watch event of the tuned ConfigMap; True when it was deleted while its data is known (the
        reconcile restores it, if autotune is still on)."""
        if deleted:
            self.tuned_deleted = self.tuned is not None
            return self.tuned_deleted
        self.tuned = dict(obj.get("data") or {})
        self.tuned_deleted = False
        return False

    def see(self, body: dict[str, Any]) -> dict[str, Any]:
        """Keep the newest InferenceService body; returns it."""
        if newer(body, self.isvc):
            self.isvc = body
        assert self.isvc is not None
        return self.isvc

    def status_changed(self, previous: dict[str, Any], status: dict[str, Any]) -> bool:
        """Whether writing `status` (the reconcile's share) would change the object: a value differs, or
        a key or condition it wrote last time is missing now (server-side apply would remove it), or
        nothing was written since the operator started. lastTransitionTime moves only with its condition's
        status, so equal conditions compare equal."""
        conditions = status.get("conditions") or []
        shape = (frozenset(status), frozenset(c["type"] for c in conditions))
        if shape != self.written:
            return True
        before = {c.get("type"): c for c in previous.get("conditions") or []}
        if any(before.get(c["type"]) != c for c in conditions):
            return True
        return any(previous.get(k) != v for k, v in status.items() if k != "conditions")

    def wrote(self, status: dict[str, Any]) -> None:
        conditions = status.get("conditions") or []
        self.written = (frozenset(status), frozenset(c["type"] for c in conditions))


class Registry:
    """The operator-wide state: one API client, one `ServiceMemory` per InferenceService uid."""

    def __init__(self, client: KubeClient | None = None) -> None:
        self.client = client
        self.apis: dict[str, tuple[bool, float]] = {}  # discovery is cluster-wide: one cache for all
        self._services: dict[str, ServiceMemory] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()

    def service(self, uid: str) -> ServiceMemory | None:
        """The memory of a live InferenceService (made on first use); None once it was deleted."""
        if uid in self._forgotten:
            return None
        memory = self._services.get(uid)
        if memory is None:
            memory = self._services[uid] = ServiceMemory(apis=self.apis)
        return memory

    def known(self, uid: str) -> ServiceMemory | None:
        return self._services.get(uid)

    def forget(self, uid: str) -> None:
        self._services.pop(uid, None)
        self._forgotten[uid] = None
        while len(self._forgotten) > FORGOTTEN_UIDS:
            self._forgotten.popitem(last=False)

    def memories(self) -> list[ServiceMemory]:
        return list(self._services.values())

    def __len__(self) -> int:
        return len(self._services)
