"""The eviction phase's per-decision figures (bench/route_eviction.py): at each routing decision, what the
router's estimate believes each engine holds, what the engine really holds (the exact index from its KV
events), and which engine each index would pick on that same state.

`ShadowedPolicy` wraps the prefix policy as shipped and changes none of its decisions: after the real
`choose` (on whichever index the run routes on) it asks the same policy twice more, once with the exact
index and once without (its estimate), and records where the two picks part. The engines' holdings come
from the exact index in both modes (the run on the estimate subscribes too, and only its routing ignores
the index), so both runs are measured alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specfleet.router.endpoints import Endpoint
from specfleet.router.policies import Choice, PrefixAffinity, RouteRequest, load_cap

Truth = Callable[[str, Sequence[int]], int | None]  # url, hashes -> leading blocks held (None: no events yet)


@dataclass(frozen=True)
class Decision:
    session: str | None
    reason: str  # the real choice's (policies.REASONS)
    prompt_blocks: int
    believed: int  # blocks the routing index said the chosen engine held (Choice.match_blocks)
    held: int  # blocks the chosen engine really held (its KV events)
    best_held: int  # the most blocks any engine really held
    cap_bound: bool  # an engine was over the load cap: the policy could not go everywhere
    differ: bool  # the exact index and the estimate pick different engines on this state
    believed_engines: int = 0  # engines the estimate believes hold blocks of the prompt
    holding_engines: int = 0  # engines that really hold some


@dataclass
class DecisionLog:
    decisions: list[Decision] = field(default_factory=list)

    def figures(self) -> dict[str, float | dict[str, int]]:
        """Counts over the decisions: how often the picks part, how often the routing index was stale at
        its pick, how often a prefix held on another engine was not found where the request went."""
        ds = self.decisions
        return {
            "decisions": len(ds),
            "reasons": dict(Counter(d.reason for d in ds)),
            "cap_bound": sum(d.cap_bound for d in ds),
            "picks_differ": sum(d.differ for d in ds),
            # the index the run routed on believed more blocks at its pick than that engine held
            "stale_at_pick": sum(d.believed > d.held for d in ds),
            # the chosen engine held fewer of the prompt's blocks than another engine did
            "held_longer_elsewhere": sum(d.held < d.best_held for d in ds),
            # the state the exact index is for: the estimate believes the prompt on several engines, and
            # some of them evicted it while another still holds it
            "believed_on_several_held_on_fewer": sum(
                d.believed_engines > 1 and 0 < d.holding_engines < d.believed_engines for d in ds
            ),
            "prompt_blocks": sum(d.prompt_blocks for d in ds),
            "held_blocks": sum(d.held for d in ds),
            "best_held_blocks": sum(d.best_held for d in ds),
        }


class ShadowedPolicy:
    """The prefix policy, its decisions unchanged, each one also taken on the exact index and on the
    estimate to see where they part (a RoutingPolicy: the router calls it as it calls the policy)."""

    def __init__(self, policy: PrefixAffinity, truth: Truth) -> None:
        self.policy = policy
        self.name = policy.name
        self.truth = truth
        self.log = DecisionLog()

    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Choice | None:
        choice = self.policy.choose(request, endpoints)
        # only a completion's prompt is hashed as the engine hashes it: the only requests the index decides
        if choice is None or not request.hashes or not request.engine_hashes or request.adapter is not None:
            return choice
        routing = self.policy.exact
        try:
            self.policy.exact = self.truth
            on_events = self.policy.choose(request, endpoints)
            self.policy.exact = None
            on_estimate = self.policy.choose(request, endpoints)
        finally:
            self.policy.exact = routing
        held = {e.url: self.truth(e.url, request.hashes) or 0 for e in endpoints}
        believed = [self.policy.index.match(e.url, request.hashes) for e in endpoints]
        cap = load_cap(endpoints, self.policy.load_factor)
        self.log.decisions.append(
            Decision(
                session=request.session,
                reason=choice.reason,
                prompt_blocks=len(request.hashes),
                believed=choice.match_blocks,
                held=held[choice.url],
                best_held=max(held.values()),
                cap_bound=any(e.outstanding + 1 > cap for e in endpoints),
                differ=on_events is not None and on_estimate is not None and on_events.url != on_estimate.url,
                believed_engines=sum(b > 0 for b in believed),
                holding_engines=sum(h > 0 for h in held.values()),
            )
        )
        return choice

    def routed(self, request: RouteRequest, url: str) -> None:
        self.policy.routed(request, url)

    def forget(self, url: str) -> None:
        self.policy.forget(url)
