"""Workloads: a trace of requests (arrival, prompt and output lengths, prefix group), replayed or generated.

A trace is JSONL, one request a line: `{"arrival_s": 0.42, "prompt_tokens": 312, "output_tokens": 96,
"prefix_group": 3, "prefix_tokens": 256}` (the last two optional: requests of one group share their first
`prefix_tokens` prompt tokens, which is what the prefix cache sees). `specfleet bench serve --trace-out`
records one from a real run. Synthetic workloads draw arrivals (Poisson, or gamma with a coefficient of
variation) from a piecewise-constant rate schedule, and lengths from fixed/uniform/lognormal laws.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The token ids a simulated prompt is made of (the block manager hashes them, nothing decodes them): a
# group's shared prefix is negative ids of the group, the rest positive ids of the request, so the real
# prefix cache hits exactly on the shared part. Prompts stay below the stride.
_STRIDE = 10_000_000


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    prefix_tokens: int = 0  # leading prompt tokens shared with every request of the group
    adapter: str | None = None  # the LoRA adapter the request names (sim/lora.py); None: the base model

    def __post_init__(self) -> None:
        if not (
            isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s) and self.arrival_s >= 0
        ):
            raise ValueError(f"arrival_s={self.arrival_s!r} must be a finite number >= 0")
        if not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={self.prompt_tokens!r} must be an integer >= 1")
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise ValueError(f"output_tokens={self.output_tokens!r} must be an integer >= 1")
        if not isinstance(self.prefix_tokens, int) or not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(
                f"prefix_tokens={self.prefix_tokens!r} must be an integer between 0 and "
                f"prompt_tokens={self.prompt_tokens}"
            )
        if self.prefix_tokens and self.prefix_group is None:
            raise ValueError("prefix_tokens > 0 needs a prefix_group")

    def prompt_ids(self, index: int) -> list[int]:
        """The prompt as token ids: the group's shared prefix, then ids unique to request `index`."""
        shared = self.prefix_tokens if self.prefix_group is not None else 0
        group = -((self.prefix_group or 0) + 1) * _STRIDE
        return [
            *range(group, group - shared, -1),
            *range(index * _STRIDE + shared + 1, index * _STRIDE + self.prompt_tokens + 1),
        ]


# Every output token is this id: a block's cache key chains its parent's, so outputs of different requests
# never collide in the prefix cache however alike their ids.
OUTPUT_ID = 0


def load_trace(path: str | Path) -> list[SimRequest]:
    """A JSONL trace, sorted by arrival; a bad line is refused with its number and the field."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                known = {"arrival_s", "prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens"}
                unknown = set(row) - known
                if unknown:
                    raise ValueError(f"unknown field(s) {sorted(unknown)}; use {sorted(known)}")
                out.append(SimRequest(**row))
            except (json.JSONDecodeError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    if not out:
        raise ValueError(f"{path}: the trace holds no request")
    return sorted(out, key=lambda r: r.arrival_s)


def save_trace(requests: Iterable[SimRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            row = {
                k: v for k, v in asdict(r).items() if v is not None and not (k == "prefix_tokens" and v == 0)
            }
            f.write(json.dumps(row) + "\n")


@dataclass(frozen=True)
class Lengths:
    """A length law: fixed (`low`), uniform in [low, high], or lognormal with median `low` and sigma,
    clipped to [1, high]."""

    law: str = "fixed"
    low: int = 128
    high: int = 128
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if self.law not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length law {self.law!r} must be fixed, uniform or lognormal")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths low={self.low}, high={self.high} must satisfy 1 <= low <= high")

    def draw(self, rng: random.Random) -> int:
        if self.law == "fixed":
            return self.low
        if self.law == "uniform":
            return rng.randint(self.low, self.high)
        return max(1, min(self.high, round(self.low * math.exp(rng.gauss(0.0, self.sigma)))))


@dataclass(frozen=True)
class Synthetic:
    """Arrivals at `rates` [(from second, requests/s), ...] for `duration_s`; `cv` 1 is Poisson, other
    values a gamma process with that coefficient of variation (burstier above 1). A share `prefix_share`
    of requests belongs to one of `prefix_groups` groups, sharing its first `prefix_tokens` tokens."""

    rates: tuple[tuple[float, float], ...] = ((0.0, 1.0),)
    duration_s: float = 60.0
    cv: float = 1.0
    prompt: Lengths = field(default_factory=lambda: Lengths("uniform", 64, 512))
    output: Lengths = field(default_factory=lambda: Lengths("uniform", 32, 256))
    prefix_groups: int = 0
    prefix_tokens: int = 0
    prefix_share: float = 0.0
    seed: int = 0
    adapters: int = 0  # requests spread evenly at random over this many LoRA adapters (0: the base model)

    def __post_init__(self) -> None:
        if not self.rates or self.rates[0][0] != 0.0:
            raise ValueError(f"rates={self.rates!r} must start at second 0")
        if any(r < 0 for _, r in self.rates) or any(b[0] <= a[0] for a, b in zip(self.rates, self.rates[1:])):
            raise ValueError(f"rates={self.rates!r}: rates must be >= 0 and start times increasing")
        if self.adapters < 0:
            raise ValueError(f"adapters={self.adapters} must be >= 0")
        if self.duration_s <= 0 or self.cv <= 0:
            raise ValueError(f"duration_s={self.duration_s} and cv={self.cv} must be > 0")
        if not 0.0 <= self.prefix_share <= 1.0 or (self.prefix_share and self.prefix_groups < 1):
            raise ValueError(
                f"prefix_share={self.prefix_share} must be in [0, 1] and needs prefix_groups >= 1"
            )

    def rate_at(self, t: float) -> float:
        rate = 0.0
        for start, r in self.rates:
            if t >= start:
                rate = r
        return rate

    def requests(self) -> Iterator[SimRequest]:
        """Thinning a gamma renewal process at the peak rate: exact for Poisson, the shape kept otherwise."""
        rng = random.Random(self.seed)
        peak = max(r for _, r in self.rates)
        if peak <= 0:
            return
        shape = 1.0 / (self.cv * self.cv)
        t = 0.0
        while True:
            t += rng.gammavariate(shape, 1.0 / (shape * peak))
            if t >= self.duration_s:
                return
            if rng.random() * peak > self.rate_at(t):
                continue
            prompt = self.prompt.draw(rng)
            group, shared = None, 0
            if self.prefix_share and rng.random() < self.prefix_share:
                group = rng.randrange(self.prefix_groups)
                shared = min(self.prefix_tokens, prompt - 1)
                prompt = max(prompt, shared + 1)
            output = self.output.draw(rng)
            adapter = f"adapter-{rng.randrange(self.adapters)}" if self.adapters else None
            yield SimRequest(round(t, 6), prompt, output, group, shared, adapter)


def parse_lengths(text: str) -> Lengths:
    """`fixed:128`, `uniform:32-256` or `lognormal:200-2048[:0.6]` (median-max[:sigma])."""
    law, _, rest = text.partition(":")
    try:
        parts = rest.split(":")
        low, _, high = parts[0].partition("-")
        sigma = float(parts[1]) if len(parts) > 1 else 0.5
        return Lengths(law, int(low), int(high or low), sigma)
    except ValueError as error:
        raise ValueError(
            f"lengths {text!r}: {error}; use fixed:N, uniform:LOW-HIGH or lognormal:MEDIAN-MAX[:SIGMA]"
        ) from None


def parse_rates(text: str) -> tuple[tuple[float, float], ...]:
    """`5` (constant) or `0:2,60:8,120:1` (from second: rate)."""
    try:
        if ":" not in text:
            return ((0.0, float(text)),)
        return tuple((float(a), float(b)) for a, b in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise ValueError(
            f"rates {text!r}: use a number (requests/s) or FROM_S:RATE,FROM_S:RATE,..."
        ) from None
