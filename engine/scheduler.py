"""The scheduler: every sequence's computed tokens catch up with its tokens, within one budget per step.

No prefill or decode phase: a step gives each running sequence what it still lacks (the rest of a
prompt chunk, one new token, or one token plus k speculative ones), then admits waiting sequences in the
policy's order (request_queue.py: first come, first served, or by priority) while the token budget,
`max_num_seqs` and free KV blocks allow. When blocks run out, the running list's tail (fcfs: the latest
admitted; priority: the lowest-priority latest arrival) is preempted by recompute: its blocks are freed and
it goes back to the waiting queue, keeping its output, and its prompt and output are recomputed later
(mostly prefix hits). Under the priority policy a waiting sequence that outranks running ones also preempts
them, lowest first, when the cache or `max_num_seqs` leaves it no room.
A sequence that is alone and still cannot get a block (a cache smaller than its context, which the engine
refuses at start) first loses its proposals and then finishes with "length": nothing queued may wait on
it forever. A structured sequence whose grammar is still compiling (`seq.grammar_pending`, vLLM's
WAITING_FOR_FSM) is passed over, waiting or running, until it is ready; a sampling sequence that comes back
from the runner with no token (its grammar allowed none) ends with "abort".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specfleet.engine.block_manager import BlockManager
from specfleet.engine.config import FCFS, PRIORITY
from specfleet.engine.request_queue import insert_running, outranks, waiting_queue
from specfleet.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from specfleet.engine.stop import StopCheck


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, speculative ones included (they come last)
    num_spec_tokens: int  # of those, speculative tokens to verify
    sample: bool  # the step reaches the end of the sequence's tokens, so it yields new token(s)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preemptions: int = 0
    num_priority_preemptions: int = 0  # of those, running sequences displaced by a higher-priority arrival
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefill work)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler ("length": no room)
    # [num_sample_rows, ceil(vocab / 32)] int32 allowed tokens, num_spec_tokens + 1 rows per sampling item;
    # None when no scheduled sequence is structured
    grammar_bitmask: Any = None

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = FCFS,
    ):
        self.kv = block_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        # Micro-batches in flight at once (pipeline parallelism with overlap; 1 otherwise): each takes up
        # to max_num_seqs sequences, so overlap adds concurrency instead of splitting one batch (a decode
        # step's cost hardly depends on its rows, so halving a batch would double the cost per token).
        self.micro_batches = 1
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting = waiting_queue(policy)
        self.running: list[Sequence] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0
        self.on_release: Callable[[Sequence], None] | None = None  # a proposer forgets the sequence
        # Before a finished sequence's blocks are freed (a KV connector may hold them): (seq, reason).
        self.on_finish: Callable[[Sequence, str], None] | None = None
        # LoRA: distinct adapters the running sequences may hold (None: no adapters); a waiting sequence
        # whose adapter would exceed it is passed over until one of them drains (vLLM's max_loras).
        self.max_loras: int | None = None

    # -- queue -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def add_running(self, seq: Sequence, num_cached: int) -> None:
        """A sequence whose blocks and computed tokens came from elsewhere (a KV connector's load)."""
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += num_cached
        seq.status = Status.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        insert_running(self.running, seq, self.policy)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End a sequence (stop, length, abort) and return its blocks. Safe to call twice, and on a sequence
        in neither queue (a remote one a KV connector still holds or is pulling for): there is nothing to
        unqueue then, and its blocks are returned all the same."""
        if seq.status is Status.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.on_finish is not None:
            self.on_finish(seq, reason)
        self.kv.free_seq(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop_reason
        seq.spec_token_ids = []

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self, busy: frozenset[int] = frozenset()) -> SchedulerOutput:
        """One step's batch. Pipeline parallelism schedules micro-batches while earlier ones are still in
        the stages: `busy` holds the seq_ids in flight (neither scheduled again nor preempted until their
        step comes back). Each micro-batch takes at most `max_num_seqs` sequences, and up to
        `max_num_seqs * micro_batches` run at once (vLLM's virtual engines: one batch per stage)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        room = self.max_num_seqs

        i, stalled = 0, False
        while i < len(self.running) and budget > 0 and room > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens_with_spec - seq.num_computed_tokens, budget)
            if num_new <= 0 or seq.seq_id in busy or seq.grammar_pending:
                i += 1
                continue
            num_new = self._make_room(seq, num_new, out, busy)
            if num_new < 0:
                stalled = True  # only sequences in flight could make room: wait for their step to come back
                i += 1
                continue
            if not num_new:
                break  # the sequence preempted itself or ended: nothing later in the list can run either
            self.kv.allocate(seq, seq.num_computed_tokens + num_new)
            out.scheduled.append(self._scheduled(out, seq, num_new))
            budget -= num_new
            room -= 1
            i += 1

        if not out.num_preemptions and not stalled:
            budget = self._admit_waiting(out, budget, room, busy)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _make_room(
        self, seq: Sequence, num_new: int, out: SchedulerOutput, busy: frozenset[int] = frozenset()
    ) -> int:
        """Free blocks for `num_new` more tokens of a running sequence by preempting the latest arrivals
        that are not in flight; returns how many tokens can now be scheduled (0: `seq` was preempted or
        finished; -1: only sequences in flight hold the blocks it needs)."""
        while not self.kv.can_allocate(seq, seq.num_computed_tokens + num_new):
            idle = [s for s in self.running if s.seq_id not in busy] if busy else self.running
            if len(idle) == 1 and len(self.running) > 1 and not seq.spec_token_ids:
                return -1
            if len(idle) > 1:
                victim = idle[-1]
                self._preempt(victim)
                out.num_preemptions += 1
                if victim is seq:
                    return 0
                continue
            # Alone, so no other sequence holds a block: the cache cannot hold this one's context.
            if seq.spec_token_ids:
                seq.spec_token_ids, seq.spec_probs = [], None
                num_new = min(num_new, seq.num_tokens - seq.num_computed_tokens)
                if num_new > 0:
                    continue
            self.finish(seq, "length")
            out.finished.append(seq)
            return 0
        return num_new

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, room: int, busy: frozenset[int] = frozenset()
    ) -> int:
        skipped: list[Sequence] = []
        limit = self.max_num_seqs * self.micro_batches
        lora_blocked = False  # a sequence was passed over for max_loras: later adapter sequences wait too
        while self.waiting and budget > 0:
            seq = self.waiting.peek()
            if seq.lora is not None and (lora_blocked or not self._lora_fits(seq)):
                # Admitting later requests of the running adapters would keep them running for ever and the
                # passed-over adapter waiting (starved): they wait, the running adapters drain, and the
                # first adapter in the queue gets the freed slot. Base requests hold no slot and go on.
                lora_blocked = True
                skipped.append(self.waiting.pop())
                continue
            if seq.grammar_pending:  # vLLM's WAITING_FOR_FSM
                skipped.append(self.waiting.pop())
                continue
            parent = seq.parent
            if (
                parent is not None
                and not parent.is_finished
                and parent.num_computed_tokens < parent.num_prompt_tokens
            ):
                skipped.append(self.waiting.pop())  # let the sibling compute the shared prompt first
                continue
            if room <= 0 or len(self.running) >= limit:
                # max_num_seqs is reached (not just this micro-batch): a sequence it outranks makes room
                freed = self._displace(seq, out, busy) if len(self.running) >= limit else None
                if freed is None:
                    break
                budget, room = budget + max(freed, 0), room + (freed >= 0)
                continue
            if seq.params.reads_every_prompt_row:
                hits = []  # every prompt position must run (vLLM skips the cache for these too)
            else:
                hits = self.kv.lookup_prefix(seq)
                if parent is not None and parent.status is Status.RUNNING:
                    shared = self.kv.shared_prefix(parent, seq)
                    hits = shared if len(shared) > len(hits) else hits
            cached = len(hits) * self.kv.block_size
            num_new = min(seq.num_tokens - cached, budget)
            if self.kv.blocks_for(cached + num_new) > self.kv.num_blocks:  # grew past the cache: never fits
                self.waiting.pop()
                self.finish(seq, "length")
                out.finished.append(seq)
                continue
            if not self.kv.can_allocate(seq, cached + num_new, hits):
                freed = self._displace(seq, out, busy)
                if freed is None:
                    break
                budget, room = budget + max(freed, 0), room + (freed >= 0)
                continue
            self.kv.allocate(seq, cached + num_new, hits)
            self.waiting.pop()
            seq.num_computed_tokens = cached
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += cached
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                # The prompt's cached tokens, once, as vLLM reports them: a preempted sequence readmitted
                # later finds its output's blocks cached too, which are not the prompt's.
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            insert_running(self.running, seq, self.policy)
            out.scheduled.append(self._scheduled(out, seq, num_new))
            budget -= num_new
            room -= 1
        self.waiting.put_back(skipped)
        return budget

    def _lora_fits(self, seq: Sequence) -> bool:
        """Admitting `seq` keeps the running sequences within `max_loras` distinct adapters."""
        if seq.lora is None or self.max_loras is None:
            return True
        active = {s.lora for s in self.running if s.lora is not None}
        return seq.lora in active or len(active) < self.max_loras

    def _displace(self, head: Sequence, out: SchedulerOutput, busy: frozenset[int]) -> int | None:
        """Priority policy: preempt the lowest-priority running sequence (not in flight) that `head`
        outranks, so that `head` may be admitted. Returns the tokens its undone schedule gives back to
        this step's budget (-1: it was not scheduled this step, so it gives back no room either); None when
        no running sequence can be displaced (fcfs never displaces)."""
        if self.policy != PRIORITY:
            return None
        victim = next((s for s in reversed(self.running) if s.seq_id not in busy and outranks(head, s)), None)
        if victim is None:
            return None
        item = next((item for item in out.scheduled if item.seq is victim), None)
        if item is not None:  # scheduled earlier in this step: undo it (vLLM does the same)
            out.scheduled.remove(item)
            end = victim.num_computed_tokens + item.num_new_tokens
            out.num_prompt_tokens -= max(0, min(end, victim.num_prompt_tokens) - victim.num_computed_tokens)
        self._preempt(victim)
        out.num_preemptions += 1
        out.num_priority_preemptions += 1
        return item.num_new_tokens if item is not None else -1

    def _scheduled(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> ScheduledSeq:
        end = seq.num_computed_tokens + num_new
        out.num_prompt_tokens += max(0, min(end, seq.num_prompt_tokens) - seq.num_computed_tokens)
        num_spec = max(0, end - seq.num_tokens)
        if num_spec < len(seq.spec_token_ids):  # the budget cut some proposals: drop them
            del seq.spec_token_ids[num_spec:]
            if seq.spec_probs is not None:
                seq.spec_probs = seq.spec_probs[:num_spec] if num_spec else None
        if self.kv.debug:
            self.kv.note_computed(
                seq,
                seq.num_computed_tokens,
                (seq.token_ids + seq.spec_token_ids)[seq.num_computed_tokens : end],
            )
        return ScheduledSeq(seq, num_new, num_spec, sample=end >= seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free_seq(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.spec_token_ids, seq.spec_probs = [], None
        seq.num_preemptions += 1
        self.waiting.add_preempted(seq)

    # -- after the model ran ---------------------------------------------------------------------------
    def update(
        self, out: SchedulerOutput, sampled: list[list[int]], stop: StopCheck | None = None
    ) -> list[tuple[Sequence, int]]:
        """Advance computed tokens, trim rejected speculation, and append the sampled tokens one at a
        time, asking `stop` after each whether the sequence ends there (then it is finished and the step's
        later tokens are dropped). Returns the sequences that received new tokens, with how many."""
        changed = []
        for item, tokens in zip(out.scheduled, sampled):
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += item.num_new_tokens
            if not item.sample:
                self.kv.cache_full_blocks(seq)
                continue
            if not tokens:  # its grammar allowed no token (model_runner.py): it ends, emitting nothing
                self.finish(seq, "abort")
                changed.append((seq, 0))
                continue
            # Of the k proposals, the first len(tokens) - 1 were accepted; the rest are recomputed.
            rejected = item.num_spec_tokens - (len(tokens) - 1)
            seq.num_computed_tokens -= rejected
            seq.spec_token_ids, seq.spec_probs = [], None
            if rejected:
                self.kv.trim(seq, seq.num_computed_tokens)
            changed.append((seq, self.append(seq, tokens, stop)))
        return changed

    def append(self, seq: Sequence, tokens: list[int], stop: StopCheck | None = None) -> int:
        """Append a step's tokens in order until `stop` ends the sequence; returns how many were taken."""
        taken = 0
        for token in tokens:
            seq.token_ids.append(token)
            taken += 1
            if stop is not None and (finish := stop(seq)) is not None:
                self.kv.cache_full_blocks(seq)
                self.finish(seq, finish.reason, finish.stop_reason)
                return taken
        self.kv.cache_full_blocks(seq)
        return taken
