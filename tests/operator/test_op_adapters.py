"""spec.adapters: the pod renders the LoRA flags and the adapters' volumes, and the adapter sync loads and
unloads them in running engines through the admin API, reporting status.adapters and AdaptersReady, against
the Kubernetes API double (with the chart's RBAC). The engines are doubles of the server's LoRA protocol
(docs/server.md: /v1/models with `parent`, load and unload on the admin port with the token); the server
side is tested with real engines in tests/server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fake_kube import FakeKube
from specfleet.operator.adapters import ADAPTERS_FIELD_MANAGER, ready_engine_pods, sync_adapters
from specfleet.operator.inference_service import parse_inference_service
from specfleet.operator.kube import KubeClient
from specfleet.operator.render import read_admin_token
from specfleet.operator.resources import LABEL_ISVC
from test_op_reconcile import DEPLOY, ISVC, NS, SECRET, create_isvc, reconcile, update_spec

ADAPTERS = [
    {"name": "sql", "source": "pvc://adapters/sql", "rank": 16},
    {"name": "chat", "source": "file:///opt/adapters/chat"},
]
REFUSED = "adapter_model.safetensors: rank 128 is above --max-lora-rank 64"


class EngineDouble:
    """One engine's LoRA routes, as engine/server/lora_api.py answers them."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.served: dict[str, str] = {}
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        if path == "/v1/models":
            data = [
                {"id": "smollm2"},
                *({"id": n, "parent": "smollm2", "root": p} for n, p in self.served.items()),
            ]
            return httpx.Response(200, json={"object": "list", "data": data})
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return httpx.Response(401, json={"error": {"message": "admin token"}})
        body = json.loads(request.content)
        if path == "/v1/load_lora_adapter":
            if "broken" in body["lora_path"]:
                return httpx.Response(400, json={"error": {"message": REFUSED}})
            self.served[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success")
        self.served.pop(body["lora_name"])
        return httpx.Response(200, text="Success")


def _pod(fake: FakeKube, name: str, ip: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL_ISVC: "smollm2"}},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    fake.put("/api/v1", "pods", NS, pod)


def _sync(fake: FakeKube, engines: dict[str, EngineDouble]) -> dict[str, Any]:
    """One pass of the kopf timer's body; the service's status after it."""

    def route(request: httpx.Request) -> httpx.Response:
        return engines[request.url.host](request)

    async def run() -> None:
        client = KubeClient(fake.url)
        try:
            body = await client.get(f"{ISVC[0]}/namespaces/{NS}/{ISVC[1]}/smollm2")
            assert body is not None
            isvc = parse_inference_service(body, "smollm2")
            pods = await ready_engine_pods(client, NS, "smollm2")
            async with httpx.AsyncClient(transport=httpx.MockTransport(route)) as http:
                update = await sync_adapters(
                    client, http, isvc, body.get("status") or {}, "2026-12-03T00:00:00Z", pods
                )
            assert update is not None
            await client.apply_status(NS, "smollm2", update, ADAPTERS_FIELD_MANAGER)
        finally:
            await client.close()

    asyncio.run(run())
    return (fake.get(*ISVC, NS, "smollm2") or {})["status"]


def test_adapters_render_the_lora_flags_and_one_mount_per_claim(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube, adapters=ADAPTERS, lora={"maxLoras": 2})
    reconcile(fake_kube)
    deployment = fake_kube.get(*DEPLOY, NS, "smollm2")
    assert deployment is not None
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--max-loras") + 1] == "2" and "--enable-lora" in args
    assert "--lora-modules" not in args  # loaded through the admin API, not the template
    assert {
        "name": "adapters-pvc-adapters",
        "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True},
    } in pod["volumes"]
    # another adapter on a claim the pod mounts, or a file:// one, changes nothing in the pod: no restart
    update_spec(fake_kube, adapters=[*ADAPTERS, {"name": "math", "source": "pvc://adapters/math"}])
    reconcile(fake_kube)
    after = fake_kube.get(*DEPLOY, NS, "smollm2")
    assert after is not None and after["spec"]["template"] == deployment["spec"]["template"]


def test_the_sync_loads_unloads_and_reports_the_engines_refusal(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube, adapters=ADAPTERS)
    reconcile(fake_kube)  # creates the admin Secret
    token = read_admin_token(fake_kube.get(*SECRET, NS, "smollm2-admin") or {})
    engines = {"10.0.0.1": EngineDouble(token), "10.0.0.2": EngineDouble(token)}
    _pod(fake_kube, "smollm2-a", "10.0.0.1")
    _pod(fake_kube, "smollm2-b", "10.0.0.2")

    status = _sync(fake_kube, engines)
    assert [p["loaded"] for p in status["adapters"]] == [["chat", "sql"]] * 2
    assert engines["10.0.0.1"].served == {
        "sql": "/models/adapters/pvc/adapters/sql",
        "chat": "/opt/adapters/chat",
    }
    ready = {c["type"]: c for c in status["conditions"]}["AdaptersReady"]
    assert ready["status"] == "True", ready
    loads = len([c for c in engines["10.0.0.1"].calls if c.endswith("load_lora_adapter")])
    _sync(fake_kube, engines)  # converged: the next pass only reads
    assert len([c for c in engines["10.0.0.1"].calls if c.endswith("load_lora_adapter")]) == loads

    # `chat` removed, a broken one added: unloaded, and the engine's message in the condition
    update_spec(fake_kube, adapters=[ADAPTERS[0], {"name": "bad", "source": "file:///opt/broken"}])
    status = _sync(fake_kube, engines)
    assert engines["10.0.0.2"].served == {"sql": "/models/adapters/pvc/adapters/sql"}
    assert status["adapters"][0]["failed"] == [{"name": "bad", "message": REFUSED}]
    ready = {c["type"]: c for c in status["conditions"]}["AdaptersReady"]
    assert ready["status"] == "False" and ready["reason"] == "AdapterLoadFailed"
    assert "pod smollm2-a: adapter bad: " + REFUSED in ready["message"]
    assert not fake_kube.answered(403)
