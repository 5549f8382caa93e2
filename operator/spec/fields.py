"""What every section of the spec is built from: the frozen camelCase base model, CEL rules, Kubernetes
quantities and int-or-string fields, and fields whose schema is an upstream Kubernetes definition."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.alias_generators import to_camel

from ..kube_grammar import OPTIONAL_DNS1123_SUBDOMAIN, Shape, unknown_fields

# A field whose CRD schema is the Kubernetes OpenAPI definition named here (see `upstream`).
K8S_SCHEMA_KEY = "x-specfleet-kubernetes-schema"
# Kubernetes' quantity grammar (resource.ParseQuantity: a decimal number, then a binary-SI, decimal-SI or
# integer-exponent suffix), without the sign: requests and sizes are never negative. `1.2.3`, `1Gii` and
# `-16Gi` are refused at admission instead of by the API server when the Deployment is applied.
QUANTITY_PATTERN = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
# The same with a non-zero digit: a size or request that must be positive (memory "0" or shmSize "0" would
# give the engine nothing to run in).
POSITIVE_QUANTITY_PATTERN = (
    r"^\+?([0-9]*[1-9][0-9]*(\.[0-9]*)?|[0-9]*\.[0-9]*[1-9][0-9]*)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
# A Deployment's maxSurge / maxUnavailable: a count or a percentage, without leading zeros ("00" is no
# number the API server reads); maxUnavailable's percentage is at most 100%.
INT_OR_PERCENT_PATTERN = r"^(0|[1-9][0-9]*)%?$"
INT_OR_PERCENT_TO_100_PATTERN = r"^(0|[1-9][0-9]*|([0-9]|[1-9][0-9]|100)%)$"


def _quantity_to_str(value: Any) -> Any:
    """An int-or-string field takes an integer or a string, as the API server does: a float is refused."""
    if isinstance(value, float):
        raise ValueError(
            f"{value!r} is a float: write an integer, or the quantity as a string ({str(value)!r})"
        )
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _int_or_string(pattern: str, minimum: int, **limits: Any) -> Any:
    """An int-or-string field's limits: `pattern` binds the string form, `minimum` the integer form."""
    return Field(
        pattern=pattern,
        **limits,
        json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": pattern, "minimum": minimum},
    )


# A Kubernetes resource quantity: YAML may write `cpu: 4` or `cpu: "500m"`.
Quantity = Annotated[str, BeforeValidator(_quantity_to_str), _int_or_string(QUANTITY_PATTERN, 0)]
PositiveQuantity = Annotated[
    str, BeforeValidator(_quantity_to_str), _int_or_string(POSITIVE_QUANTITY_PATTERN, 1)
]
IntOrPercent = Annotated[
    str, BeforeValidator(_quantity_to_str), _int_or_string(INT_OR_PERCENT_PATTERN, 0, max_length=8)
]
IntOrPercentTo100 = Annotated[
    str, BeforeValidator(_quantity_to_str), _int_or_string(INT_OR_PERCENT_TO_100_PATTERN, 0, max_length=8)
]


def cel(rule: str, message: str) -> dict[str, Any]:
    return {"rule": rule, "message": message}


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


def _default_obj(factory: type[_Spec]) -> Any:
    """An object field the API server defaults to `{}` so that its own fields' defaults apply."""
    return Field(default_factory=factory, json_schema_extra={"default": {}})


def upstream(definition: str, **extra: Any) -> Any:
    """The CRD takes this field's schema from the Kubernetes OpenAPI (`crd.py` inlines it)."""
    return {K8S_SCHEMA_KEY: definition, **extra}


def _shaped(shape: Shape, what: str) -> AfterValidator:
    """Refuse the keys an upstream object does not have (the API server refuses them under kubectl's Strict
    field validation; the CRD carries the upstream schema, pydantic this shape of it)."""

    def check(value: Any) -> Any:
        if errors := unknown_fields(value, shape, what):
            raise ValueError("; ".join(errors))
        return value

    return AfterValidator(check)


# A name the API server checks as a DNS-1123 subdomain on the child ("" where the field is optional).
OptionalName = Annotated[str, Field(max_length=253, pattern=OPTIONAL_DNS1123_SUBDOMAIN)]
