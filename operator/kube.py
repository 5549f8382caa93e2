"""A small async Kubernetes REST client for the children the reconcile converges.

kopf talks to the API for the InferenceService itself (watching, status patches, events); this client
does the rest over the same credentials (`kopf.ConnectionInfo`): GET, create, server-side apply, delete.
"""

from __future__ import annotations

import json
import ssl
from typing import Any

import aiohttp

from .resources import API_VERSION, FIELD_MANAGER, KIND, PLURAL

# kind -> (apiVersion, plural) for every kind the operator writes.
KINDS: dict[str, tuple[str, str]] = {
    "Deployment": ("apps/v1", "deployments"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "Service": ("v1", "services"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "Secret": ("v1", "secrets"),
    "ConfigMap": ("v1", "configmaps"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "ServiceMonitor": ("monitoring.coreos.com/v1", "servicemonitors"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    # routing.mode endpoint-picker (render/inference_pool.py)
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
    KIND: (API_VERSION, PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        try:
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{method} {path} answered {status}: {message}")
        self.status = status
        self.message = message

    @property
    def retryable(self) -> bool:
        """Conflicts, throttling and server-side trouble pass; a 4xx about our request will not."""
        return self.status in (409, 429) or self.status >= 500


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    api_version, plural = KINDS[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class KubeClient:
    def __init__(
        self,
        server: str,
        *,
        headers: dict[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        self.server = server.rstrip("/")
        self._headers = dict(headers or {})
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection_info(cls, info: Any) -> KubeClient:
        """From the `kopf.ConnectionInfo` kopf's login produced: same server, credentials and CA."""
        context = info.as_ssl_context() if info.server.startswith("https") else None
        return cls(info.server, headers=info.as_http_headers(), ssl_context=context)

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._session.request(
            method, self.server + path, data=data, headers=headers, params=params, ssl=self._ssl
        ) as response:
            text = await response.text()
            if response.status >= 400:
                if response.status == 404:
                    return 404, None
                raise ApiError(response.status, method, path, text)
            return response.status, json.loads(text) if text else None

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        return (await self._request("GET", path))[1]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        status, created = await self._request("POST", object_path(obj["kind"], meta["namespace"]), obj)
        if status == 404:
            raise ApiError(
                404, "POST", object_path(obj["kind"], meta["namespace"]), "namespace or kind not found"
            )
        return created

    async def apply(self, obj: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply: converge the fields we render, keep fields others own, force on conflict."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        params = {"fieldManager": manager, "force": "true"}
        _, applied = await self._request("PATCH", path, obj, "application/apply-patch+yaml", params)
        return applied

    async def apply_status(
        self, namespace: str, name: str, status: dict[str, Any], manager: str
    ) -> dict[str, Any] | None:
        """Server-side apply of an InferenceService's status subresource as `manager`: the fields it sends are
        its own (a condition is one entry of the conditions map, keyed by type), fields it sent before and
        omits now are removed, and other managers' fields are left alone. None when the object is gone."""
        body = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": _without_nulls(status),
        }
        params = {"fieldManager": manager, "force": "true"}
        path = object_path(KIND, namespace, name) + "/status"
        return (await self._request("PATCH", path, body, "application/apply-patch+yaml", params))[1]

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        return (await self._request("PATCH", path, patch, "application/merge-patch+json"))[1]

    async def delete(self, path: str) -> bool:
        """True if something was deleted, False if it was already gone."""
        status, _ = await self._request("DELETE", path, {"propagationPolicy": "Background"})
        return status != 404

    async def has_api(self, group_version: str) -> bool:
        """Whether the cluster serves an API group version (e.g. monitoring.coreos.com/v1)."""
        return await self.get(f"/apis/{group_version}") is not None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _without_nulls(value: Any) -> Any:
    """An applied configuration lists only the fields its manager sets: a None (no value known, e.g. an
    observation missing this interval) is left out, so the field is not owned and not kept."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
