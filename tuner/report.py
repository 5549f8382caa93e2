"""What a tuning interval writes: `status.tuning`, the `Tuned` condition and the Event, as pure functions."""

from __future__ import annotations

from typing import Any

from specfleet.engine.knobs import REPLICAS, camel
from specfleet.operator.conditions import Cond, condition_entries

from .loop import Tick
from .policy.model import adapter_goodput
from .policy.replicas import ReplicaDecision
from .types import Decision, LiveSettings, TunedConfig

# Adapters whose draft acceptance the status reason lists (by name): the reason stays a readable sentence
# with --max-cpu-loras in the dozens; the rest are counted.
MAX_ADAPTERS_SHOWN = 8


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def _listed(items: list[str]) -> str:
    """The first MAX_ADAPTERS_SHOWN items, the rest counted."""
    more = len(items) - MAX_ADAPTERS_SHOWN
    return ", ".join(items[:MAX_ADAPTERS_SHOWN]) + (f" (+{more} more)" if more > 0 else "")


def tuning_status(
    tick: Tick, config: TunedConfig | None, previous: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """`status.tuning`: the config the tuner holds, the last decision's reason and what it observed."""
    obs, d = tick.observation, tick.decision
    acc = obs.acceptance_rate
    previous = previous or {}
    if tick.frozen_by is not None and obs.config is not None:
        config = obs.config  # frozen, the engines may run a config set by hand: show what they run
    observed = {
        "acceptanceRate": None if acc is None else round(acc, 4),
        "ttftP95Ms": _ms(obs.ttft_p95_s),
        "tpotP95Ms": _ms(obs.tpot_p95_s),
        "goodput": None if d.observed_goodput is None else round(d.observed_goodput, 2),
        "requestRate": None if obs.request_rate is None else round(obs.request_rate, 3),
    }
    reason = d.reason
    if obs.lora_acceptance:  # the explanation names what the acceptance rate above is made of
        reason += "; draft acceptance by LoRA adapter: " + _listed(
            [f"{name} {acc:.2f}" for name, acc in obs.lora_acceptance]
        )
    goodput = adapter_goodput(obs, tick.slo) if tick.slo is not None else ()
    if goodput:  # beside it, what each adapter's requests got: output tokens/s within the SLO
        reason += "; goodput by LoRA adapter (SLO attainment): " + _listed(
            [f"{g.name} {g.goodput:.1f} tok/s ({g.attainment:.0%})" for g in goodput]
        )
    status: dict[str, Any] = {
        "reason": reason[:4000],
        "lastDecisionTime": now
        if d.changed or "lastDecisionTime" not in previous
        else previous["lastDecisionTime"],
        # What was not observed is left out (the CRD's fields are numbers, not nullable).
        "observed": {key: value for key, value in observed.items() if value is not None},
    }
    if d.changes_this_load is not None:
        status["changesThisLoad"] = d.changes_this_load
    if tick.frozen_by is not None:  # left out otherwise: the tuner's next apply drops the field
        status["frozenBy"] = tick.frozen_by
    if config is not None:
        status.update(
            {camel(name): value for name, value in LiveSettings(config, tick.guard).as_admin().items()}
        )
    return status


def tuned_condition(tick: Tick) -> Cond:
    d, applied = tick.decision, tick.applied
    if applied is not None and (applied.failed or applied.refused):
        bad = {**applied.failed, **applied.refused}
        detail = "; ".join(f"{url}: {err}" for url, err in list(bad.items())[:3])
        return Cond(
            "Tuned",
            "False",
            "ApplyFailed",
            f"could not apply {applied.config.short()} to {len(bad)} pod(s): {detail}",
        )
    if d.kind == "frozen":
        return Cond("Tuned", "False", "Frozen", d.reason)
    if d.kind == "missing":
        return Cond("Tuned", "False", "MetricsUnavailable", d.reason)
    if d.kind == "revert":
        return Cond("Tuned", "True", "Reverted", d.reason)
    if d.kind == "change":
        return Cond("Tuned", "True", "ConfigChanged", d.reason)
    return Cond("Tuned", "True", "Holding" if d.kind != "idle" else "Idle", d.reason)


def status_patch(
    tick: Tick,
    config: TunedConfig | None,
    status: dict[str, Any],
    generation: int,
    now: str,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The tuner's share of status for one interval: `tuning` and its own `Tuned` condition only (applied
    with the tuner's field manager; the reconcile's conditions are not in it, so it cannot overwrite them).
    `resume` is what a restarted tuner continues from (`policy/resume.py`)."""
    conditions = condition_entries(status.get("conditions") or [], [tuned_condition(tick)], generation, now)
    tuning = tuning_status(tick, config, status.get("tuning"), now)
    if resume is not None:
        tuning["resume"] = resume
    return {"tuning": tuning, "conditions": conditions}


def event_for(decision: Decision) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event a decision posts; None when nothing changed."""
    if decision.kind == "revert":
        return "Warning", "TuningReverted", decision.reason
    if decision.changed:
        return "Normal", "Tuned", decision.reason
    return None


def transition_events(tick: Tick) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events for what the tuner entered at this interval: frozen or
    resumed (someone froze or unfroze it), failing static (metrics missing) or recovered. Posted once per
    transition, beside `event_for`'s Event per change, so `kubectl describe` shows when tuning stopped
    and started again, and why."""
    d = tick.decision
    events = {
        "frozen": ("Normal", "TuningFrozen", d.reason),
        "resumed": ("Normal", "TuningResumed", f"freeze lifted; tuning again: {d.reason}"),
        "static": ("Warning", "TuningStatic", d.reason),
        "recovered": ("Normal", "TuningRecovered", f"metrics are back; tuning again: {d.reason}"),
    }
    return [events[t] for t in tick.transitions]


def autoscaling_status(
    decision: ReplicaDecision, previous: dict[str, Any] | None, now: str, cold_start_s: float | None = None
) -> dict[str, Any]:
    """`status.autoscaling`: the replica count the reconcile renders into the Deployment, and why; with
    the routers' measurement, the cold start of the last scale from zero (kept until a new one)."""
    previous = previous or {}
    last = now if decision.changed else previous.get("lastScaleTime")
    cold = round(cold_start_s, 3) if cold_start_s is not None else previous.get("coldStartSeconds")
    status = {
        REPLICAS.crd_name: decision.replicas,
        "reason": decision.reason[:4000],
        "lastScaleTime": last,
        "coldStartSeconds": cold,
    }
    return {k: v for k, v in status.items() if v is not None}  # an applied null is refused by the schema


def scale_event(decision: ReplicaDecision) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event a replica decision posts; None when the count stays."""
    return ("Normal", "Scaled", decision.reason) if decision.changed else None
