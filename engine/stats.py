"""Engine statistics: cumulative counters and per-step gauges, read by /metrics and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from specfleet.engine.spec_decode.request_classes import RequestCounts


@dataclass
class StepStats:
    """What one `Engine.step()` did."""

    duration_s: float = 0.0
    batch_size: int = 0  # sequences in the forward pass
    num_scheduled_tokens: int = 0
    num_running: int = 0  # after the step
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced
    num_preemptions: int = 0
    num_priority_preemptions: int = 0  # of those, displaced by a higher-priority arrival (request_queue.py)
    prompt_tokens: int = 0  # prompt tokens computed this step
    generation_tokens: int = 0  # tokens emitted this step
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class EngineStats:
    """Totals since start. Counters only ever grow."""

    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_priority_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # n-gram drafts scored on steps that verified none (spec_decode/shadow.py)
    shadow_lookups: int = 0
    shadow_drafts: int = 0
    shadow_accepted_per_pos: list[int] = field(default_factory=list)
    # finished requests' speculation by class of acceptance (spec_decode/request_classes.py); empty without
    # a speculative method
    request_classes: list[RequestCounts] = field(default_factory=list)
    peak_kv_slots_allocated: int = 0  # slots in allocated blocks, at the peak
    peak_kv_slots_used: int = 0  # of those, slots holding a token, at the same moment
    peak_micro_batches_in_flight: int = 0  # pipeline parallelism: most micro-batches in the stages at once
    # the engine core's seconds between back-to-back steps, outside `Engine.step()`: taking inputs, building
    # and sending a step's report, and waiting for a core where the host has fewer than its processes want
    # (engine/core/proc.py); the simulator prices it per step (bench sim)
    step_gap_s: float = 0.0
    last_step: StepStats = field(default_factory=StepStats)

    def add_step(self, step: StepStats) -> None:
        self.num_steps += 1
        self.prompt_tokens += step.prompt_tokens
        self.generation_tokens += step.generation_tokens
        self.num_preemptions += step.num_preemptions
        self.num_priority_preemptions += step.num_priority_preemptions
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        for pos, accepted in enumerate(step.accepted_per_pos):
            if pos >= len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
            self.accepted_per_pos[pos] += accepted
        self.last_step = step

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step: accepted drafts plus the one the target always adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
