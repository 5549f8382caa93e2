"""`spec.adapters` made true in the running engines, through their admin API, without a restart.

Level-based, as the reconcile: on each pass it reads, per ready engine pod, the adapters the engine
serves (`GET /v1/models`, the entries with a `parent`), loads each listed adapter the engine lacks or serves
from another folder (`POST /v1/load_lora_adapter` on the admin port, with the admin token) and unloads each
it serves that the spec no longer lists (`POST /v1/unload_lora_adapter`; the engine lets the requests in
flight finish first). A pod that starts (scale-up, restart) gets every adapter on the next pass.

It reports, under its own field manager, `status.adapters` (per pod: the adapters loaded, and those that
failed with the engine's message) and the `AdaptersReady` condition: False with reason AdapterLoadFailed
and the engine's 400 message when one was refused (a rank above lora.maxLoraRank, a folder for another base
model, a missing file...), which it retries on every pass until the spec or the folder is fixed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from .conditions import Cond, condition_entries
from .inference_service import InferenceService
from .kube import KubeClient, object_path
from .render.adapters import adapter_path
from .render.secret import read_admin_token
from .resources import ADMIN_PORT, ENGINE_PORT, LABEL_ISVC, admin_secret_name

ADAPTERS_FIELD_MANAGER = "specfleet-adapters"
CONDITION = "AdaptersReady"


@dataclass
class PodAdapters:
    pod: str
    loaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # adapter -> the engine's message
    error: str | None = None  # the engine could not be asked at all

    def as_status(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"pod": self.pod, "loaded": sorted(self.loaded)}
        if self.failed:
            entry["failed"] = [{"name": n, "message": m[:1024]} for n, m in sorted(self.failed.items())]
        if self.error:
            entry["error"] = self.error[:1024]
        return entry


@dataclass(frozen=True)
class EnginePod:
    name: str
    api: str  # http://IP:ENGINE_PORT
    admin: str  # http://IP:ADMIN_PORT


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text or f"HTTP {response.status_code}"


class AdapterSync:
    """Converges one engine's adapters to `wanted` (name -> folder in the pod) over `http`."""

    def __init__(self, http: httpx.AsyncClient, token: str) -> None:
        self.http, self.headers = http, {"Authorization": f"Bearer {token}"}

    async def served(self, pod: EnginePod) -> dict[str, str]:
        response = await self.http.get(f"{pod.api}/v1/models")
        response.raise_for_status()
        return {m["id"]: m.get("root", "") for m in response.json()["data"] if m.get("parent")}

    async def _post(self, pod: EnginePod, path: str, body: dict[str, str]) -> str | None:
        """None on success, else the engine's message."""
        response = await self.http.post(f"{pod.admin}{path}", json=body, headers=self.headers)
        return None if response.status_code == 200 else _message(response)

    async def converge(self, pod: EnginePod, wanted: dict[str, str]) -> PodAdapters:
        result = PodAdapters(pod.name)
        try:
            served = await self.served(pod)
            for name in sorted(set(served) - set(wanted)):
                error = await self._post(pod, "/v1/unload_lora_adapter", {"lora_name": name})
                if error is not None:
                    result.failed[name] = f"unload: {error}"
            for name, path in sorted(wanted.items()):
                if served.get(name) == path:
                    result.loaded.append(name)
                    continue
                error = await self._post(pod, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
                if error is None:
                    result.loaded.append(name)
                else:
                    result.failed[name] = error
        except (httpx.HTTPError, ValueError, KeyError) as error:
            result.error = f"{type(error).__name__}: {error}"
        return result


def adapters_condition(wanted: dict[str, str], pods: list[PodAdapters]) -> Cond:
    failures = [f"pod {p.pod}: adapter {n}: {m}" for p in pods for n, m in sorted(p.failed.items())]
    failures += [f"pod {p.pod}: {p.error}" for p in pods if p.error]
    if failures:
        return Cond(CONDITION, "False", "AdapterLoadFailed", "; ".join(failures))
    if not pods:
        return Cond(
            CONDITION, "Unknown", "NoReadyEngine", "no ready engine pod to load the adapters into yet"
        )
    return Cond(
        CONDITION, "True", "AdaptersLoaded", f"{len(wanted)} adapter(s) loaded on {len(pods)} ready pod(s)"
    )


async def ready_engine_pods(
    client: KubeClient,
    namespace: str,
    name: str,
    api: Callable[[str], str] = lambda ip: f"http://{ip}:{ENGINE_PORT}",
    admin: Callable[[str], str] = lambda ip: f"http://{ip}:{ADMIN_PORT}",
) -> list[EnginePod]:
    """The service's engine pods whose Ready condition is True, by name."""
    selector = quote(f"{LABEL_ISVC}={name}")
    listing = await client.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}") or {}
    pods = []
    for pod in listing.get("items", []):
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        ip = status.get("podIP")
        if ready and ip and not pod["metadata"].get("deletionTimestamp"):
            pods.append(EnginePod(pod["metadata"]["name"], api(ip), admin(ip)))
    return sorted(pods, key=lambda p: p.name)


async def sync_adapters(
    client: KubeClient,
    http: httpx.AsyncClient,
    isvc: InferenceService,
    previous: dict[str, Any],
    now: str,
    pods: list[EnginePod],
) -> dict[str, Any] | None:
    """Converge every ready pod's adapters; the status share to apply (None: the admin Secret is not there
    yet, the reconcile creates it)."""
    secret = await client.get(object_path("Secret", isvc.namespace, admin_secret_name(isvc.name)))
    if secret is None:
        return None
    wanted = {a.name: adapter_path(a) for a in isvc.spec.adapters}
    sync = AdapterSync(http, read_admin_token(secret))
    results = list(await asyncio.gather(*(sync.converge(p, wanted) for p in pods)))
    cond = adapters_condition(wanted, results)
    generation = isvc.metadata.generation
    return {
        "adapters": [r.as_status() for r in results],
        "conditions": condition_entries(previous.get("conditions") or [], [cond], generation, now),
    }
