"""A whole InferenceService object (metadata + spec + status) and the loader `specfleet up` uses."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .resources import API_VERSION, KIND, MAX_NAME_LENGTH, ROLES
from .spec import InferenceServiceSpec
from .status import InferenceServiceStatus

NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class InvalidInferenceService(ValueError):
    """The document is not a valid InferenceService; the message lists every problem and its field."""


class ObjectMeta(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    # a DNS-1035 label short enough that every child's name (NAME-engines...) is one too (resources.py)
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH)
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceService(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    api_version: Literal["serving.specfleet.io/v1alpha1"] = Field(API_VERSION, alias="apiVersion")  # type: ignore[arg-type]  # GROUP/VERSION, this literal
    kind: Literal["InferenceService"] = KIND  # type: ignore[assignment]  # resources.KIND, this literal
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def desired_replicas(self) -> int:
        """The scaled engines to run (the aggregated engines, or with spec.disaggregation the decode
        engines): `spec.replicas` (`disaggregation.decode.replicas`), or with autoscaling on, the tuner's
        count from `status.autoscaling.replicas` (clamped to the bounds; before its first decision, the
        spec's count clamped). The one place the workloads, the PDB and the conditions read it from."""
        spec = self.spec
        scaling = spec.autoscaling
        base = spec.replicas if spec.disaggregation is None else spec.disaggregation.decode.replicas
        if not scaling.enabled:
            return base
        tuned = self.status.autoscaling.replicas if self.status and self.status.autoscaling else None
        wanted = base if tuned is None else tuned
        return min(max(wanted, scaling.min_replicas), scaling.max_replicas)

    @property
    def roles(self) -> tuple[str | None, ...]:
        """One engine workload per role: (None,) aggregated, ("prefill", "decode") with spec.disaggregation."""
        return (None,) if self.spec.disaggregation is None else ROLES

    def role_replicas(self, role: str | None) -> int:
        """Engines of one role: prefill engines stay at their spec count; the tuner scales decode engines
        (docs/operator.md, "Prefill/decode disaggregation")."""
        disagg = self.spec.disaggregation
        return disagg.prefill.replicas if role == "prefill" and disagg is not None else self.desired_replicas

    @property
    def signs_prefill(self) -> bool:
        """Whether the endpoint picker signs the prefill engine it names for the decode engines: roles behind
        routing.mode endpoint-picker (docs/operator.md, "Prefill/decode disaggregation"); the Secret
        `NAME-pd-key` then holds the key both mount."""
        routing = self.spec.routing
        return self.spec.disaggregation is not None and routing.enabled and routing.mode == "endpoint-picker"

    @property
    def total_engines(self) -> int:
        return sum(self.role_replicas(role) for role in self.roles)


def _describe(error: ValidationError, origin: str) -> str:
    lines = [f"{origin} is not a valid {KIND}:"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(document)"
        lines.append(f"  {where}: {item['msg']} (got {item.get('input')!r})")
    lines.append(f"  see examples/ and `kubectl explain {KIND.lower()}.spec` for the fields and their limits")
    return "\n".join(lines)


def parse_inference_service(document: Mapping[str, Any], origin: str = "document") -> InferenceService:
    if document.get("kind") != KIND:
        raise InvalidInferenceService(f"{origin}: kind is {document.get('kind')!r}; expected {KIND!r}")
    try:
        return InferenceService.model_validate(dict(document))
    except ValidationError as error:
        raise InvalidInferenceService(_describe(error, origin)) from None


def load_inference_services(path: str | Path) -> list[InferenceService]:
    """Every InferenceService in a (multi-document) YAML file; other kinds are skipped."""
    path = Path(path)
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except yaml.YAMLError as error:
        raise InvalidInferenceService(f"{path} is not valid YAML: {error}") from None
    found = [
        parse_inference_service(doc, f"{path} (document {index + 1})")
        for index, doc in enumerate(documents)
        if isinstance(doc, Mapping) and doc.get("kind") == KIND
    ]
    if not found:
        raise InvalidInferenceService(f"{path} holds no document with kind: {KIND}")
    return found


def load_inference_service(source: str | Path | Mapping[str, Any]) -> InferenceService:
    """Parse and validate one InferenceService from a YAML file path or an already-parsed dict."""
    if isinstance(source, Mapping):
        return parse_inference_service(source)
    found = load_inference_services(source)
    if len(found) > 1:
        names = ", ".join(isvc.name for isvc in found)
        raise InvalidInferenceService(
            f"{source} holds {len(found)} InferenceServices ({names}); use load_inference_services for many"
        )
    return found[0]
