"""spec.observability.otlpTracesEndpoint: the API double admits an http(s) collector and refuses anything
else (the CRD's pattern, beside its pydantic twin); reconciled, every engine Deployment (both roles) and the
router carry it as `--otlp-traces-endpoint`, which their own parsers read back; unset, none does."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube
from isvc_schema_tools import REPO, admission_errors
from specfleet.engine.server.cli import build_parser as engine_parser
from specfleet.engine.tracing import traces_endpoint
from specfleet.operator import load_inference_service
from specfleet.operator.inference_service import InvalidInferenceService
from specfleet.router.cli import build_parser as router_parser
from test_op_reconcile import ISVC, NS, reconcile

DEPLOY = ("/apis/apps/v1", "deployments")
PD_EXAMPLE = REPO / "examples" / "smollm2-cpu-pd.yaml"
COLLECTOR = "http://otel-collector.observability:4318"


def pd_doc(**observability: Any) -> dict[str, Any]:
    doc = yaml.safe_load(PD_EXAMPLE.read_text())
    doc["metadata"].update(name="smollm2", namespace=NS)
    if observability:
        doc["spec"]["observability"] = observability
    return doc


def container_args(fake: FakeKube, name: str) -> list[str]:
    deployment = fake.get(*DEPLOY, NS, name)
    assert deployment is not None, name
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_endpoint_reaches_both_engine_roles_and_the_router(fake_kube: FakeKube) -> None:
    fake_kube.put(*ISVC, NS, pd_doc(otlpTracesEndpoint=COLLECTOR))
    reconcile(fake_kube)
    for engines in ("smollm2-prefill", "smollm2-decode"):
        args = engine_parser().parse_args(container_args(fake_kube, engines))
        assert args.otlp_traces_endpoint == COLLECTOR
    router = router_parser().parse_args(container_args(fake_kube, "smollm2-router"))
    assert router.otlp_traces_endpoint == COLLECTOR
    assert traces_endpoint(router.otlp_traces_endpoint, {}) == f"{COLLECTOR}/v1/traces"


def test_without_the_field_no_pod_traces(fake_kube: FakeKube) -> None:
    fake_kube.put(*ISVC, NS, pd_doc())
    reconcile(fake_kube)
    for name in ("smollm2-prefill", "smollm2-decode", "smollm2-router"):
        assert "--otlp-traces-endpoint" not in container_args(fake_kube, name)


@pytest.mark.parametrize(
    "endpoint", ["grpc://otel-collector:4317", "otel-collector:4318", "http://", "http://a b"]
)
def test_an_endpoint_the_pods_cannot_send_to_is_refused_by_the_api_server_and_by_specfleet_up(
    endpoint: str,
) -> None:
    doc = pd_doc(otlpTracesEndpoint=endpoint)
    assert any("otlpTracesEndpoint" in e for e in admission_errors(copy.deepcopy(doc))), endpoint
    with pytest.raises(InvalidInferenceService, match="otlp"):
        load_inference_service(doc)


def test_specfleet_up_reads_the_same_field_for_its_router_and_engines() -> None:
    from specfleet.fleet.supervisor import LocalFleet, local_engine_command

    isvc = load_inference_service(pd_doc(otlpTracesEndpoint=COLLECTOR))
    command = local_engine_command(isvc, 8000)
    assert engine_parser().parse_args(command[command.index("--model") :]).otlp_traces_endpoint == COLLECTOR
    fleet = LocalFleet(isvc)
    tracer = fleet.router.tracer
    assert tracer is not None and fleet.otlp_traces_endpoint == f"{COLLECTOR}/v1/traces"
    tracer.shutdown()
