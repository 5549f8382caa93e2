"""A fake Kubernetes API server over real HTTP, in a background thread, for the operator's handler tests.

It speaks the subset kopf and specfleet's client use: discovery, list, watch (chunked JSON lines), get,
create, merge/JSON/apply patches (also on /status), delete and events. It keeps generation and
resourceVersion like the real server, records every request, and can inject failures (e.g. a 409).
It runs no controllers: tests set a Deployment's status themselves, as the Deployment controller would.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import threading
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import yaml
from aiohttp import web

Key = tuple[str, str, str | None, str]  # (api prefix, plural, namespace, name)

DISCOVERY = {
    "/api/v1": [("services", "Service", True, ["status"]), ("secrets", "Secret", True, []),
                ("events", "Event", True, []), ("namespaces", "Namespace", False, []),
                ("pods", "Pod", True, ["status"])],
    "/apis/apps/v1": [("deployments", "Deployment", True, ["status", "scale"])],
    "/apis/policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True, ["status"])],
    "/apis/serving.specfleet.io/v1alpha1": [("inferenceservices", "InferenceService", True, ["status", "scale"])],
}
MONITORING = {"/apis/monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True, [])]}


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any


class FakeKube:
    def __init__(self, with_monitoring: bool = False) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.requests: list[Request] = []
        self.discovery = {**DISCOVERY, **(MONITORING if with_monitoring else {})}
        self._rv = itertools.count(1)
        self._failures: list[tuple[str, str, int]] = []
        self._watchers: list[tuple[str, str, str | None, asyncio.Queue[dict[str, Any] | None]]] = []
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
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
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

    # ---- test helpers (thread-safe) --------------------------------------------------------------
    def get(self, prefix: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        async def _get() -> dict[str, Any] | None:
            return copy.deepcopy(self.objects.get((prefix, plural, namespace, name)))
        return self._call(_get())

    def put(self, prefix: str, plural: str, namespace: str | None, obj: dict[str, Any]) -> dict[str, Any]:
        async def _put() -> dict[str, Any]:
            return self._store((prefix, plural, namespace, obj["metadata"]["name"]), copy.deepcopy(obj))
        return self._call(_put())

    def remove(self, prefix: str, plural: str, namespace: str, name: str) -> None:
        async def _remove() -> None:
            self._delete((prefix, plural, namespace, name))
        self._call(_remove())

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        """A kubeconfig pointing at this server, with `namespace` as the context's default."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "test-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
        }))
        return path

    def add_namespace(self, name: str) -> None:
        self.put("/api/v1", "namespaces", None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def fail_next(self, method: str, path_contains: str, status: int) -> None:
        self._failures.append((method, path_contains, status))

    # ---- storage -------------------------------------------------------------------------------------
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
            if obj == old:
                return obj
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            changed = {k: v for k, v in obj.items() if k not in ("metadata", "status")} != {
                k: v for k, v in old.items() if k not in ("metadata", "status")}
            meta["generation"] = old["metadata"].get("generation", 1) + (1 if changed else 0)
        meta["resourceVersion"] = str(next(self._rv))
        self.objects[key] = obj
        self._notify(key, kind_event or ("ADDED" if old is None else "MODIFIED"), obj)
        return obj

    def _delete(self, key: Key) -> dict[str, Any] | None:
        obj = self.objects.pop(key, None)
        if obj is not None:
            self._notify(key, "DELETED", obj)
        return obj

    def _notify(self, key: Key, kind: str, obj: dict[str, Any]) -> None:
        for prefix, plural, namespace, queue in self._watchers:
            if (prefix, plural) == key[:2] and namespace in (None, key[2]):
                queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})

    # ---- HTTP ------------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.text() or "null")
        self.requests.append(Request(request.method, request.path, request.content_type, body))
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
        if not any(plural == r[0] for r in self.discovery.get(prefix, [])):
            return _status(404, f"the server could not find the requested resource {path}")
        key: Key = (prefix, plural, namespace, name or "")
        if name is None:
            if request.method == "GET" and request.query.get("watch") == "true":
                return await self._watch(request, prefix, plural, namespace)
            if request.method == "GET":
                items = [copy.deepcopy(o) for k, o in self.objects.items()
                         if k[:2] == (prefix, plural) and namespace in (None, k[2])]
                return web.json_response({"items": items, "metadata": {"resourceVersion": str(next(self._rv))}})
            if request.method == "POST":
                meta = body.setdefault("metadata", {})
                meta.setdefault("name", meta.get("generateName", "obj-") + uuid.uuid4().hex[:5])
                key = (prefix, plural, namespace, meta["name"])
                if key in self.objects:
                    return _status(409, f"{plural} {key[3]!r} already exists", "AlreadyExists")
                return web.json_response(self._store(key, copy.deepcopy(body)), status=201)
        existing = self.objects.get(key)
        if request.method == "GET":
            return web.json_response(existing) if existing else _status(404, f"{plural} {name!r} not found")
        if request.method == "DELETE":
            return web.json_response(self._delete(key) or {}) if existing else _status(404, "not found")
        if request.method == "PATCH":
            return self._patch(request.content_type, key, existing, body, sub)
        return _status(405, f"{request.method} not supported by the fake")

    def _patch(self, ctype: str, key: Key, existing: dict[str, Any] | None, body: Any, sub: str | None) -> web.Response:
        if "apply-patch" in ctype:
            if existing is None:
                return web.json_response(self._store(key, copy.deepcopy(body)), status=201)
            new = copy.deepcopy(existing)
            for field, value in body.get("metadata", {}).items():
                if field in ("labels", "annotations"):
                    new["metadata"].setdefault(field, {}).update(value)
                elif field == "ownerReferences":
                    new["metadata"][field] = value
            new.update({k: copy.deepcopy(v) for k, v in body.items() if k not in ("metadata", "status")})
            return web.json_response(self._store(key, new))
        if existing is None:
            return _status(404, f"{key[1]} {key[3]!r} not found")
        if "json-patch" in ctype:
            try:
                new = jsonpatch.apply_patch(existing, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                return _status(422, str(error))
        else:
            new = _merge(copy.deepcopy(existing), body)
        if sub == "status":  # the status subresource writes only status
            new = {**copy.deepcopy(existing), "status": new.get("status", {})}
        elif "status" in existing or "status" in new:  # ... and the main resource never writes status
            new["status"] = copy.deepcopy(existing.get("status", {}))
            if not new["status"]:
                new.pop("status")
        return web.json_response(self._store(key, new))

    async def _watch(self, request: web.Request, prefix: str, plural: str, namespace: str | None) -> web.StreamResponse:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        since = int(request.query.get("resourceVersion", "0") or 0)
        for k, obj in self.objects.items():
            if k[:2] == (prefix, plural) and namespace in (None, k[2]) and int(obj["metadata"]["resourceVersion"]) > since:
                queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        entry = (prefix, plural, namespace, queue)
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
            resources.append({"name": plural, "singularName": kind.lower(), "kind": kind,
                              "namespaced": namespaced, "verbs": ["get", "list", "watch", "create", "patch"]})
            resources += [{"name": f"{plural}/{s}", "singularName": "", "kind": kind, "namespaced": namespaced,
                           "verbs": ["get", "patch"]} for s in subs]
        return {"kind": "APIResourceList", "resources": resources}


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


def _status(code: int, message: str, reason: str = "") -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                              "reason": reason or web.HTTPException.__name__, "code": code}, status=code)
