"""What a tuner needs to continue where it stopped (an operator restart, a new operator pod), as the JSON
`status.tuning.resume` holds: what the policy learned (the step-cost points of its fit, the drafts'
acceptance per load) and the spec it learned it under. The config in force and the guard are
`status.tuning`'s own knob fields, read back beside it.

Not kept: probation, cooldown and taboo. They are about the last few minutes and the load of then; a
restarted tuner judges afresh, from the config in force, which is what it would hold anyway.
"""

from __future__ import annotations

from typing import Any

from specfleet.engine.knobs import SEARCHED, camel

from ..types import TunedConfig
from .decide import Policy


def _round(value: float) -> float:
    return float(f"{value:.6g}")  # six digits: far below the fit's noise, and status stays small


def snapshot(policy: Policy, now: float, spec_hash: str) -> dict[str, Any]:
    """`status.tuning.resume` for `policy` at `now` (the policy's clock: ages, not times, are stored)."""
    memory = policy.memory
    return {
        "specHash": spec_hash,
        "costPoints": [[_round(x) for x in point] for point in memory.cost_points],
        "plainCostPoints": [[_round(x) for x in point] for point in memory.plain_cost_points],
        "acceptance": [
            {
                "demand": None if demand is None else _round(demand),
                "perPos": [_round(a) for a in per_pos],
                "share": _round(share),
                "ageSeconds": _round(max(0.0, now - seen_at)),
                "shadow": shadow,
            }
            for demand, per_pos, share, seen_at, shadow in memory.acceptance
        ],
    }


def restore(policy: Policy, tuning: dict[str, Any], now: float, spec_hash: str) -> bool:
    """Load what `status.tuning` says into a fresh `policy` when it was learned under the same spec
    (`specHash`); True when it did. A snapshot of another spec, or none, leaves the policy as built."""
    resume = tuning.get("resume") or {}
    if resume.get("specHash") != spec_hash:
        return False
    try:
        config = TunedConfig(**{k.name: int(tuning[camel(k.name)]) for k in SEARCHED})
        cost = [(float(d), float(p), float(s)) for d, p, s in resume.get("costPoints") or []]
        plain = [(float(d), float(p), float(s)) for d, p, s in resume.get("plainCostPoints") or []]
        acceptance = [
            (
                None if a.get("demand") is None else float(a["demand"]),
                tuple(float(x) for x in a["perPos"]),
                float(a["share"]),
                now - float(a["ageSeconds"]),
                bool(a.get("shadow", False)),  # absent: written before shadow drafts, so verified
            )
            for a in resume.get("acceptance") or []
        ]
    except (KeyError, TypeError, ValueError):
        return False  # written by another version, or by hand: start as built
    policy.current = policy.last_good = config
    guard = tuning.get("speculativeDisableByBatchSize")
    if isinstance(guard, int):
        policy.guard = guard
    memory = policy.memory
    memory.cost_points.extend(cost)
    memory.plain_cost_points.extend(plain)
    memory.acceptance.extend(acceptance)
    return True
