"""The fleet router in front of the engines: its policy, replicas, queue, the names the gateway routes to the
service and its weight, and the router pods' own placement."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field, create_model, model_validator
from pydantic.fields import FieldInfo
from specfleet.router.policies import DEFAULT_POLICY, POLICIES
from specfleet.router.weights import DEFAULT_WEIGHT, MAX_WEIGHT

from .fields import _default_obj, _Spec, cel
from .placement import SchedulingSpec
from .pod import PodTemplateSpec

# The placement and pull fields the router pods take from the engines' (spec.pod, spec.scheduling), each of
# which `routing.pod` may set for the router alone; the same field definitions (limits, schemas) as there.
ROUTER_POD_FIELDS = (
    (PodTemplateSpec, "image_pull_secrets"),
    (SchedulingSpec, "node_selector"),
    (SchedulingSpec, "tolerations"),
    (SchedulingSpec, "affinity"),
    (SchedulingSpec, "priority_class_name"),
)


def _unset_by_default(field: FieldInfo) -> tuple[Any, FieldInfo]:
    """The field as it is, but with no default the API server would fill in (`priorityClassName: ""`), so
    that unset and set-to-empty stay apart."""
    annotation: Any = field.annotation
    if field.default_factory is not None:
        return annotation, field
    return annotation | None, FieldInfo.merge_field_infos(field, default=None)


class _RouterPodSpec(_Spec):
    """The router pods' placement: a field set here (even to empty) replaces the engines' value for the
    router pods; a field left unset takes it from spec.pod / spec.scheduling (docs/operator.md)."""

    def overrides(self) -> dict[str, Any]:
        """The fields set here, as the pod spec spells them (an empty value: none for the router)."""
        return self.model_dump(by_alias=True, include=self.model_fields_set)


if TYPE_CHECKING:
    RouterPodSpec = _RouterPodSpec
else:
    RouterPodSpec = create_model(
        "RouterPodSpec",
        __base__=_RouterPodSpec,
        __doc__=_RouterPodSpec.__doc__,
        **{name: _unset_by_default(model.model_fields[name]) for model, name in ROUTER_POD_FIELDS},
    )


# `routing.mode`: the router serves clients itself (proxy), or a Gateway API gateway does and asks the router
# which engine to send each request to (endpoint-picker: an InferencePool whose EPP the router is).
ROUTING_MODES = ("proxy", "endpoint-picker")
ENDPOINT_PICKER_ROUTING = (
    "routing.mode endpoint-picker needs routing.enabled: the router is the endpoint picker"
)
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class GatewayRefSpec(_Spec):
    """The Gateway (gateway.networking.k8s.io) the rendered HTTPRoute attaches to."""

    name: str = Field(..., min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)
    namespace: str | None = Field(
        None, max_length=63, pattern=DNS1123_LABEL, description="The Gateway's namespace; default: this one."
    )
    section_name: str | None = Field(
        None, max_length=253, pattern=DNS1123_SUBDOMAIN, description="One listener of the Gateway, by name."
    )


class EndpointPickerSpec(_Spec):
    """With routing.mode endpoint-picker: the InferencePool's endpoint picker reference and the route to it."""

    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        "FailClose",
        description="What the gateway does when the endpoint picker does not answer: FailClose refuses the "
        "request, FailOpen sends it to an engine of its own choosing (not every gateway supports FailOpen "
        "with streamed bodies).",
    )
    gateway: GatewayRefSpec | None = Field(
        None,
        description="Render an HTTPRoute that sends this Gateway's requests (every path) to the "
        "InferencePool; without it, route to the pool from an HTTPRoute of your own.",
    )


# A model name as clients write it in `model` (OpenAI's and Hugging Face's: `org/name`, `name:tag`, dots).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
MODEL_NAME_MAX = 128
ALIASES_UNIQUE = "routing.aliases must not repeat a name"
_UNIQUE_ALIASES = "self.all(a, self.filter(b, b == a).size() == 1)"


class RoutingSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.mode != 'endpoint-picker' || self.enabled", ENDPOINT_PICKER_ROUTING),
            ]
        }
    )
    enabled: bool = Field(
        True,
        description="Run the fleet router in front of the engines (the Service points at "
        "it; the engines get a headless Service). false: the Service spreads requests itself.",
    )
    mode: Literal[ROUTING_MODES] = Field(  # type: ignore[valid-type]
        "proxy",
        description="proxy: clients reach the router through this service's Service. endpoint-picker: the "
        "router is the endpoint picker of an InferencePool (Gateway API Inference Extension) that a "
        "gateway routes to; the gateway sends each request to the engine the router picks "
        "(docs/router.md, 'As a Gateway API endpoint picker').",
    )
    endpoint_picker: EndpointPickerSpec = _default_obj(EndpointPickerSpec)
    policy: Literal[tuple(POLICIES)] = Field(  # type: ignore[valid-type]
        DEFAULT_POLICY,
        description="prefix: the engine estimated to hold the longest prefix of the prompt, "
        "bounded by load; least-loaded: fewest requests in flight; round-robin.",
    )
    kv_events: bool = Field(
        True,
        description="prefix policy: the engines publish their KV cache events (vLLM's --kv-events-config) and "
        "the router subscribes to each engine it discovers and routes on the blocks the engines hold, read "
        "with the model's tokenizer (copied into the router pods at start); false: the router estimates "
        "them from its own routing.",
    )
    load_factor_percent: int = Field(
        125,
        ge=100,
        le=1000,
        description="prefix policy: an engine takes a request only while its requests in "
        "flight stay within this percentage of the mean (consistent hashing with bounded loads).",
    )
    session_header: str = Field(
        "x-session-id",
        max_length=64,
        pattern=r"^[A-Za-z0-9-]*$",
        description="Requests with the same value of this header go to the same engine while its load allows "
        "(prefix policy); empty turns session affinity off.",
    )
    replicas: int = Field(
        2,
        ge=1,
        le=100,
        description="Router pods (stateless; each keeps its own prefix index). Two by default, on different "
        "nodes where the scheduler can: the router is in the path of every request, so one pod restarting "
        "(an operator upgrade rolls it, a node drain evicts it) must leave another serving.",
    )
    queue_timeout_seconds: int = Field(
        0,
        ge=0,
        le=3600,
        description="How long a request waits for a ready engine before 503 (scale from zero).",
    )
    image: str | None = Field(
        None, max_length=512, description="Router image; empty means the operator's own."
    )
    pod: RouterPodSpec = _default_obj(RouterPodSpec)
    aliases: list[
        Annotated[str, Field(min_length=1, max_length=MODEL_NAME_MAX, pattern=MODEL_NAME_PATTERN)]
    ] = Field(
        default_factory=list,
        max_length=16,
        description="Model names the gateway (`specfleet router --gateway`) also routes to this service, "
        "besides its own name; services sharing a name split its traffic by weight (a canary).",
        json_schema_extra={"x-kubernetes-validations": [cel(_UNIQUE_ALIASES, ALIASES_UNIQUE)]},
    )
    weight: int = Field(
        DEFAULT_WEIGHT,
        ge=0,
        le=MAX_WEIGHT,
        description="The gateway's share of a shared model name for this service, against the other "
        "services serving it (weight / sum of weights); 0 takes it out of the split. Requests with a session "
        "id stay on one service.",
    )

    @property
    def routes_on_kv_events(self) -> bool:
        """The engines publish KV events and the router routes on them (docs/router.md, the exact index)."""
        return self.enabled and self.policy == "prefix" and self.kv_events

    @model_validator(mode="after")
    def _endpoint_picker_routing(self) -> RoutingSpec:
        if self.mode == "endpoint-picker" and not self.enabled:
            raise ValueError(f"routing.enabled=false: {ENDPOINT_PICKER_ROUTING}")
        return self

    @model_validator(mode="after")
    def _unique_aliases(self) -> RoutingSpec:
        if repeated := sorted({a for a in self.aliases if self.aliases.count(a) > 1}):
            raise ValueError(f"routing.aliases repeats {repeated}: {ALIASES_UNIQUE}")
        return self
