"""The live knobs, declared once: the fields of `LiveConfig`, each with a `Knob` record of its facts.

Everything that names a knob is derived from this declaration: the engine's limits in `update_config`
and the simulated engine's (`live_limits`, `live_refusal`; `sim/engine.py`),
the admin API's body and validation (`server/protocol.py`, `server/admin.py`), the config gauges (`server/metrics.py`), the
tuner's `TunedConfig`, `TuneBounds` and `LiveSettings` (`tuner/types.py`), its two readers (PromQL
in `sources.py`, the direct scrape in `snapshot.py`), the CRD's `autotune.bounds` (`operator/spec/autotune.py`),
and the flags of the engines that the operator and `specfleet up` start: each searched knob's start value
(`operator/render/deployment.py`) and its ceiling (`fleet/supervisor.py`).
`tests/test_knobs.py` walks the declaration and checks that each of them knows every knob.

Two scopes. An engine knob (`ENGINE`, the fields of `LiveConfig`) is set through each engine's admin API
and reported by each engine's gauge. A service knob (`SERVICE`, the fields of `ServiceConfig`: today
`replicas`) is set on the service as a whole, by whoever runs the engines (the operator renders it into
the Deployment's replica count from `status.autoscaling`; `specfleet up` starts and stops engines), and
reported by the router's gauge; the admin API refuses it by name and the engine gauges skip it. The
replica policy (`tuner/policy/replicas.py`), `spec.autoscaling`'s bounds, `status.autoscaling` and the
router's gauge read their names, defaults and limits from its declaration.

Plain Python on purpose: the operator and the tuner import this module, and they stay free of torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

METRIC_PREFIX = "specfleet_"
KNOB = "knob"  # the dataclass field metadata key that holds a field's `Knob`
ENGINE = "engine"  # scope: each engine's admin API sets it, each engine's gauge reports it
SERVICE = (
    "service"  # scope: the service's replica count sets it (Deployment / local fleet), the router reports it
)


@dataclass(frozen=True)
class Knob:
    """What every part needs to know about one live knob."""

    name: str  # the LiveConfig field, the admin API key, the EngineConfig start value and its `--flag`
    help: str  # the config gauge's help text
    minimum: int  # the lowest value the admin API accepts
    ceiling: str  # the `EngineConfig` attribute, fixed at start, that bounds it from above
    label: str  # the short name in the tuner's log lines and reasons (`k=2 seqs=32 tokens=1024`)
    # The tuner's default search range (the CRD's `autotune.bounds` default). None: the tuner does not
    # search this knob; a policy rule sets it (`LiveSettings`), or nothing does.
    search: tuple[int, int] | None = None
    spec_path: str | None = None  # where the InferenceService spec holds its start value (searched knobs)
    # The `EngineConfig` field that sets `ceiling` at start: `specfleet up` passes its flag to cover the
    # tuner's bounds. Empty for a service knob, whose `ceiling` is a spec field.
    ceiling_field: str = ""
    scope: str = ENGINE  # ENGINE or SERVICE: who actuates it and who reports it (see the module's docstring)

    @property
    def gauge(self) -> str:
        """The Prometheus gauge that reports the value in force."""
        return METRIC_PREFIX + self.name

    @property
    def crd_name(self) -> str:
        """The key in the CRD's camelCase objects (`autotune.bounds`, `status.config`)."""
        return camel(self.name)

    @property
    def searched(self) -> bool:
        return self.search is not None


def camel(snake: str) -> str:
    """`max_num_seqs` -> `maxNumSeqs`, as the CRD's alias generator (pydantic's `to_camel`) spells it."""
    head, *rest = snake.split("_")
    return head + "".join(part.title() for part in rest)


def _declare(
    *,
    help: str,
    minimum: int,
    ceiling: str,
    label: str,
    default: int | Any = MISSING,
    search: tuple[int, int] | None = None,
    spec_path: str | None = None,
    ceiling_field: str = "",
    scope: str = ENGINE,
) -> Any:
    knob = Knob("", help, minimum, ceiling, label, search, spec_path, ceiling_field, scope)
    return field(default=default, metadata={KNOB: knob})


@dataclass
class LiveConfig:
    """The knobs that change between steps (admin API, tuner). Checked by the engine before applying.

    THE DECLARATION: a new knob is one field here plus its engine semantics (docs/architecture.md,
    "How to add a tuned knob")."""

    num_speculative_tokens: int = _declare(
        help="Speculative tokens per step (k)",
        minimum=0,
        ceiling="speculative_tokens_limit",
        ceiling_field="max_num_speculative_tokens",
        label="k",
        search=(0, 8),
        spec_path="speculative.num_speculative_tokens",
    )
    max_num_seqs: int = _declare(
        help="Live max_num_seqs",
        minimum=1,
        ceiling="seqs_limit",
        ceiling_field="max_num_seqs_limit",
        label="seqs",
        search=(8, 256),
        spec_path="batching.max_num_seqs",
    )
    max_num_batched_tokens: int = _declare(
        help="Live max_num_batched_tokens",
        minimum=1,
        ceiling="batched_tokens_limit",
        ceiling_field="max_num_batched_tokens_limit",
        label="tokens",
        search=(512, 8192),
        spec_path="batching.max_num_batched_tokens",
    )
    # Set by the tuner's load-shift rule (the guard), not searched: 0 never disables.
    speculative_disable_by_batch_size: int = _declare(
        help="Batch size above which a step proposes nothing (0: never)",
        minimum=0,
        ceiling="seqs_limit",
        ceiling_field="max_num_seqs_limit",
        label="guard",
        default=0,
    )

    def as_dict(self) -> dict[str, int]:
        return {knob.name: getattr(self, knob.name) for knob in KNOBS}


@dataclass
class ServiceConfig:
    """The knobs of a service as a whole (scope `SERVICE`): not the engines' to apply, so not in
    `LiveConfig`, the admin API or the engine gauges.

    `replicas`: engines of the service. Its `search` is the default [minReplicas, maxReplicas] of
    `spec.autoscaling` (the replica policy searches between them with autoscaling on), its `ceiling` the
    spec field that bounds it from above, its `spec_path` the start value (`spec.replicas`)."""

    replicas: int = _declare(
        help="Engine replicas of the service (the tuner's count with spec.autoscaling on)",
        minimum=0,
        ceiling="autoscaling.max_replicas",
        label="replicas",
        default=1,
        search=(1, 1),
        spec_path="replicas",
        scope=SERVICE,
    )

    def as_dict(self) -> dict[str, int]:
        return {knob.name: getattr(self, knob.name) for knob in SERVICE_KNOBS}


def _knobs(cls: type) -> tuple[Knob, ...]:
    return tuple(replace(f.metadata[KNOB], name=f.name) for f in fields(cls))


KNOBS: tuple[Knob, ...] = _knobs(LiveConfig)  # the engine knobs: admin API, engine gauges, `update_config`
SEARCHED: tuple[Knob, ...] = tuple(k for k in KNOBS if k.searched)  # the tuner's `TunedConfig`
RULED: tuple[Knob, ...] = tuple(k for k in KNOBS if not k.searched)  # set by a policy rule, if at all
SERVICE_KNOBS: tuple[Knob, ...] = _knobs(ServiceConfig)  # actuated on the service, reported by the router
REPLICAS: Knob = SERVICE_KNOBS[0]  # the replica policy's knob (`tuner/policy/replicas.py`)
ALL_KNOBS: tuple[Knob, ...] = KNOBS + SERVICE_KNOBS
_BY_NAME = {k.name: k for k in ALL_KNOBS}


def get_knob(name: str) -> Knob:
    """The knob called `name`; an unknown name is refused with the list of known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a live knob; use one of {sorted(_BY_NAME)}") from None


def live_limits(ceiling_of: Callable[[Knob], int]) -> dict[str, tuple[int, int]]:
    """Each engine knob's accepted range: [its minimum, its ceiling fixed at start], the ceiling read by
    `ceiling_of` (the engine's `EngineConfig.<Knob.ceiling>`, the simulator's start limits)."""
    return {knob.name: (knob.minimum, ceiling_of(knob)) for knob in KNOBS}


def live_refusal(limits: Mapping[str, tuple[int, int]], name: str, value: Any) -> str | None:
    """Why a live value is refused, naming the field and the limit (None: accepted). One rule for the
    engine's `update_config` (config.check_live raises it as a 400) and the simulated engine's."""
    if name not in limits:
        return f"{name} is not a live setting; use one of {sorted(limits)}"
    low, high = limits[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        # k's ceiling is 0 when the engine started without a proposer
        why = (
            " (no speculative method configured at start)"
            if name == "num_speculative_tokens" and not high
            else ""
        )
        return f"{name}={value!r} must be an integer between {low} and {high}{why}"
    return None


def check_fields(cls: type, expected: tuple[str, ...], what: str) -> None:
    """Raise at import when a typed copy of the knobs (a dataclass with one field per knob) has drifted
    from the declaration; the message says what to add or remove."""
    have = tuple(f.name for f in fields(cls))
    if have != expected:
        raise TypeError(
            f"{cls.__qualname__} must have the fields {expected} ({what}, from "
            f"specfleet.engine.knobs), in that order; it has {have}"
        )
