"""The tuner's plain data: the config it tunes, what it observes per interval, and what it decides.

Sources (Prometheus, direct scrape) produce `Observation`s; the policy turns them into `Decision`s; the
actuator pushes `TunedConfig`s to engines. Times are seconds, latencies seconds, rates per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# A latency distribution as its cumulative histogram: [(upper bound in seconds, fraction <= bound)].
Cdf = list[tuple[float, float]]


@dataclass(frozen=True)
class TunedConfig:
    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def as_admin(self) -> dict[str, int]:
        """The body of `PATCH /admin/config`."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }

    @classmethod
    def from_admin(cls, body: dict[str, int]) -> TunedConfig:
        return cls(int(body["num_speculative_tokens"]), int(body["max_num_seqs"]), int(body["max_num_batched_tokens"]))

    def with_(self, **changes: int) -> TunedConfig:
        return replace(self, **changes)

    def short(self) -> str:
        return f"k={self.num_speculative_tokens} seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens}"


@dataclass(frozen=True)
class TuneBounds:
    """Inclusive [min, max] per knob: the spec's autotune.bounds intersected with the engine's ceilings."""

    k: tuple[int, int] = (0, 8)
    max_num_seqs: tuple[int, int] = (8, 256)
    max_num_batched_tokens: tuple[int, int] = (512, 8192)

    def __post_init__(self) -> None:
        for name in ("k", "max_num_seqs", "max_num_batched_tokens"):
            low, high = getattr(self, name)
            if low > high or low < 0:
                raise ValueError(f"tuner bounds {name}=({low}, {high}) must satisfy 0 <= min <= max")

    def clamp(self, config: TunedConfig) -> TunedConfig:
        def c(value: int, pair: tuple[int, int]) -> int:
            return max(pair[0], min(pair[1], value))

        return TunedConfig(
            c(config.num_speculative_tokens, self.k),
            c(config.max_num_seqs, self.max_num_seqs),
            c(config.max_num_batched_tokens, self.max_num_batched_tokens),
        )

    def contains(self, config: TunedConfig) -> bool:
        return self.clamp(config) == config


@dataclass(frozen=True)
class SLO:
    ttft_p95_s: float
    tpot_p95_s: float


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
    error: str | None = None  # the source could not be read (Prometheus down, every pod unreachable)

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
    def engines(self) -> int:
        """Engines the load is spread over (evenly: the router sends each request to the least busy)."""
        return max(self.pods, 1)

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
    kind: str  # change | revert | hold | missing | idle | cooldown | init
    predicted_goodput: float | None = None
    observed_goodput: float | None = None
    slo_attainment: float | None = None

    @property
    def changed(self) -> bool:
        return self.config is not None
