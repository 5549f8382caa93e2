"""One sequence: a prompt, its growing output, and how much of it the KV cache holds."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from specfleet.engine.outputs import KVTransferMetrics
from specfleet.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # A remote-prefilled sequence whose KV a worker thread is pulling (kv_transfer/connector.py): in no
    # queue, its blocks allocated and not yet written (vLLM's name for the state)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output (verified tokens only)
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # the request's; lower runs first under --scheduling-policy priority (request_queue.py)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    # the sliding-window layers' blocks when they keep only their window (block_manager.py; NULL_BLOCK for
    # the blocks that fell out of it); empty when every layer reads `block_table`
    sliding_table: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify this step
    spec_probs: Any = None  # [k, vocab] the draft's distribution for them; None: point mass or greedy
    parent: Sequence | None = None  # n > 1: the sample whose prompt blocks this one shares
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    seed: int | None = None  # a seeded request's per-sample seed (sampler.sample_seed)
    grammar: Any = None  # GrammarMatcher of a structured request, at the end of token_ids
    # its grammar is compiling (vLLM's WAITING_FOR_FSM): the scheduler passes it over until it is ready
    grammar_pending: bool = False
    grammar_rows: Any = None  # [len(spec_token_ids) + 1, ceil(vocab / 32)] int32 masks for the proposals
    # the grammar of a request that reasons first, at its start: it becomes `grammar` once the output ends
    # with params.reasoning_end_token_ids (until then the output is free)
    grammar_after_reasoning: Any = None
    # a pooling request's [hidden] float32 state: the sum over the prompt rows computed so far (MEAN) or
    # the last prompt row (LAST), then the embedding once the prompt is done (model_runner.py)
    pooled: Any = None
    kv_transfer: KVTransferMetrics | None = None  # a remote-prefilled sequence's pull (kv_transfer/)
    # the LoRA adapter the request names (engine/lora LoraAdapter), held until it finishes; None: the base
    lora: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """Still catching up with tokens it did not generate itself (prompt, or all after preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
