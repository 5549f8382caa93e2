"""What the policy learns from the windows it saw: the step cost (fitted) and the drafts' acceptance
(remembered per load level), and from them the goodput model at the load observed now."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from ..types import Observation
from .load import similar
from .model import LoadModel, StepCost, fit_step_cost
from .params import ModelParams, PolicyParams

# One window's acceptance: (requests in the system, P(position i accepted | a draft), share of
# sequence-steps or lookups with a draft, time, whether the engines' shadow drafts measured it)
Acceptance = tuple[float | None, tuple[float, ...], float, float, bool]


class Memory:
    def __init__(self, params: ModelParams) -> None:
        self.cost_points: deque[tuple[float, float, float]] = deque(
            maxlen=params.cost_windows
        )  # (decode, prefill, s)
        # The same from windows without proposals: the target's own step, free of any proposer's cost.
        self.plain_cost_points: deque[tuple[float, float, float]] = deque(maxlen=params.cost_windows)
        # (demand, per_pos, share, time, shadow) of recent windows that verified drafts, or with speculation
        # off, scored the engines' shadow drafts (the n-gram lookups they score while verifying none)
        self.acceptance: deque[Acceptance] = deque(maxlen=params.acceptance_windows)
        # the fits of the points above, by the points they were fitted to (one fit per learned window,
        # however often an interval asks: a fit tries every shape and ratio of `model.py`)
        self._fits: dict[tuple[ModelParams, tuple[tuple[float, float, float], ...]], StepCost | None] = {}

    def learn(self, obs: Observation) -> None:
        if obs.step_duration_s and obs.batch_size and obs.step_rate:
            drafted = (obs.draft_token_rate or 0.0) / obs.step_rate
            prefill = (obs.prompt_rate or 0.0) / obs.step_rate
            self.cost_points.append((obs.batch_size + drafted, prefill, obs.step_duration_s))
            if not drafted:
                self.plain_cost_points.append((obs.batch_size, prefill, obs.step_duration_s))
            self._fits.clear()
        share = obs.proposal_share
        if share is not None and obs.accepted_per_pos:
            self.acceptance.append((obs.demand, tuple(obs.accepted_per_pos), share, obs.time, False))
        elif (shadow := obs.shadow_share) is not None and obs.shadow_accepted_per_pos:
            # the traffic of this very window, where the acceptance remembered for its load may come
            # from other prompts (a copy-heavy level's drafts, read at a chat level of the same size)
            self.acceptance.append((obs.demand, tuple(obs.shadow_accepted_per_pos), shadow, obs.time, True))

    def knee(self, params: ModelParams) -> float:
        """Tokens per step where the target's step turns compute-bound, from windows without proposals
        (with them, a draft's passes would read as compute); the prior's knee until there are some."""
        plain = self._fit(self.plain_cost_points, params)
        if plain is None or plain.c1 <= 0:
            return 1.0 / params.prior_cost_ratio
        return plain.knee

    def _fit(self, points: deque[tuple[float, float, float]], params: ModelParams) -> StepCost | None:
        key = (params, tuple(points))
        if key not in self._fits:
            self._fits[key] = fit_step_cost(list(points), params)
        return self._fits[key]

    def model(self, obs: Observation, params: PolicyParams) -> LoadModel | None:
        """The goodput model at `obs`'s load: the step cost fitted to every window, the acceptance last
        measured at a load like this one within `acceptance_ttl_s` (or in this very window), else the prior."""
        cost = self._fit(self.cost_points, params.model)
        if cost is None or obs.demand is None:
            return None
        per_pos: tuple[float, ...] = ()
        share, shadow = params.model.prior_proposal_share, False
        for demand, pos, seen_share, seen_at, seen_shadow in reversed(self.acceptance):
            if seen_at == obs.time or (
                obs.time - seen_at <= params.acceptance_ttl_s and similar(demand, obs.demand, params)
            ):
                per_pos, share, shadow = pos, seen_share, seen_shadow
                break
        prefill = (obs.prompt_rate or 0.0) / obs.generation_rate if obs.generation_rate else 0.0
        return LoadModel(
            obs.demand,
            per_pos,
            share,
            prefill,
            cost,
            obs.engines,
            params.model,
            shadow,
            obs.lora_runnable_share,
        )

    def model_at(self, obs: Observation, load: float, params: PolicyParams) -> LoadModel | None:
        """The model at `load` requests in the system, none waiting (a load the window has not seen yet)."""
        return self.model(replace(obs, running=load, waiting=0.0), params)
