"""The wording of every decision: what was seen, what was done, and the numbers behind it. Each function
returns the `reason` of one kind of decision (it goes to `status.tuning.reason`, the Event and the log)."""

from __future__ import annotations

from ..types import Observation, TuneBounds, TunedConfig
from .candidates import Scored


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def figures(obs: Observation, goodput: float | None, share: float | None) -> str:
    """What the window measured, appended to the reasons of the search's decisions."""
    acc = obs.acceptance_rate
    if acc is not None:
        acceptance = f"{acc:.2f}"
    elif obs.shadow_accepted_per_pos:  # speculation off: what the shadow drafts' first tokens did
        acceptance = "shadow " + "/".join(f"{a:.2f}" for a in obs.shadow_accepted_per_pos[:3])
    else:
        acceptance = "n/a"
    return (
        f"observed goodput {'n/a' if goodput is None else f'{goodput:.1f}'} tok/s, "
        f"SLO attainment {'n/a' if share is None else f'{share:.0%}'}, "
        f"TPOT p95 {ms(obs.tpot_p95_s)}, TTFT p95 {ms(obs.ttft_p95_s)}, "
        f"in system {obs.demand or 0:.1f}, acceptance {acceptance}"
    )


def adapter_slots(obs: Observation, cap: int | None) -> str:
    """The clause that says adapter slots bound the batch (`load.adapter_cap`); empty when they do not."""
    if cap is None:
        return ""
    return (
        f"; adapter slots bind: {obs.lora_adapters or 0:.1f} adapters in demand per engine for "
        f"{obs.lora_slots or 0:.0f} slots (--max-loras), {obs.lora_runnable_share:.0%} of the requests can "
        f"run, so max_num_seqs is searched up to {cap} only"
    )


def fail_static(why: str, held: TunedConfig | None) -> str:
    return why + (f"; holding {held.short()} (fail static)" if held is not None else "")


def frozen(by: str, held: TunedConfig | None) -> str:
    what = held.short() if held is not None else "what the engines run"
    return f"frozen by {by}: holding {what}; no change and nothing pushed until the freeze is lifted"


# -- steps 1-2: nothing to decide on ----------------------------------------------------------------


def no_observation(obs: Observation | None) -> str:
    return f"no observation ({obs.error if obs else 'none'})"


UNKNOWN_CONFIG = "the config in force is unknown (no pod reported it)"
IDLE = "no traffic in the window; nothing to tune on"
NO_ENGINE = (
    "no engine is ready (scaled to zero, or its pods are still starting): nothing to observe or tune; "
    "holding the config"
)
METRICS_MISSING = "latency, throughput or queue metrics missing from the window"
NO_STEP_COST = "no step duration or batch size in the window to model step cost"


def out_of_bounds(config: TunedConfig, bounds: TuneBounds) -> str:
    return f"{config.short()} lies outside the bounds {bounds}; moved inside"


# -- step 3: load shift -----------------------------------------------------------------------------


def shifting(before: float, after: float) -> str:
    return f"load shifting: {after:.0f} requests in the system now against {before:.1f} over the window"


def shift_off(current: TunedConfig, off: TunedConfig, what: str, batch: float, knee: float) -> str:
    return (
        f"{current.short()} -> {off.short()}: {what}; {batch:.0f} sequences per step are past the step "
        f"cost's knee ({knee:.0f} tokens), where speculation costs compute: off now, searched afresh at "
        "the first window at the new load"
    )


def shift_on(current: TunedConfig, on: TunedConfig, what: str, batch: float, knee: float, gain: float) -> str:
    return (
        f"{current.short()} -> {on.short()}: {what}; {batch:.0f} sequences per step are under the step "
        f"cost's knee ({knee:.0f} tokens) with speculation off: predicted goodput {gain:+.0%} at the new "
        "load; on now, searched afresh at the first window at the new load"
    )


def shift_hold(current: TunedConfig, what: str) -> str:
    return f"{what}; holding {current.short()} until a window at one load"


# -- steps 4-5: cooldown and probation --------------------------------------------------------------


def cooldown(left_s: float) -> str:
    return f"cooldown: {left_s:.0f}s until a window without samples from before the last change"


def revert(
    tried: TunedConfig,
    previous: TunedConfig,
    lost: bool,
    goodput: float | None,
    share: float | None,
    baseline_goodput: float | None,
    baseline_attainment: float | None,
) -> str:
    what = (
        f"goodput {goodput:.1f} < {baseline_goodput:.1f} tok/s before"
        if lost
        else f"SLO attainment {share:.0%} < {baseline_attainment:.0%} before"
    )
    return f"reverted {tried.short()}: {what}; back to {previous.short()}"


# -- steps 6-7: search and probes -------------------------------------------------------------------


def nothing_left(current: TunedConfig) -> str:
    return (
        f"keeping {current.short()}: no other config within the bounds that was not measured worse at "
        "this load"
    )


def none_meets(current: TunedConfig, limit_s: float) -> str:
    return (
        f"no candidate keeps TPOT p95 under {limit_s * 1000:.0f} ms or lowers it; holding {current.short()}"
    )


def to_replicas(current: TunedConfig, requests_per_engine: float) -> str:
    return (
        f"holding {current.short()}: capacity is the replica knob's while it can add replicas; no "
        f"max_num_seqs below the {requests_per_engine:.0f} requests per engine (they would wait instead)"
    )


def towards_target(
    current: TunedConfig, fastest: Scored, obs: Observation, target_s: float, seen: str
) -> str:
    return (
        f"{current.short()} -> {fastest.config.short()}: TPOT p95 {ms(obs.tpot_p95_s)} over target "
        f"{ms(target_s)}, no config one step away meets it; predicted {ms(fastest.tpot_p95_s)}; "
        f"{seen}"
    )


def better(
    current: TunedConfig,
    best: Scored,
    obs: Observation,
    target_s: float,
    gain: float,
    for_tpot: bool,
    seen: str,
) -> str:
    why = (
        f"TPOT p95 {ms(obs.tpot_p95_s)} over target {ms(target_s)}"
        if for_tpot
        else f"predicted goodput +{gain:.0%}"
    )
    return (
        f"{current.short()} -> {best.config.short()}: {why} "
        f"(predicted {best.goodput:.1f} tok/s, TPOT p95 {ms(best.tpot_p95_s)}); {seen}"
    )


def probe(current: TunedConfig, config: TunedConfig, why: str, gain: float, seen: str) -> str:
    return (
        f"{current.short()} -> {config.short()}: {why} (best alternative predicted {gain:+.0%}); kept "
        f"unless measured goodput drops; {seen}"
    )


def dead_band(
    current: TunedConfig, best: Scored, gain: float, band: float, inherited: bool, seen: str
) -> str:
    whose = ", the config this load level inherited" if inherited else ""
    return (
        f"keeping {current.short()}: best alternative {best.config.short()} predicts {gain:+.0%} "
        f"(dead band {band:.0%}{whose}); {seen}"
    )


def probe_off(batch: float, knee: float) -> str:
    return (
        f"probing speculation off: {batch:.0f} sequences per step are past the step cost's knee "
        f"({knee:.0f} tokens), where what proposing costs (a draft model's own passes) can outweigh what "
        "it saves and the model cannot see it"
    )


def probe_up(last: float, tokens: float, knee: float) -> str:
    return (
        f"probing a longer draft: its last position is still accepted {last:.0%} of the time and the "
        f"verification step ({tokens:.1f} tokens) is under the knee ({knee:.0f} tokens), where more "
        "draft tokens cost little and the model's extrapolation past the measured positions is a guess"
    )


def probe_down(last: float) -> str:
    return (
        f"probing a shorter draft: its last position is accepted only {last:.0%} of the time, and what "
        "a rarely accepted draft token costs (a longer verification, the proposer's work) is below what "
        "the step-cost model resolves"
    )


# -- engines --------------------------------------------------------------------------------------------


def refused(config: TunedConfig, error: str, back_to: TunedConfig | None) -> str:
    return f"engines refused {config.short()}: {error}" + (f"; back to {back_to.short()}" if back_to else "")


def budget_spent(current: TunedConfig, wanted: str, changes: int, budget: int) -> str:
    return (
        f"holding {current.short()}: {wanted}, but {changes} change(s) since the load last moved leave no room "
        f"for it and the revert it may need (at most {budget} per load level)"
    )
