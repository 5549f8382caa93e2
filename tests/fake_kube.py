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

The parts live in tests/kube_double/: `store` (objects, field managers, server-side apply, deletion and
garbage collection), `admission` (RBAC, CRD admission, Leases, subresource scope, owner references) and
`watch` (watch streams); this module serves them over HTTP. What it does not model is listed in
docs/operator.md ("What the API double does not model"). It runs no controllers: tests set a
Deployment's status themselves, as the Deployment controller would.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import threading
import time
import uuid
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch
import yaml
from aiohttp import web
from kube_double.admission import CHART, CRD_PATH, REPO, Admission, CustomResource, Rbac, Rule, _render_chart
from kube_double.store import FieldPath, Store, _render_path
from kube_double.watch import Watch, Watcher
from kube_double.wire import Key, _merge, _parse_selector, _selects, _status

# what tests import from here (test_op_status renders the chart through the cached `_render_chart`)
__all__ = [
    "CHART",
    "CRD_PATH",
    "REPO",
    "CustomResource",
    "FakeKube",
    "Key",
    "Rbac",
    "Request",
    "Rule",
    "_render_chart",
]

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


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any
    status: int = 0  # the code the fake answered
    query: dict[str, str] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)  # when the fake received it


# ---- the server ----------------------------------------------------------------------------------------
class FakeKube(Store, Admission, Watch):
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
        self._watchers: list[Watcher] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

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
            self._close_watches()
            await self._runner.cleanup()

        self._call(_stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

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
