"""The tuner's plain data: the config it tunes, what it observes per interval, and what it decides.

Sources (Prometheus, direct scrape) produce `Observation`s; the policy turns them into `Decision`s; the
actuator pushes `TunedConfig`s to engines. Times are seconds, latencies seconds, rates per second.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from specfleet.engine.knobs import RULED, SEARCHED, Knob, check_fields

# A latency distribution as its cumulative histogram: [(upper bound in seconds, fraction <= bound)].
Cdf = list[tuple[float, float]]


@dataclass(frozen=True)
class TunedConfig:
    """One point of the tuner's search space: a value for every searched knob (`knobs.SEARCHED`).

    The fields are written out for the type checker; the import-time check below keeps them equal to the
    declaration, and every method walks the declaration."""

    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def as_admin(self) -> dict[str, int]:
        """The body of `PATCH /admin/config`."""
        return {knob.name: getattr(self, knob.name) for knob in SEARCHED}

    @classmethod
    def from_admin(cls, body: Mapping[str, float]) -> TunedConfig:
        return cls(**{knob.name: int(body[knob.name]) for knob in SEARCHED})

    def with_(self, **changes: int) -> TunedConfig:
        return replace(self, **changes)

    def short(self) -> str:
        return " ".join(f"{knob.label}={getattr(self, knob.name)}" for knob in SEARCHED)


check_fields(TunedConfig, tuple(k.name for k in SEARCHED), "one per searched knob")


@dataclass(frozen=True)
class LiveSettings:
    """What the tuner makes every engine run: the searched config, plus each knob a policy rule sets
    rather than searches (`knobs.RULED`; None leaves the engine's own value alone).

    `speculative_disable_by_batch_size` is the guard: set from the load and the step cost's knee every
    interval, never searched, so it is not part of `TunedConfig` (a guard that moves with the load is not a
    config change the policy has to put on probation, remember or forbid)."""

    config: TunedConfig
    speculative_disable_by_batch_size: int | None = None

    def as_admin(self) -> dict[str, int]:
        """The body of `PATCH /admin/config`."""
        ruled = {knob.name: getattr(self, knob.name) for knob in RULED}
        return {
            **self.config.as_admin(),
            **{name: value for name, value in ruled.items() if value is not None},
        }


check_fields(LiveSettings, ("config", *(k.name for k in RULED)), "the config, then one per ruled knob")


@dataclass(frozen=True, init=False)
class TuneBounds:
    """Inclusive [min, max] per searched knob: the spec's autotune.bounds intersected with the engine's
    ceilings. Keyword arguments name a knob or its label (`k=(0, 4)`); a knob left out keeps the
    declaration's default range; an unknown name is refused. Read a range as `bounds.k`,
    `bounds.max_num_seqs` or `bounds["max_num_seqs"]`."""

    ranges: tuple[tuple[int, int], ...]  # in the order of knobs.SEARCHED

    def __init__(self, **ranges: tuple[int, int] | list[int]) -> None:
        given = {_searched(key).name: (int(pair[0]), int(pair[1])) for key, pair in ranges.items()}
        for knob in SEARCHED:
            low, high = given.get(knob.name, knob.search or (0, 0))
            if low > high or low < 0:
                raise ValueError(
                    f"tuner bounds {_key(ranges, knob)}=({low}, {high}) must satisfy 0 <= min <= max"
                )
        object.__setattr__(self, "ranges", tuple(given.get(k.name, k.search or (0, 0)) for k in SEARCHED))

    def __getitem__(self, name: str) -> tuple[int, int]:
        return self.ranges[SEARCHED.index(_searched(name))]

    def __getattr__(self, name: str) -> tuple[int, int]:
        if name.startswith("_") or name == "ranges":
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(str(error)) from None

    def clamp(self, config: TunedConfig) -> TunedConfig:
        def c(value: int, pair: tuple[int, int]) -> int:
            return max(pair[0], min(pair[1], value))

        return TunedConfig(
            **{k.name: c(getattr(config, k.name), pair) for k, pair in zip(SEARCHED, self.ranges)}
        )

    def contains(self, config: TunedConfig) -> bool:
        return self.clamp(config) == config


def _searched(key: str) -> Knob:
    """A searched knob by name or label; anything else is refused with the list of both."""
    for knob in SEARCHED:
        if key in (knob.name, knob.label):
            return knob
    known = sorted({*(k.name for k in SEARCHED), *(k.label for k in SEARCHED)})
    raise KeyError(f"{key!r} is not a searched knob; use one of {known}")


def _key(given: Mapping[str, object], knob: Knob) -> str:
    return knob.label if knob.label in given else knob.name


@dataclass(frozen=True)
class SLO:
    ttft_p95_s: float
    tpot_p95_s: float


@dataclass(frozen=True)
class AdapterRequests:
    """One served LoRA adapter's finished requests over the window, pods summed (the engines'
    `specfleet_lora_generation_tokens_total` and per-adapter TTFT and TPOT histograms): its goodput's
    inputs, read against the SLO as the service's own (`policy.model.adapter_goodput`)."""

    name: str
    generation_rate: float  # output tokens/s of its finished requests
    ttft_cdf: Cdf
    tpot_cdf: Cdf


@dataclass(frozen=True)
class Observation:
    """One service over one rate window ending at `time`. None means "not measurable in this window"."""

    time: float
    config: TunedConfig | None  # the config in force on every reporting pod (None: pods disagree/unknown)
    pods: int = 0  # pods that answered
    request_rate: float | None = None  # finished requests/s
    generation_rate: float | None = None  # output tokens/s
    prompt_rate: float | None = None  # prompt tokens computed/s
    running: float | None = None  # requests in the running batch, summed over pods
    waiting: float | None = None
    in_system_now: float | None = None  # running + waiting at the window's end (gauges), to see a load shift
    kv_usage: float | None = None  # max over pods
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    ttft_cdf: Cdf = field(default_factory=list)
    tpot_cdf: Cdf = field(default_factory=list)
    step_rate: float | None = None  # engine steps/s, summed over pods
    step_duration_s: float | None = None  # mean step duration
    batch_size: float | None = None  # mean sequences per step
    draft_rate: float | None = None  # drafts/s (sequence-steps that carried a proposal)
    draft_token_rate: float | None = None
    accepted_rate: float | None = None
    accepted_per_pos: tuple[float, ...] = ()  # P(position i accepted | a draft), i = 0..
    # The same for the engines' shadow drafts: n-gram lookups scored on steps that verified none
    shadow_lookup_rate: float | None = None  # lookups/s, a draft found or not
    shadow_draft_rate: float | None = None  # of those, drafts found /s
    shadow_accepted_per_pos: tuple[float, ...] = ()
    error: str | None = None  # the source could not be read (Prometheus down, every pod unreachable)
    # LoRA (vllm:lora_requests_info, per engine, mean over pods): adapter slots a step may mix (--max-loras)
    # and adapters with requests running or waiting
    lora_slots: float | None = None
    lora_adapters: float | None = None
    # Draft acceptance per served adapter over the window, (name, accepted / drafted) sorted by name: the
    # draft runs without the adapter, so each adapter's requests accept a different share (engines'
    # specfleet_lora_spec_decode_*_tokens_total, pods summed; adapters with no drafts left out)
    lora_acceptance: tuple[tuple[str, float], ...] = ()
    # Finished requests per served adapter over the window, sorted by name (adapters with none left out)
    lora_requests: tuple[AdapterRequests, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        if not self.draft_token_rate or self.accepted_rate is None:
            return None
        return self.accepted_rate / self.draft_token_rate

    @property
    def proposal_share(self) -> float | None:
        """Share of sequence-steps that carried a draft (n-gram finds no match on some)."""
        if not (self.draft_rate and self.step_rate and self.batch_size):
            return None
        return min(1.0, self.draft_rate / (self.step_rate * self.batch_size))

    @property
    def shadow_share(self) -> float | None:
        """Share of shadow lookups that found a draft: the proposal share speculation would have."""
        if not (self.shadow_lookup_rate and self.shadow_draft_rate is not None):
            return None
        return min(1.0, self.shadow_draft_rate / self.shadow_lookup_rate)

    @property
    def engines(self) -> int:
        """Engines the load is spread over (evenly: the router sends each request to the least busy)."""
        return max(self.pods, 1)

    @property
    def lora_runnable_share(self) -> float:
        """Share of the demand the engines' adapter slots let into a batch: with more adapters in demand than
        --max-loras, requests for the others wait for a slot whatever max_num_seqs is (adapters taken as
        evenly loaded; base-model requests, which need no slot, are not told apart by the gauge)."""
        if not self.lora_slots or not self.lora_adapters or self.lora_adapters <= self.lora_slots:
            return 1.0
        return self.lora_slots / self.lora_adapters

    @property
    def demand(self) -> float | None:
        """Requests in the system (running + waiting): the load the config is serving."""
        if self.running is None:
            return None
        return self.running + (self.waiting or 0.0)


@dataclass(frozen=True)
class Decision:
    """What the policy wants now. `config` is None for "no change"; `reason` always says why."""

    time: float
    config: TunedConfig | None
    reason: str
    kind: str  # change | revert | hold | missing | idle | cooldown | init | frozen
    predicted_goodput: float | None = None
    observed_goodput: float | None = None
    slo_attainment: float | None = None
    changes_this_load: int | None = (
        None  # config changes since the load last moved (the policy's churn count)
    )

    @property
    def changed(self) -> bool:
        return self.config is not None
