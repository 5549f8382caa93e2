"""The whole path on a real cluster: helm install, apply the CPU example, wait for Ready, call the OpenAI
API through the Service (the admin API is not there: it has its own pod port), change the spec and see
Ready follow the rollout (RollingUpdate, then Recreate), scale, then uninstall the operator first and
delete: the object goes at once (no finalizer) and its children are garbage-collected.

Images: SPECFLEET_OPERATOR_IMAGE and SPECFLEET_ENGINE_CPU_IMAGE (loaded into kind by e2e/run-kind.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import RELEASE, kubectl
from specfleet.fleet.supervisor import free_port  # tests/helpers.py's; tests/ is not on a `pytest e2e` path

REPO = Path(__file__).resolve().parents[1]
OPERATOR_IMAGE = os.environ.get("SPECFLEET_OPERATOR_IMAGE", "specfleet/operator:e2e")
ENGINE_IMAGE = os.environ.get("SPECFLEET_ENGINE_CPU_IMAGE", "specfleet/engine:e2e")
READY_TIMEOUT = int(os.environ.get("SPECFLEET_E2E_READY_TIMEOUT", "900"))


def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def get(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    result = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.fixture(scope="module")
def operator(namespace: str) -> Iterator[None]:
    repo, _, tag = OPERATOR_IMAGE.rpartition(":")
    engine_repo = ENGINE_IMAGE
    subprocess.run(
        [
            "helm",
            "upgrade",
            "--install",
            RELEASE,
            str(REPO / "charts" / "specfleet"),
            "-n",
            namespace,
            "--set",
            f"image.repository={repo}",
            "--set",
            f"image.tag={tag}",
            "--set",
            "image.pullPolicy=IfNotPresent",
            "--set",
            f"engine.cpuImage={engine_repo}",
            "--set",
            "reconcileIntervalSeconds=5",
            "--wait",
            "--timeout",
            "5m",
        ],
        check=True,
        timeout=400,
    )
    yield
    subprocess.run(["helm", "uninstall", RELEASE, "-n", namespace], check=False, timeout=120)


@pytest.fixture(scope="module")
def smollm2(operator: None, namespace: str) -> Iterator[str]:
    kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "smollm2-cpu.yaml"))
    kubectl(
        "wait",
        "-n",
        namespace,
        "--for=condition=Ready",
        "isvc/smollm2",
        f"--timeout={READY_TIMEOUT}s",
        timeout=READY_TIMEOUT + 30,
    )
    yield "smollm2"
    kubectl("delete", "-n", namespace, "isvc/smollm2", "--ignore-not-found", check=False)


def condition(isvc: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (isvc.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


def port_forward(target: str, namespace: str, remote: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        ["kubectl", "port-forward", "-n", namespace, target, f"{port}:{remote}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, port


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def test_ready_status_and_openai_request(smollm2: str, namespace: str) -> None:
    isvc = get("isvc", smollm2, namespace)
    assert isvc is not None
    assert isvc["status"]["endpoint"] == f"http://smollm2.{namespace}.svc:8000/v1"
    assert isvc["status"]["readyReplicas"] == 1
    port = free_port()
    forward = subprocess.Popen(
        ["kubectl", "port-forward", "-n", namespace, "svc/smollm2", f"{port}:8000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        body = json.dumps(
            {
                "model": "bundled://smollm2-135m-instruct",
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Say hello."}],
            }
        ).encode()

        def ask() -> dict[str, Any] | None:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return json.loads(response.read())
            except OSError:
                return None

        answer = wait_for("an answer through the Service", ask, timeout=120)
        assert answer["choices"][0]["message"]["content"]
        # the admin API is not served on the Service's port ...
        assert http_status(f"http://127.0.0.1:{port}/admin/config") == 404
    finally:
        forward.terminate()
    # ... but on the pod's own admin port, where it still wants the token
    pod = kubectl(
        "get",
        "pods",
        "-n",
        namespace,
        "-l",
        f"serving.specfleet.io/inferenceservice={smollm2}",
        "-o",
        "jsonpath={.items[0].metadata.name}",
    ).stdout
    admin, admin_port = port_forward(f"pod/{pod}", namespace, 8001)
    try:
        assert (
            wait_for(
                "the admin port",
                lambda: http_status(f"http://127.0.0.1:{admin_port}/admin/config"),
                timeout=30,
            )
            == 401
        )
    finally:
        admin.terminate()
    table = kubectl("get", "isvc", smollm2, "-n", namespace).stdout
    assert "READY" in table and "REASON" in table and "AllReplicasReady" in table


def test_spec_change_rolls_out(smollm2: str, namespace: str) -> None:
    before = get("deployment", smollm2, namespace)
    assert before is not None
    kubectl(
        "patch",
        "isvc",
        smollm2,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"batching": {"maxNumSeqs": 8}}}),
    )

    def rolled() -> bool:
        deployment = get("deployment", smollm2, namespace) or {}
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1] == "8"

    wait_for("the Deployment template to carry --max-num-seqs 8", rolled, timeout=60)
    # Ready leaves True while the new pod rolls out (the old pod's readiness says nothing about the new spec)
    wait_for(
        "Ready to leave True during the rollout",
        lambda: condition(get("isvc", smollm2, namespace) or {}, "Ready").get("status") != "True",
        timeout=60,
    )
    deployment = get("deployment", smollm2, namespace) or {}
    # CPU pods surge one and never drop below the ready count; the pod leaves the endpoints before SIGTERM
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    kubectl(
        "rollout",
        "status",
        f"deployment/{smollm2}",
        "-n",
        namespace,
        f"--timeout={READY_TIMEOUT}s",
        timeout=READY_TIMEOUT + 30,
    )
    kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", f"isvc/{smollm2}", "--timeout=300s", timeout=330
    )
    isvc = get("isvc", smollm2, namespace) or {}
    assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    assert condition(isvc, "Progressing").get("reason") == "RolloutComplete"


def test_recreate_strategy_rolls_out(smollm2: str, namespace: str) -> None:
    kubectl(
        "patch",
        "isvc",
        smollm2,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"rollout": {"strategy": "Recreate"}, "batching": {"maxNumSeqs": 12}}}),
    )
    wait_for(
        "the Deployment to switch to Recreate",
        lambda: (
            (get("deployment", smollm2, namespace) or {}).get("spec", {}).get("strategy")
            == {"type": "Recreate"}
        ),
        timeout=60,
    )
    kubectl(
        "rollout",
        "status",
        f"deployment/{smollm2}",
        "-n",
        namespace,
        f"--timeout={READY_TIMEOUT}s",
        timeout=READY_TIMEOUT + 30,
    )
    kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", f"isvc/{smollm2}", "--timeout=300s", timeout=330
    )
    kubectl(
        "patch",
        "isvc",
        smollm2,
        "-n",
        namespace,
        "--type=json",
        "-p",
        json.dumps([{"op": "remove", "path": "/spec/rollout/strategy"}]),
    )


def test_scale_subresource(smollm2: str, namespace: str) -> None:
    kubectl("scale", "isvc", smollm2, "-n", namespace, "--replicas=2")
    wait_for("a PodDisruptionBudget at 2 replicas", lambda: get("pdb", smollm2, namespace), timeout=60)
    assert get("deployment", smollm2, namespace)["spec"]["replicas"] == 2
    # a /scale write bumps the generation; status catches up once the Deployment controller has seen it
    wait_for(
        "status.observedGeneration to follow the scale",
        lambda: (lambda i: i["status"].get("observedGeneration") == i["metadata"]["generation"])(
            get("isvc", smollm2, namespace) or {"status": {}, "metadata": {}}
        ),
        timeout=120,
    )
    kubectl("scale", "isvc", smollm2, "-n", namespace, "--replicas=1")
    wait_for("the PDB to go at 1 replica", lambda: get("pdb", smollm2, namespace) is None, timeout=60)


def test_delete_without_the_operator_garbage_collects_children(smollm2: str, namespace: str) -> None:
    isvc = get("isvc", smollm2, namespace) or {}
    assert not isvc["metadata"].get("finalizers"), isvc["metadata"]  # kopf's timers hold none
    subprocess.run(["helm", "uninstall", RELEASE, "-n", namespace, "--wait"], check=True, timeout=300)
    kubectl("delete", "isvc", smollm2, "-n", namespace, "--wait=true", "--timeout=60s", timeout=120)
    for kind, name in (("deployment", smollm2), ("service", smollm2), ("secret", f"{smollm2}-admin")):
        wait_for(
            f"{kind}/{name} to be garbage-collected",
            lambda k=kind, n=name: get(k, n, namespace) is None,
            timeout=120,
        )
