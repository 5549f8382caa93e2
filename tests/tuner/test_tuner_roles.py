"""With spec.disaggregation the tuner tunes the decode engines only (docs/operator.md, "Prefill/decode
disaggregation"): its pod list takes role=decode pods, its PromQL the decode engines' series."""

from __future__ import annotations

import asyncio
from typing import Any

from fake_kube import FakeKube
from specfleet.operator.kube import KubeClient
from specfleet.tuner.handlers import prometheus_selector, ready_pod_urls

NS = "team-a"


def pod(name: str, ip: str, role: str | None, ready: bool = True) -> dict[str, Any]:
    labels = {
        "serving.specfleet.io/inferenceservice": "llm",
        **({"serving.specfleet.io/role": role} if role else {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": "e"}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_the_tuners_pod_list_takes_one_role() -> None:
    kube = FakeKube().start()
    try:
        for obj in (
            pod("llm-prefill-0", "10.0.1.1", "prefill"),
            pod("llm-decode-0", "10.0.2.1", "decode"),
            pod("llm-decode-1", "10.0.2.2", "decode", ready=False),
        ):
            kube.put("/api/v1", "pods", NS, obj)

        async def urls(role: str | None) -> list[str]:
            client = KubeClient(kube.url)
            try:
                return await ready_pod_urls(client, NS, "llm", role)
            finally:
                await client.close()

        assert asyncio.run(urls("decode")) == ["http://10.0.2.1:8000"]
        assert asyncio.run(urls(None)) == ["http://10.0.1.1:8000", "http://10.0.2.1:8000"]
    finally:
        kube.stop()


def test_the_tuners_promql_reads_the_decode_engines_series() -> None:
    assert prometheus_selector(NS, "llm", "decode") == 'namespace="team-a",job="llm",specfleet_role="decode"'
    assert prometheus_selector(NS, "llm") == 'namespace="team-a",job="llm"'
