"""Tenants of the gateway: who a request's API key belongs to, what it may call, at what rate, how urgently.

A tenant has a name (its metrics label), API keys (kept only as sha256 digests), the models it may call
(none listed: every model), a requests-per-minute and a tokens-per-minute limit (0: unlimited) and a
priority class, which becomes the `priority` field of the body the engine receives (vLLM's meaning:
smaller runs earlier, default 0). They come from a file (`specfleet router --tenants`, `specfleet up
--tenants`) or from Kubernetes Secrets selected by label (tenant_discovery.py); docs/router.md, "Tenants",
shows both layouts.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Priority class -> the request's `priority` (vLLM: lower runs earlier, 0 is the default and what a request
# without a tenant gets). Ten apart so that a class can be put between two later without renumbering.
PRIORITY_CLASSES: dict[str, int] = {"interactive": -10, "standard": 0, "batch": 10}
DEFAULT_PRIORITY_CLASS = "standard"
# The label every unknown or missing key is counted under: one value, whatever callers send.
UNKNOWN_TENANT = "unknown"
# A tenant's name is a Prometheus label value and a Redis key part: a DNS label's alphabet and length.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# The shortest key accepted: 16 characters of a random key are ~96 bits, out of reach of guessing.
MIN_KEY_CHARS = 16


class InvalidTenants(ValueError):
    """A tenants file or Secret that cannot be served as it is; the message names the field."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantSpec(BaseModel):
    """One tenant as written in the tenants file (or assembled from one Secret's data)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    keys: list[str] = Field(min_length=1)
    models: list[str] = Field(default_factory=list)
    rpm: int = Field(default=0, ge=0)
    tpm: int = Field(default=0, ge=0)
    priority: str = DEFAULT_PRIORITY_CLASS

    @field_validator("keys")
    @classmethod
    def _long_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(
                    f"a key of {len(key)} characters is too short: give at least {MIN_KEY_CHARS}"
                )
        return keys

    @field_validator("priority")
    @classmethod
    def _known_class(cls, priority: str) -> str:
        if priority not in PRIORITY_CLASSES:
            raise ValueError(f"unknown priority class {priority!r}; one of {', '.join(PRIORITY_CLASSES)}")
        return priority


@dataclass(frozen=True)
class Tenant:
    name: str
    digests: tuple[bytes, ...]  # sha256 of each key: the keys themselves are not kept
    models: frozenset[str]  # empty: every model
    rpm: int  # requests per minute, 0: unlimited
    tpm: int  # tokens per minute (prompt + completion), 0: unlimited
    priority_class: str

    @classmethod
    def of(cls, spec: TenantSpec) -> Tenant:
        return cls(
            spec.name,
            tuple(digest(k) for k in spec.keys),
            frozenset(spec.models),
            spec.rpm,
            spec.tpm,
            spec.priority,
        )

    @property
    def priority(self) -> int:
        return PRIORITY_CLASSES[self.priority_class]

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


class TenantTable:
    """The tenants in force; `find` compares a presented key's digest with every known one in constant time."""

    def __init__(self, tenants: list[Tenant] | None = None) -> None:
        self.tenants: dict[str, Tenant] = {}
        self.replace(tenants or [])

    def replace(self, tenants: list[Tenant]) -> None:
        by_name: dict[str, Tenant] = {}
        owner: dict[bytes, str] = {}
        for tenant in tenants:
            if tenant.name in by_name:
                raise InvalidTenants(f"tenant {tenant.name!r} is given twice; give each tenant one entry")
            for d in tenant.digests:
                if d in owner:
                    raise InvalidTenants(f"tenants {owner[d]!r} and {tenant.name!r} share a key")
                owner[d] = tenant.name
            by_name[tenant.name] = tenant
        self.tenants = by_name

    def find(self, key: str) -> Tenant | None:
        presented = digest(key)
        found = None
        for tenant in self.tenants.values():  # no early exit: the time does not say which tenant matched
            for d in tenant.digests:
                if hmac.compare_digest(d, presented):
                    found = tenant
        return found

    def names(self) -> list[str]:
        return sorted(self.tenants)


def parse_specs(items: Any, where: str) -> list[TenantSpec]:
    """Tenant entries (a list of mappings) as specs; an invalid one is an InvalidTenants naming its field."""
    if not isinstance(items, list):
        raise InvalidTenants(f"{where}: `tenants` must be a list of tenants")
    specs = []
    for i, item in enumerate(items):
        try:
            specs.append(TenantSpec.model_validate(item))
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise InvalidTenants(f"{where}: tenants[{i}].{field}: {first['msg']}") from None
    return specs


def load_tenants_file(path: str | Path) -> list[Tenant]:
    """The tenants of a YAML file `{tenants: [{name, keys, models, rpm, tpm, priority}, ...]}`."""
    return parse_tenants(Path(path).read_text(), str(path))


def parse_tenants(text: str, where: str) -> list[Tenant]:
    """The tenants of a tenants file's text (`where` names the file in the errors)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as error:  # where and what, without the snippet of the file (its keys) it quotes
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InvalidTenants(
            f"{where}: not YAML{at}: {getattr(error, 'problem', None) or 'unparsable'}"
        ) from None
    if not isinstance(doc, dict) or "tenants" not in doc:
        raise InvalidTenants(f"{where}: expected a mapping with a `tenants` list")
    tenants = [Tenant.of(s) for s in parse_specs(doc["tenants"], where)]
    TenantTable(tenants)  # refuses duplicates here, where the file can be named
    return tenants


def _split(value: str) -> list[str]:
    return [part for part in re.split(r"[,\s]+", value) if part]


def spec_from_secret_data(data: dict[str, str], secret_name: str) -> TenantSpec:
    """One tenant from a Secret's decoded data: `key` (required), `tenant` (default: the Secret's name),
    `models` (comma- or space-separated; absent: every model), `rpm`, `tpm` and `priority`."""
    where = f"Secret {secret_name}"
    if not data.get("key"):
        raise InvalidTenants(f"{where}: data.key is missing; put the API key there")
    item: dict[str, Any] = {
        "name": data.get("tenant", secret_name).strip(),
        "keys": [data["key"].strip()],
        "models": _split(data.get("models", "")),
        "priority": data.get("priority", DEFAULT_PRIORITY_CLASS).strip(),
    }
    for field in ("rpm", "tpm"):
        if field in data:
            try:
                item[field] = int(data[field].strip())
            except ValueError:
                raise InvalidTenants(f"{where}: data.{field}={data[field]!r} is not an integer") from None
    (spec,) = parse_specs([item], where)
    return spec
