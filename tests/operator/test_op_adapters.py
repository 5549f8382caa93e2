"""spec.adapters: the pod renders the LoRA flags and the adapters' volumes, and the adapter sync loads and
unloads them in running engines through the admin API, reporting status.adapters and AdaptersReady, against
the Kubernetes API double (with the chart's RBAC). The fast tests run doubles of the server's LoRA protocol
(docs/server.md: /v1/models with `parent`, load and unload with the token) for two pods; the slow one runs
the same passes against a real engine server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fake_kube import FakeKube
from helpers import start_server, stop_process
from lora_helpers import save_random_adapter
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


def _sync(fake: FakeKube, engines: dict[str, EngineDouble] | None = None, at: str = "") -> dict[str, Any]:
    """One pass of the kopf timer's body, against the engine doubles by pod IP or, with `at`, every pod's
    API and admin API at that real engine's URL; the service's status after it."""

    def route(request: httpx.Request) -> httpx.Response:
        assert engines is not None
        return engines[request.url.host](request)

    async def run() -> None:
        client = KubeClient(fake.url)
        transport = httpx.MockTransport(route) if engines is not None else None
        try:
            body = await client.get(f"{ISVC[0]}/namespaces/{NS}/{ISVC[1]}/smollm2")
            assert body is not None
            isvc = parse_inference_service(body, "smollm2")
            ports = {"api": lambda ip: at, "admin": lambda ip: at} if at else {}
            pods = await ready_engine_pods(client, NS, "smollm2", **ports)
            async with httpx.AsyncClient(transport=transport, timeout=60.0) as http:
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


@pytest.mark.slow
def test_the_sync_against_a_real_engine(fake_kube: FakeKube, tiny_llama: str, tmp_path: Path) -> None:
    """The same passes against a real engine server (--enable-lora, the admin token): a load, the engine's
    own refusal of a rank above --max-lora-rank in the condition, an unload."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama.removeprefix("file://"), dtype=torch.float32)
    good = save_random_adapter(base, tmp_path / "good", seed=1, r=8, lora_alpha=16, target_modules=["q_proj"])
    big = save_random_adapter(base, tmp_path / "big", seed=2, r=32, lora_alpha=16, target_modules=["q_proj"])
    create_isvc(fake_kube, adapters=[{"name": "good", "source": f"file://{good}"}], lora={"maxLoraRank": 16})
    reconcile(fake_kube)
    token = read_admin_token(fake_kube.get(*SECRET, NS, "smollm2-admin") or {})
    _pod(fake_kube, "smollm2-a", "127.0.0.1")
    proc, url = start_server(
        tmp_path / "engine.log",
        *("--model", tiny_llama, "--max-model-len", "256", "--kv-cache-gib", "0.1"),
        *("--enable-lora", "--max-lora-rank", "16"),
        env={"SPECFLEET_ADMIN_TOKEN": token},
    )
    try:
        status = _sync(fake_kube, at=url)
        assert status["adapters"] == [{"pod": "smollm2-a", "loaded": ["good"]}]
        update_spec(fake_kube, adapters=[{"name": "big", "source": f"file://{big}"}])
        status = _sync(fake_kube, at=url)
        served = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
        assert "good" not in served and "big" not in served
        ready = {c["type"]: c for c in status["conditions"]}["AdaptersReady"]
        assert ready["status"] == "False" and "rank" in ready["message"] and "16" in ready["message"], ready
    finally:
        stop_process(proc)
