"""A fake Kubernetes API server over real HTTP, in a background thread, for the operator's handler tests.

It speaks the subset kopf and specfleet's client use (discovery, list and watch with label selectors,
get, create, update, merge/JSON/apply patches, the status and scale subresources, delete, events) and
enforces the API server semantics the operator depends on:

- RBAC: with `rbac=` (e.g. `Rbac.from_chart()`, the Helm chart's own Roles rendered by Helm's engine)
  every resource request is authorized by verb, API group, resource[/subresource] and namespace; a
  missing rule is a 403, as the real server answers. Setting a `blockOwnerDeletion` owner reference needs
  `update` on the owner's `finalizers` subresource (the OwnerReferencesPermissionEnforcement plugin).
- Subresources: a write to `/status` changes only `status`, a write to the object never changes `status`;
  `/scale` reads and writes `spec.replicas`. `metadata.generation` moves only when something outside
  `metadata` and `status` changes.
- Custom resources go through the CRD's structural schema on every write: defaulting, pruning of unknown
  fields, schema validation and the CEL rules (422 with the rule's message). A `/status` write is checked
  on `status` only (unchanged spec ratchets, as on Kubernetes >= 1.30).
- JSON merge patch replaces lists; server-side apply tracks which field manager owns which field, merges
  `x-kubernetes-list-type: map` lists (the CRD's `status.conditions`, by `type`) and `ownerReferences`
  (by uid) item by item, removes fields a manager stops applying when no one else owns them, and answers
  409 on a conflicting field unless `force=true` (which takes the field over).
- Leases (coordination.k8s.io/v1, leader election): an update must carry the resourceVersion it read (none:
  422, a stale one: 409), MicroTime fields decode strictly (400) and the spec's numbers are validated (422).
- Deletion: an object with finalizers gets `deletionTimestamp` and stays until the last finalizer goes;
  no finalizer may be added to it meanwhile. Deleting an object garbage-collects, at once, every object
  whose owner references all point to deleted objects.

What it does not model is listed in docs/operator.md ("What the API double does not model"). It runs no
controllers: tests set a Deployment's status themselves, as the Deployment controller would.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import functools
import itertools
import json
import re
import threading
import uuid
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch
import yaml
from aiohttp import web
from kube_admission import apply_defaults, cel_errors, list_map_keys, prune, schema_errors

REPO = Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "inferenceservice.yaml"
CHART = REPO / "charts" / "specfleet"

Key = tuple[str, str, str | None, str]  # (api prefix, plural, namespace, name)
Seg = str | tuple[str, str, Any]  # a field name, or ("k", key field, key value) for an item of a list-map
FieldPath = tuple[Seg, ...]

DISCOVERY = {
    "/api/v1": [
        ("services", "Service", True, ["status"]),
        ("secrets", "Secret", True, []),
        ("configmaps", "ConfigMap", True, []),
        ("serviceaccounts", "ServiceAccount", True, []),
        ("events", "Event", True, []),
        ("namespaces", "Namespace", False, ["status"]),
        ("pods", "Pod", True, ["status"]),
    ],
    "/apis/apps/v1": [("deployments", "Deployment", True, ["status", "scale"])],
    "/apis/policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True, ["status"])],
    "/apis/networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True, [])],
    "/apis/discovery.k8s.io/v1": [("endpointslices", "EndpointSlice", True, [])],
    "/apis/coordination.k8s.io/v1": [("leases", "Lease", True, [])],
    "/apis/rbac.authorization.k8s.io/v1": [
        ("roles", "Role", True, []),
        ("rolebindings", "RoleBinding", True, []),
    ],
    "/apis/serving.specfleet.io/v1alpha1": [
        ("inferenceservices", "InferenceService", True, ["status", "scale"])
    ],
}
MONITORING = {"/apis/monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True, [])]}
ALL_VERBS = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
_MISSING = object()


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any
    status: int = 0  # the code the fake answered
    query: dict[str, str] = field(default_factory=dict)


# ---- RBAC ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    api_groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]

    def allows(self, verb: str, group: str, resource: str) -> bool:
        return (
            (group in self.api_groups or "*" in self.api_groups)
            and (resource in self.resources or "*" in self.resources)
            and (verb in self.verbs or "*" in self.verbs)
        )


class Rbac:
    """The rules bound to one ServiceAccount: ClusterRoles everywhere, Roles in their namespace."""

    def __init__(self, cluster: list[Rule], namespaced: dict[str, list[Rule]]) -> None:
        self.cluster = cluster
        self.namespaced = namespaced

    @classmethod
    def from_objects(cls, objects: Iterable[dict[str, Any]], account: str, account_namespace: str) -> Rbac:
        def rules(role: dict[str, Any]) -> list[Rule]:
            return [
                Rule(
                    frozenset(r.get("apiGroups", [])),
                    frozenset(r.get("resources", [])),
                    frozenset(r.get("verbs", [])),
                )
                for r in role.get("rules") or []
            ]

        objects = list(objects)
        roles = {
            (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
            for o in objects
            if o["kind"] in ("Role", "ClusterRole")
        }
        cluster: list[Rule] = []
        namespaced: dict[str, list[Rule]] = {}
        for binding in objects:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == account
                and s.get("namespace") == account_namespace
                for s in binding.get("subjects") or []
            ):
                continue
            ref = binding["roleRef"]
            namespace = binding["metadata"].get("namespace")
            role = roles.get((ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"]))
            if role is None:
                continue  # a binding to a role that does not exist grants nothing
            if binding["kind"] == "ClusterRoleBinding":
                cluster += rules(role)
            else:
                namespaced.setdefault(namespace, []).extend(rules(role))
        return cls(cluster, namespaced)

    @classmethod
    def from_chart(
        cls, values: dict[str, Any] | None = None, release: str = "sf", namespace: str = "specfleet-system"
    ) -> Rbac:
        """The operator's permissions as the Helm chart grants them, rendered by Helm's own engine."""
        objects = _render_chart(json.dumps(values or {}, sort_keys=True), release, namespace)
        (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        return cls.from_objects(objects, account, namespace)

    def allows(self, verb: str, group: str, resource: str, namespace: str | None) -> bool:
        rules = self.cluster + (self.namespaced.get(namespace, []) if namespace else [])
        return any(rule.allows(verb, group, resource) for rule in rules)


@functools.cache
def _render_chart(values_json: str, release: str, namespace: str) -> list[dict[str, Any]]:
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(
            values=json.loads(values_json), name=release, namespace=namespace, is_install=True
        )
    return [
        doc
        for name, text in rendered.items()
        if not name.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


# ---- custom resources ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CustomResource:
    """The parts of a CRD the API server applies on writes."""

    prefix: str
    plural: str
    kind: str
    schema: dict[str, Any]
    subresources: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: Path) -> CustomResource:
        # libyaml's loader where PyYAML has it: an upstream CRD is ~0.4 MB, 15 s for the pure-Python one
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (version,) = crd["spec"]["versions"]
        return cls(
            f"/apis/{crd['spec']['group']}/{version['name']}",
            crd["spec"]["names"]["plural"],
            crd["spec"]["names"]["kind"],
            version["schema"]["openAPIV3Schema"],
            tuple(sorted(version.get("subresources") or {})),
        )

    def admit(
        self, obj: dict[str, Any], only_status: bool, validate: bool = True
    ) -> tuple[dict[str, Any], list[str]]:
        """The object as stored (defaulted, pruned) and what is wrong with it."""
        obj = prune(self.schema, apply_defaults(self.schema, obj))
        if not validate:
            return obj, []
        if only_status:
            status_schema = self.schema["properties"]["status"]
            status = obj.get("status") or {}
            errors = [f"status.{e}" for e in schema_errors(status_schema, status)]
            return obj, errors or cel_errors(status_schema, status, "status")
        body = {k: v for k, v in obj.items() if k != "metadata"}
        schema = {
            **self.schema,
            "properties": {k: v for k, v in self.schema["properties"].items() if k != "metadata"},
        }
        errors = schema_errors(schema, body)
        return obj, errors or cel_errors(self.schema, obj)


# ---- field paths (server-side apply) ---------------------------------------------------------------------
def _names(path: FieldPath) -> tuple[str, ...]:
    return tuple(s for s in path if isinstance(s, str))


def flatten(value: Any, keys: dict[tuple[str, ...], str], path: FieldPath = ()) -> dict[FieldPath, Any]:
    """Leaf fields of an object; lists are atomic except list-maps, whose items are keyed."""
    if isinstance(value, dict) and value:
        out: dict[FieldPath, Any] = {}
        for name, child in value.items():
            out.update(flatten(child, keys, (*path, name)))
        return out
    if isinstance(value, list) and _names(path) in keys:
        key = keys[_names(path)]
        out = {}
        for item in value:
            out.update(flatten(item, keys, (*path, ("k", key, item.get(key)))))
        return out
    return {path: copy.deepcopy(value)}


def _item(items: list[Any], seg: tuple[str, str, Any]) -> dict[str, Any] | None:
    return next((item for item in items if isinstance(item, dict) and item.get(seg[1]) == seg[2]), None)


def set_at(obj: dict[str, Any], path: FieldPath, value: Any) -> None:
    node: Any = obj
    for index, seg in enumerate(path):
        last = index == len(path) - 1
        if isinstance(seg, tuple):  # node is a list-map
            item = _item(node, seg)
            if item is None:
                item = {seg[1]: seg[2]}
                node.append(item)
            node = item
            continue
        if last:
            node[seg] = copy.deepcopy(value)
            return
        container: type = list if isinstance(path[index + 1], tuple) else dict
        if not isinstance(node.get(seg), container):
            node[seg] = container()
        node = node[seg]


def del_at(obj: dict[str, Any], path: FieldPath) -> None:
    """Remove one leaf; removing a list-map item's key removes the item."""
    node: Any = obj
    parents: list[Any] = []
    for seg in path[:-1]:
        parents.append(node)
        node = (
            _item(node, seg)
            if isinstance(seg, tuple)
            else (node.get(seg) if isinstance(node, dict) else None)
        )
        if node is None:
            return
    last = path[-1]
    if len(path) >= 2 and isinstance(path[-2], tuple) and path[-2][1] == last:
        parents[-1][:] = [item for item in parents[-1] if item is not node]
    elif isinstance(last, tuple):
        node[:] = [item for item in node if item is not _item(node, last)]
    elif isinstance(node, dict):
        node.pop(last, None)
        # a map left empty by the removal goes too (its manager owned it only through these fields)
        for parent, seg in zip(reversed(parents), reversed(path[:-1]), strict=False):
            if isinstance(seg, str) and isinstance(parent, dict) and parent.get(seg) == {}:
                parent.pop(seg)
            else:
                break


def _render_path(path: FieldPath) -> str:
    return "".join(f"[{s[1]}={s[2]}]" if isinstance(s, tuple) else f".{s}" for s in path)


# ---- built-in kinds the double validates ------------------------------------------------------------
MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")


def _admit_any(method: str, key: Key, new: dict[str, Any]) -> web.Response | None:
    return None


def _admit_lease(method: str, key: Key, new: dict[str, Any]) -> web.Response | None:
    """A coordination.k8s.io/v1 Lease as the API server takes it: updates must carry the resourceVersion
    they read (the Lease strategy allows no unconditional update, so a stale one is a 409), MicroTime
    fields have exactly six fractional digits (anything else fails to decode: 400), and the spec's
    numbers are validated (422)."""
    name = f'Lease.coordination.k8s.io "{key[3]}"'
    if method == "PUT" and not (new.get("metadata") or {}).get("resourceVersion"):
        return _status(
            422,
            f"{name} is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
            "Invalid",
        )
    spec = new.get("spec") or {}
    for field_name in ("acquireTime", "renewTime"):
        value = spec.get(field_name)
        if value is not None and not (isinstance(value, str) and MICRO_TIME.fullmatch(value)):
            return _status(
                400,
                f'Lease in version "v1" cannot be handled as a Lease: spec.{field_name}: parsing time '
                f'{json.dumps(value)} as "2006-01-02T15:04:05.000000Z07:00": cannot parse',
                "BadRequest",
            )
    errors = []
    duration, transitions = spec.get("leaseDurationSeconds"), spec.get("leaseTransitions")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        errors.append(f"spec.leaseDurationSeconds: Invalid value: {duration}: must be greater than 0")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        errors.append(
            f"spec.leaseTransitions: Invalid value: {transitions}: must be greater than or equal to 0"
        )
    if spec.get("holderIdentity") is not None and not isinstance(spec["holderIdentity"], str):
        errors.append(f"spec.holderIdentity: Invalid value: {spec['holderIdentity']!r}: must be a string")
    if spec.get("preferredHolder") and not spec.get("strategy"):
        errors.append("spec.preferredHolder: Forbidden: may only be specified if `strategy` is defined")
    if errors:
        return _status(422, f"{name} is invalid: " + "; ".join(errors), "Invalid")
    return None


BUILTIN_ADMISSION = {("/apis/coordination.k8s.io/v1", "leases"): _admit_lease}


# ---- the server ----------------------------------------------------------------------------------------
class FakeKube:
    def __init__(
        self,
        with_monitoring: bool = False,
        rbac: Rbac | None = None,
        crds: Iterable[Path] = (CRD_PATH,),
        owner_reference_enforcement: bool = True,
    ) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.requests: list[Request] = []
        self.discovery = {**DISCOVERY, **(MONITORING if with_monitoring else {})}
        self.rbac = rbac
        self.owner_reference_enforcement = owner_reference_enforcement
        self.crds = {(c.prefix, c.plural): c for c in map(CustomResource.load, crds)}
        for (
            crd
        ) in self.crds.values():  # an installed CRD is a served API (an upstream one, e.g. LeaderWorkerSet)
            if crd.prefix not in self.discovery:
                self.discovery[crd.prefix] = [(crd.plural, crd.kind, True, list(crd.subresources))]
        self.managers: dict[Key, dict[str, set[FieldPath]]] = {}  # object -> field manager -> fields it owns
        self._rv = itertools.count(1)
        self._failures: list[tuple[str, str, int]] = []
        self._watchers: list[
            tuple[str, str, str | None, dict[str, str], asyncio.Queue[dict[str, Any] | None]]
        ] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> FakeKube:
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        async def _stop() -> None:
            for *_, queue in self._watchers:
                queue.put_nowait(None)
            await self._runner.cleanup()

        self._call(_stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    # ---- test helpers (thread-safe; they act as a privileged user or a controller, no RBAC) -----------
    def get(self, prefix: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        async def _get() -> dict[str, Any] | None:
            return copy.deepcopy(self.objects.get((prefix, plural, namespace, name)))

        return self._call(_get())

    def put(
        self, prefix: str, plural: str, namespace: str | None, obj: dict[str, Any], admit: bool = True
    ) -> dict[str, Any]:
        """Create or replace an object whole, status included (as `kubectl apply` plus a controller would).
        A custom resource is defaulted and pruned, and validated unless `admit=False` (an older CRD)."""

        async def _put() -> dict[str, Any]:
            key = (prefix, plural, namespace, obj["metadata"]["name"])
            new = copy.deepcopy(obj)
            crd = self.crds.get((prefix, plural))
            if crd is not None:  # defaulting and pruning always happen; validation only with `admit`
                new, errors = crd.admit(new, only_status=False, validate=admit)
                if errors:
                    raise AssertionError(f"the API server would refuse {plural}/{key[3]}: {errors}")
            self._own(key, "test", self.objects.get(key), new)
            return self._store(key, new)

        return self._call(_put())

    def remove(self, prefix: str, plural: str, namespace: str | None, name: str) -> None:
        """Delete as `kubectl delete` does: finalizers are honoured, owned objects garbage-collected."""

        async def _remove() -> None:
            self._delete((prefix, plural, namespace, name))

        self._call(_remove())

    def fields(self, prefix: str, plural: str, namespace: str | None, name: str) -> dict[str, list[str]]:
        """Field manager -> the fields it owns, as `.a.b[type=Ready].c` strings."""

        async def _fields() -> dict[str, list[str]]:
            owned = self.managers.get((prefix, plural, namespace, name), {})
            return {m: sorted(map(_render_path, ps)) for m, ps in owned.items() if ps}

        return self._call(_fields())

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        """A kubeconfig pointing at this server, with `namespace` as the context's default."""
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": "test-token"}}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                        }
                    ],
                }
            )
        )
        return path

    def add_namespace(self, name: str) -> None:
        self.put(
            "/api/v1",
            "namespaces",
            None,
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )

    def fail_next(self, method: str, path_contains: str, status: int) -> None:
        self._failures.append((method, path_contains, status))

    def answered(self, status: int) -> list[Request]:
        return [r for r in self.requests if r.status == status]

    # ---- storage -------------------------------------------------------------------------------------
    def _has_sub(self, prefix: str, plural: str, sub: str) -> bool:
        return any(r[0] == plural and sub in r[3] for r in self.discovery.get(prefix, []))

    def _keys(self, key: Key) -> dict[tuple[str, ...], str]:
        crd = self.crds.get(key[:2])
        found = list_map_keys(crd.schema) if crd else {}
        return {**found, ("metadata", "ownerReferences"): "uid"}

    def _own(self, key: Key, manager: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        """A non-apply write: its manager takes the fields it changed; removed fields lose their owners."""
        keys = self._keys(key)
        before = flatten({k: v for k, v in (old or {}).items() if k != "metadata"}, keys)
        after = flatten({k: v for k, v in new.items() if k != "metadata"}, keys)
        owned = self.managers.setdefault(key, {})
        for path, value in after.items():
            if before.get(path, _MISSING) != value:
                for other in owned.values():
                    other.discard(path)
                owned.setdefault(manager, set()).add(path)
        for path in set(before) - set(after):
            for other in owned.values():
                other.discard(path)

    def _store(self, key: Key, obj: dict[str, Any], kind_event: str | None = None) -> dict[str, Any]:
        old = self.objects.get(key)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("name", key[3])
        if key[2] is not None:
            meta["namespace"] = key[2]
        if old is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            meta["generation"] = 1
        else:
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            if "deletionTimestamp" in old["metadata"]:
                meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
            meta["resourceVersion"] = old["metadata"].get("resourceVersion")
            changed = {k: v for k, v in obj.items() if k not in ("metadata", "status")} != {
                k: v for k, v in old.items() if k not in ("metadata", "status")
            }
            meta["generation"] = old["metadata"].get("generation", 1) + (1 if changed else 0)
            if obj == old:
                return obj  # a no-op write changes nothing, not even resourceVersion
        meta["resourceVersion"] = str(next(self._rv))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key] = obj
            self._delete(key)
            return obj
        self.objects[key] = obj
        self._notify(key, kind_event or ("ADDED" if old is None else "MODIFIED"), obj)
        return obj

    def _delete(self, key: Key) -> dict[str, Any] | None:
        obj = self.objects.get(key)
        if obj is None:
            return None
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                updated = copy.deepcopy(obj)
                updated["metadata"]["deletionTimestamp"] = _now()
                updated["metadata"]["deletionGracePeriodSeconds"] = 0
                updated["metadata"]["resourceVersion"] = str(next(self._rv))
                self.objects[key] = updated
                self._notify(key, "MODIFIED", updated)
            return self.objects[key]
        del self.objects[key]
        self.managers.pop(key, None)
        self._notify(key, "DELETED", obj)
        self._collect_garbage()
        return obj

    def _collect_garbage(self) -> None:
        """Delete every object whose owners are all gone (background propagation, done at once)."""
        alive = {o["metadata"]["uid"] for o in self.objects.values()}
        for key, obj in list(self.objects.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if owners and not any(o.get("uid") in alive for o in owners) and key in self.objects:
                if not obj["metadata"].get("deletionTimestamp"):
                    self._delete(key)

    def _notify(self, key: Key, kind: str, obj: dict[str, Any]) -> None:
        for prefix, plural, namespace, selector, queue in self._watchers:
            if (prefix, plural) == key[:2] and namespace in (None, key[2]) and _selects(selector, obj):
                queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})

    # ---- HTTP ------------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.text() or "null")
        record = Request(request.method, request.path, request.content_type, body, query=dict(request.query))
        self.requests.append(record)
        response = await self._answer(request, body)
        record.status = response.status
        return response

    async def _answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        for index, (method, fragment, status) in enumerate(self._failures):
            if method == request.method and fragment in request.path:
                del self._failures[index]
                return _status(status, f"injected failure {status}")
        path = request.path
        if path in ("/api", "/apis", "/version") or path in self.discovery:
            return web.json_response(self._discovery(path))
        parsed = _parse(path)
        if parsed is None:
            return _status(404, f"{path} not found")
        prefix, namespace, plural, name, sub = parsed
        verb = _verb(request, name)
        group = "" if prefix == "/api/v1" else prefix.split("/")[2]
        resource = f"{plural}/{sub}" if sub else plural
        if self.rbac is not None and not self.rbac.allows(verb, group, resource, namespace):
            where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            return _status(
                403,
                f"{resource}{'.' + group if group else ''} is forbidden: User "
                f'"system:serviceaccount:specfleet" cannot {verb} resource "{resource}" in API group '
                f'"{group}" {where}',
                "Forbidden",
            )
        if not any(plural == r[0] for r in self.discovery.get(prefix, [])):
            return _status(404, f"the server could not find the requested resource {path}")
        key: Key = (prefix, plural, namespace, name or "")
        if name is None:
            selector = _parse_selector(request.query.get("labelSelector", ""))
            if verb == "watch":
                return await self._watch(request, prefix, plural, namespace, selector)
            if verb == "list":
                items = [
                    copy.deepcopy(o)
                    for k, o in self.objects.items()
                    if k[:2] == (prefix, plural) and namespace in (None, k[2]) and _selects(selector, o)
                ]
                return web.json_response(
                    {"items": items, "metadata": {"resourceVersion": str(next(self._rv))}}
                )
            if verb == "create":
                meta = body.setdefault("metadata", {})
                meta.setdefault("name", meta.get("generateName", "obj-") + uuid.uuid4().hex[:5])
                key = (prefix, plural, namespace, meta["name"])
                if key in self.objects:
                    return _status(409, f"{plural} {key[3]!r} already exists", "AlreadyExists")
                new = copy.deepcopy(body)
                if self._has_sub(prefix, plural, "status"):
                    new.pop("status", None)  # the status subresource is the only way to write status
                return self._write(request, key, None, new, sub=None, created=True)
            return _status(405, f"{request.method} on a collection is not supported by the fake")
        existing = self.objects.get(key)
        if sub == "scale":
            return self._scale(request, key, existing, body)
        if request.method == "GET":
            return (
                web.json_response(existing)
                if existing
                else _status(404, f"{plural} {name!r} not found", "NotFound")
            )
        if request.method == "DELETE":
            if existing is None:
                return _status(404, f"{plural} {name!r} not found", "NotFound")
            return web.json_response(self._delete(key) or {})
        if request.method == "PATCH" and "apply-patch" in request.content_type:
            return self._apply(request, key, existing, body, sub)
        if existing is None:
            return _status(404, f"{plural} {name!r} not found", "NotFound")
        if request.method == "PUT":
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent and sent != existing["metadata"].get("resourceVersion"):
                return _status(
                    409, f"the object has been modified; resourceVersion {sent} is stale", "Conflict"
                )
            new = copy.deepcopy(body)
        elif request.method == "PATCH" and "json-patch" in request.content_type:
            try:
                new = jsonpatch.apply_patch(existing, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                return _status(422, str(error), "Invalid")
        elif request.method == "PATCH":
            new = _merge(copy.deepcopy(existing), body)  # JSON merge patch: lists are replaced whole
        else:
            return _status(405, f"{request.method} not supported by the fake")
        return self._write(request, key, existing, self._scoped(key, existing, new, sub), sub)

    def _scoped(
        self, key: Key, existing: dict[str, Any], new: dict[str, Any], sub: str | None
    ) -> dict[str, Any]:
        """Only status through /status; never status through the object (when it has the subresource)."""
        if not self._has_sub(key[0], key[1], "status"):
            return new
        if sub == "status":
            out = copy.deepcopy(existing)
            if "status" in new:
                out["status"] = new["status"]
            else:
                out.pop("status", None)
            return out
        new = copy.deepcopy(new)
        new.pop("status", None)
        if "status" in existing:
            new["status"] = copy.deepcopy(existing["status"])
        return new

    def _write(
        self,
        request: web.Request,
        key: Key,
        existing: dict[str, Any] | None,
        new: dict[str, Any],
        sub: str | None,
        created: bool = False,
        manager: str | None = None,
    ) -> web.Response:
        meta = new.setdefault("metadata", {})
        old_meta = (existing or {}).get("metadata", {})
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                return _status(
                    422,
                    f"{key[1]} {key[3]!r} is being deleted: no new finalizers can be added ({sorted(added)})",
                    "Invalid",
                )
        problem = self._owner_reference_problem(key, old_meta, meta)
        if problem:
            return _status(403, problem, "Forbidden")
        refused = BUILTIN_ADMISSION.get(key[:2], _admit_any)(request.method, key, new)
        if refused is not None:
            return refused
        crd = self.crds.get(key[:2])
        if crd is not None:
            # ratcheting (Kubernetes >= 1.30): a write that leaves an invalid spec as it was is not refused for it
            unchanged = (
                existing is not None
                and sub is None
                and crd.admit(copy.deepcopy(existing), False, False)[0].get("spec")
                == crd.admit(copy.deepcopy(new), False, False)[0].get("spec")
            )
            new, errors = crd.admit(new, only_status=sub == "status", validate=not unchanged)
            if errors:
                return _status(
                    422,
                    f'{crd.kind}.{key[0].split("/")[2]} "{key[3]}" is invalid: ' + "; ".join(errors),
                    "Invalid",
                )
        manager = (
            manager
            or request.query.get("fieldManager")
            or request.headers.get("User-Agent", "unknown").split("/")[0]
        )
        self._own(key, manager, existing, new)
        stored = self._store(key, new)
        return web.json_response(stored, status=201 if created else 200)

    def _owner_reference_problem(
        self, key: Key, old_meta: dict[str, Any], meta: dict[str, Any]
    ) -> str | None:
        """OwnerReferencesPermissionEnforcement: blocking an owner's deletion needs update on its finalizers."""
        if self.rbac is None or not self.owner_reference_enforcement:
            return None
        before = {o.get("uid") for o in old_meta.get("ownerReferences") or [] if o.get("blockOwnerDeletion")}
        for ref in meta.get("ownerReferences") or []:
            if not ref.get("blockOwnerDeletion") or ref.get("uid") in before:
                continue
            group = ref["apiVersion"].rpartition("/")[0]
            prefix = f"/apis/{ref['apiVersion']}" if group else "/api/v1"
            plural = next(
                (r[0] for r in self.discovery.get(prefix, []) if r[1] == ref["kind"]), ref["kind"].lower()
            )
            if not self.rbac.allows("update", group, f"{plural}/finalizers", key[2]):
                return (
                    f"{key[1]} {key[3]!r} is forbidden: cannot set blockOwnerDeletion if an ownerReference refers "
                    f'to a resource you can\'t set finalizers on: {plural}/finalizers in API group "{group}"'
                )
        return None

    def _apply(
        self,
        request: web.Request,
        key: Key,
        existing: dict[str, Any] | None,
        body: dict[str, Any],
        sub: str | None,
    ) -> web.Response:
        manager = request.query.get("fieldManager")
        if not manager:
            return _status(422, "PATCH with application/apply-patch+yaml requires fieldManager", "Invalid")
        force = request.query.get("force") == "true"
        if existing is None and sub is not None:
            return _status(404, f"{key[1]} {key[3]!r} not found", "NotFound")
        keys = self._keys(key)
        has_status = self._has_sub(key[0], key[1], "status")

        def in_scope(path: FieldPath) -> bool:
            if path[0] == "metadata":
                return len(path) > 1 and path[1] in ("labels", "annotations", "ownerReferences", "finalizers")
            if path[0] in ("apiVersion", "kind"):
                return False
            return (path[0] == "status") == (sub == "status") if has_status else True

        applied = {
            p: v for p, v in flatten(body, keys).items() if in_scope(p) and v is not None
        }  # null: not set
        if existing is None:
            new = {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "metadata": {"name": key[3]},
            }
            for path, value in applied.items():
                set_at(new, path, value)
            response = self._write(request, key, None, new, None, created=True, manager=manager)
            if response.status == 201:
                self.managers[key] = {manager: set(applied)}
            return response
        owned = self.managers.setdefault(key, {})
        current = flatten(existing, keys)
        conflicts = [
            (path, other)
            for path, value in applied.items()
            for other, paths in owned.items()
            if other != manager and path in paths and current.get(path, _MISSING) != value
        ]
        if conflicts and not force:
            listed = "; ".join(f'conflict with "{other}": {_render_path(path)}' for path, other in conflicts)
            return _status(409, f"Apply failed with {len(conflicts)} conflict(s): {listed}", "Conflict")
        new = copy.deepcopy(existing)
        mine = owned.get(manager, set())
        for path in sorted(mine - set(applied), key=len, reverse=True):
            if not any(path in paths for other, paths in owned.items() if other != manager):
                del_at(new, path)
        for path, value in applied.items():
            set_at(new, path, value)
        saved = {m: set(ps) for m, ps in owned.items()}
        response = self._write(request, key, existing, new, sub, manager=manager)
        if response.status >= 400:
            self.managers[key] = saved
            return response
        for path, other in conflicts:
            owned[other].discard(path)  # forced: the field changes hands
        owned[manager] = set(applied) | {p for p in owned.get(manager, set()) if not in_scope(p)}
        return response

    def _scale(
        self, request: web.Request, key: Key, existing: dict[str, Any] | None, body: Any
    ) -> web.Response:
        if existing is None or not self._has_sub(key[0], key[1], "scale"):
            return _status(404, f"{key[1]} {key[3]!r} not found", "NotFound")

        def scale(obj: dict[str, Any]) -> dict[str, Any]:
            return {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {
                    "name": key[3],
                    "namespace": key[2],
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                },
                "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
                "status": {
                    "replicas": (obj.get("status") or {}).get("replicas", 0),
                    "selector": (obj.get("status") or {}).get("selector", ""),
                },
            }

        if request.method == "GET":
            return web.json_response(scale(existing))
        wanted = _merge(scale(existing), body) if request.method == "PATCH" else body
        new = copy.deepcopy(existing)
        new.setdefault("spec", {})["replicas"] = wanted["spec"]["replicas"]
        response = self._write(request, key, existing, new, None)
        return (
            web.json_response(scale(self.objects[key]), status=response.status)
            if response.status < 400
            else response
        )

    async def _watch(
        self, request: web.Request, prefix: str, plural: str, namespace: str | None, selector: dict[str, str]
    ) -> web.StreamResponse:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        since = int(request.query.get("resourceVersion", "0") or 0)
        for k, obj in self.objects.items():
            if (
                k[:2] == (prefix, plural)
                and namespace in (None, k[2])
                and _selects(selector, obj)
                and int(obj["metadata"]["resourceVersion"]) > since
            ):
                queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        entry = (prefix, plural, namespace, selector, queue)
        self._watchers.append(entry)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            while (event := await queue.get()) is not None:
                await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(entry)
        return response

    def _discovery(self, path: str) -> dict[str, Any]:
        if path == "/version":
            return {"major": "1", "minor": "30", "gitVersion": "v1.30.0-fake"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            groups = []
            for prefix in self.discovery:
                if prefix.startswith("/apis/"):
                    group, version = prefix.split("/")[2:4]
                    gv = {"groupVersion": f"{group}/{version}", "version": version}
                    groups.append({"name": group, "versions": [gv], "preferredVersion": gv})
            return {"kind": "APIGroupList", "groups": groups}
        resources = []
        for plural, kind, namespaced, subs in self.discovery[path]:
            resources.append(
                {
                    "name": plural,
                    "singularName": kind.lower(),
                    "kind": kind,
                    "namespaced": namespaced,
                    "verbs": ALL_VERBS,
                }
            )
            resources += [
                {
                    "name": f"{plural}/{s}",
                    "singularName": "",
                    "kind": kind,
                    "namespaced": namespaced,
                    "verbs": ["get", "patch", "update"],
                }
                for s in subs
            ]
        return {"kind": "APIResourceList", "resources": resources}


def _verb(request: web.Request, name: str | None) -> str:
    if request.method == "GET":
        if name is not None:
            return "get"
        return "watch" if request.query.get("watch") in ("true", "1") else "list"
    if request.method == "DELETE":
        return "delete" if name is not None else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(request.method, request.method.lower())


def _parse_selector(text: str) -> dict[str, str]:
    """Equality selectors (`a=b,c==d`) and existence (`a`, value ``None``-like "")."""
    selector = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.replace("==", "=").partition("=")
        selector[name] = value if "=" in part else "\0exists"
    return selector


def _selects(selector: dict[str, str], obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(
        name in labels if value == "\0exists" else labels.get(name) == value
        for name, value in selector.items()
    )


def _parse(path: str) -> tuple[str, str | None, str, str | None, str | None] | None:
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) >= 2:
        prefix, rest = "/api/v1", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 3:
        prefix, rest = f"/apis/{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 2 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest:  # /api/v1/namespaces/NAME is the Namespace object itself
        return (prefix, None, "namespaces", namespace, None) if namespace else None
    return prefix, namespace, rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None


def _merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    target = target if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge(target.get(key), value)
    return target


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, message: str, reason: str = "") -> web.Response:
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "reason": reason or web.HTTPException.__name__,
            "code": code,
        },
        status=code,
    )
