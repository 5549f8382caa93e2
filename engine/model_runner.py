"""The model runner: scheduler output -> batch tensors -> model -> sampled tokens per sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from specfleet.engine.attention.base import AttentionMetadata
from specfleet.engine.attention.registry import get_attention_backend
from specfleet.engine.block_manager import SlidingLayers
from specfleet.engine.input_buffers import StepBuffers
from specfleet.engine.lora.batch import LoraBatch
from specfleet.engine.models.llama import LlamaModel
from specfleet.engine.outputs import PositionLogprobs
from specfleet.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    build_sampling_batch,
    logprobs_for,
    processed_probs,
    sample,
)
from specfleet.engine.scheduler import ScheduledSeq, SchedulerOutput
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.rejection import rejection_sample, verify_greedy
from specfleet.engine.structured_output.bitmask import apply_token_bitmask_

if TYPE_CHECKING:
    from specfleet.engine.distributed.workers import SplitModel

log = logging.getLogger("specfleet.engine")

# On CPU a one-token step is mostly small ops, which lose more to OpenMP overhead than its GEMVs gain
# from a second thread (measured on 2 cores: 40 ms against 44 ms per SmolLM2 decode step).
SINGLE_THREAD_MAX_TOKENS = 1


@dataclass
class SpecStats:
    num_drafts: int = 0  # sequences whose proposals were verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    per_adapter: dict[str, list[int]] = field(default_factory=dict)  # LoRA name -> [proposed, accepted]

    def add(self, proposed: int, accepted: int, adapter: str | None = None) -> None:
        self.num_drafts += 1
        if adapter is not None:
            counts = self.per_adapter.setdefault(adapter, [0, 0])
            counts[0] += proposed
            counts[1] += accepted
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


@dataclass
class ModelRunnerOutput:
    # [num_scheduled] tokens each sequence gained ([] mid-prefill, or a sampling sequence whose grammar
    # allows no token: the scheduler ends it)
    sampled: list[list[int]]
    logprobs: list[list[PositionLogprobs] | None]  # [num_scheduled] one per gained token, when requested
    spec: SpecStats = field(default_factory=SpecStats)
    # [num_scheduled] (first prompt position covered, logprobs of the prompt tokens after it), when requested
    prompt_logprobs: list[tuple[int, list[PositionLogprobs]] | None] = field(default_factory=list)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat rows whose logits are needed
    sample_counts: list[int]  # [num_scheduled] rows each sequence contributes to sample_rows
    token_starts: list[int]  # [num_scheduled] each sequence's first flat row


@dataclass
class InFlight:
    """A micro-batch launched into the pipeline and not yet collected."""

    inputs: BatchInputs

    @property
    def num_tokens(self) -> int:
        return self.inputs.input_ids.shape[0]


@dataclass(eq=False)
class SampleRows:
    """One sampling sequence's k + 1 consecutive rows of the step's logits (k proposals to verify, then the
    position after them), and what the step emits for it."""

    seq: Sequence
    k: int  # proposals verified in these rows
    start: int  # first row
    tokens: list[int] = field(default_factory=list)  # emitted: accepted proposals, then one sampled token
    dead: bool = False  # a grammar mask row of the sequence allows no token: it emits nothing, and ends
    logprobs: list[PositionLogprobs] | None = None  # one per emitted token, when requested

    @property
    def end(self) -> int:
        return self.start + self.k + 1

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel | SplitModel,
        num_blocks: int,
        block_size: int,
        attention_backend: str,
        eos_token_ids: set[int],
        seed: int,
        sliding: SlidingLayers | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.attn = get_attention_backend(attention_backend, model.device, model.dtype)
        a = model.args
        # With `sliding`, those layers' caches are the sliding pool's blocks (block_manager.py), which each
        # sequence's `sliding_table` addresses; the other layers' are the `num_blocks` of `block_table`.
        self.sliding = sliding
        sliding_layers = sliding.layers if sliding is not None else frozenset()
        self.kv_caches = []
        for layer in range(a.num_layers):
            blocks = sliding.num_blocks if sliding is not None and layer in sliding_layers else num_blocks
            shape = (blocks, block_size, a.num_kv_heads, a.head_dim)
            self.kv_caches.append(
                (
                    torch.zeros(shape, dtype=model.dtype, device=model.device),
                    torch.zeros(shape, dtype=model.dtype, device=model.device),
                )
            )
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.vocab_size = a.vocab_size
        # A step's inputs are read until it is collected: one set per micro-batch in flight, and one for
        # the step being prepared.
        self.buffers = StepBuffers(model.device, ring=self.pipeline_depth + 1)
        self.sliding_buffers = StepBuffers(model.device, ring=self.pipeline_depth + 1) if sliding else None
        # Run each sequence's LoRA adapter (the target model of a LoRA engine). A draft model's runner
        # leaves it off: the draft proposes without the adapter, and verification applies it.
        self.use_lora = False

    @property
    def pipeline_depth(self) -> int:
        """Micro-batches the model can have in flight at once (its pipeline stages; 1 unless split so)."""
        return getattr(self.model, "pipeline_depth", 1)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._with_threads(sched, lambda: self._step(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> InFlight:
        """Pipeline parallelism: run the first stage on a micro-batch and send it on; the later stages work
        on it while this process launches the next one. `finish` collects and samples it."""
        return InFlight(self._with_threads(sched, lambda: self._launch(sched, pipelined=True))[0])

    @torch.inference_mode()
    def finish(self, sched: SchedulerOutput, flight: InFlight) -> ModelRunnerOutput:
        hidden = self.collect(flight.num_tokens)
        return self._with_threads(sched, lambda: self._finish(sched, flight.inputs, hidden))

    def collect(self, num_tokens: int) -> torch.Tensor:
        """The hidden states of the oldest micro-batch in flight (pipeline parallelism)."""
        return self._stages().collect(num_tokens)

    def _stages(self) -> SplitModel:
        model = self.model
        assert not isinstance(model, LlamaModel), "pipelined steps need a model split into stages"
        return model

    def _step(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        inputs, hidden = self._launch(sched, pipelined=False)
        assert hidden is not None  # an unpipelined launch runs the forward pass
        return self._finish(sched, inputs, hidden)

    def _with_threads(self, sched: SchedulerOutput, run):
        single = self.model.device.type == "cpu" and sched.num_batched_tokens <= SINGLE_THREAD_MAX_TOKENS
        if not single or torch.get_num_threads() == 1:
            return run()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run()
        finally:
            torch.set_num_threads(threads)

    def _launch(self, sched: SchedulerOutput, pipelined: bool) -> tuple[BatchInputs, torch.Tensor | None]:
        inputs = self.prepare(sched.scheduled)
        if pipelined:
            self._stages().launch(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.attn)
            return inputs, None
        return inputs, self._forward(inputs)

    def _finish(self, sched: SchedulerOutput, inputs: BatchInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        if inputs.sample_rows:
            out = self._sample(sched, self._sample_logits(inputs, hidden))
        else:
            out = ModelRunnerOutput([[] for _ in sched.scheduled], [None] * len(sched.scheduled))
        out.prompt_logprobs = self._prompt_logprobs(sched, inputs, hidden)
        self._pool(sched, inputs, hidden)
        return out

    def _pool(self, sched: SchedulerOutput, inputs: BatchInputs, hidden: torch.Tensor) -> None:
        """Pooling requests: fold this step's prompt rows into `seq.pooled`; on the prompt's last row it
        becomes the embedding. A chunk from position 0 starts over (a preempted sequence recomputes from
        there: MEAN never takes prefix hits, block_manager.lookup_prefix)."""
        for i, item in enumerate(sched.scheduled):
            seq = item.seq
            how = seq.params.pooling
            start = seq.num_computed_tokens
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens)
            if how is None or end <= start:
                continue
            first = inputs.token_starts[i]
            if how == "MEAN":
                rows = self._final_norm(hidden[first : first + end - start]).sum(dim=0)
                seq.pooled = rows if start == 0 or seq.pooled is None else seq.pooled + rows
            if end < seq.num_prompt_tokens:
                continue
            if how == "LAST":
                seq.pooled = self._final_norm(hidden[first + end - start - 1 : first + end - start])[0]
            else:
                seq.pooled = seq.pooled / seq.num_prompt_tokens
            if seq.params.pooling_normalize:
                seq.pooled = torch.nn.functional.normalize(seq.pooled, dim=0)

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = getattr(self.model, "final_norm", None)
        if norm is None:
            raise RuntimeError("pooling needs a model that is not split over workers")
        return norm(hidden)

    @torch.inference_mode()
    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), vocab]: the logits after each sequence's last token, from one forward over the tokens
        each has not computed yet (their K/V land in this runner's cache). The draft proposer's step."""
        inputs = self.prepare(
            [ScheduledSeq(seq, seq.num_tokens - seq.num_computed_tokens, 0, True) for seq in seqs]
        )
        return self._sample_logits(inputs, self._forward(inputs))

    def _forward(self, inputs: BatchInputs) -> torch.Tensor:
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.attn)

    def _sample_logits(self, inputs: BatchInputs, hidden: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor(inputs.sample_rows, device=hidden.device)
        return self.model.logits(hidden.index_select(0, rows))

    def _prompt_logprobs(self, sched: SchedulerOutput, inputs: BatchInputs, hidden: torch.Tensor):
        """For requests that asked: the logprob of each prompt token this step's positions predict."""
        spans: list[tuple[int, int, list[int], int]] = []  # (item index, first position, rows, top wanted)
        for i, item in enumerate(sched.scheduled):
            seq, start = item.seq, item.seq.num_computed_tokens
            want = seq.params.prompt_logprobs
            if want is None:
                continue
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if end > start:
                spans.append(
                    (
                        i,
                        start,
                        list(range(inputs.token_starts[i], inputs.token_starts[i] + end - start)),
                        want,
                    )
                )
        result: list[tuple[int, list[PositionLogprobs]] | None] = [None] * len(sched.scheduled)
        if not spans:
            return result
        rows = torch.tensor([r for _, _, rs, _ in spans for r in rs], device=hidden.device)
        targets = torch.tensor(
            [
                sched.scheduled[i].seq.token_ids[start + 1 + j]
                for i, start, rs, _ in spans
                for j in range(len(rs))
            ],
            device=hidden.device,
        )
        top = max(want for _, _, _, want in spans)
        lps = iter(logprobs_for(self.model.logits(hidden.index_select(0, rows)), targets, top))
        for i, start, rs, want in spans:
            result[i] = (start + 1, [_trim_top(next(lps), want) for _ in rs])
        return result

    def prepare(self, items: list[ScheduledSeq]) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_counts: list[int] = []
        token_starts: list[int] = []
        for item in items:
            seq = item.seq
            token_starts.append(len(ids))
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            tokens = seq.token_ids[start:end]
            if len(tokens) < end - start:
                tokens = tokens + seq.spec_token_ids[: end - start - len(tokens)]
            ids.extend(tokens)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(end - start)
            slens.append(end)
            tables.append(table)
            n = item.num_spec_tokens + 1 if item.sample else 0
            sample_rows.extend(range(len(ids) - n, len(ids)))
            sample_counts.append(n)
        t = self.buffers.fill(ids, positions, slots, qlens, slens, tables)
        meta = AttentionMetadata(
            slot_mapping=t.slot_mapping,
            query_start_loc=t.query_start_loc,
            seq_lens=t.seq_lens,
            block_tables=t.block_tables,
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
            block_size=bs,
        )
        if self.use_lora:
            spans = [(item.seq.lora, start, n) for item, start, n in zip(items, token_starts, qlens)]
            meta.lora = LoraBatch.build(spans, len(ids), self.model.device)
        self.attn.prepare(meta)
        if self.sliding_buffers is not None:
            meta.sliding = self._sliding_meta(items, meta, ids, positions)
        return BatchInputs(t.input_ids, t.positions, meta, sample_rows, sample_counts, token_starts)

    def _sliding_meta(
        self, items: list[ScheduledSeq], meta: AttentionMetadata, ids: list[int], positions: list[int]
    ) -> AttentionMetadata:
        """The step's slots and block tables in the sliding-window layers' pool (each sequence's
        `sliding_table`); the queries, lengths and the backend's per-step state are the step's own."""
        assert self.sliding_buffers is not None
        bs = self.block_size
        slots: list[int] = []
        for item in items:
            table, start = item.seq.sliding_table, item.seq.num_computed_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + item.num_new_tokens))
        t = self.sliding_buffers.fill(
            ids,
            positions,
            slots,
            meta.query_lens_cpu,
            meta.seq_lens_cpu,
            [i.seq.sliding_table for i in items],
        )
        return AttentionMetadata(
            slot_mapping=t.slot_mapping,
            query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens,
            block_tables=t.block_tables,
            query_lens_cpu=meta.query_lens_cpu,
            seq_lens_cpu=meta.seq_lens_cpu,
            block_size=bs,
            backend_state=meta.backend_state,  # what write_kv reads of it: padding rows, the same here
            lora=meta.lora,
        )

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> ModelRunnerOutput:
        """logits: [rows, vocab], num_spec + 1 consecutive rows per sampling sequence."""
        rows: list[SampleRows] = []
        for item in sched.scheduled:
            if item.sample:
                rows.append(SampleRows(item.seq, item.num_spec_tokens, rows[-1].end if rows else 0))
        # logprobs report the model's own distribution (before the grammar mask, bias and penalties), as
        # vLLM's default does: the mask writes -inf in place, so they read a copy taken before it
        raw = logits
        if sched.grammar_bitmask is not None:  # before everything that samples or verifies
            if any(r.seq.params.logprobs is not None for r in rows):
                raw = logits.clone()
            dead = apply_token_bitmask_(logits, sched.grammar_bitmask).tolist()
            for r in rows:  # a row that allows no token: the grammar is at a dead end, nothing is sampled
                r.dead = any(dead[r.start : r.end])
        if all(_plain_greedy(r) for r in rows):  # no per-row settings to build: the argmax is the token
            for r, token in zip(rows, logits.argmax(dim=-1).tolist()):
                r.tokens = [token]
            return self._collect(sched, rows, raw)
        row_seqs = [r.seq for r in rows for _ in range(r.k + 1)]
        batch = self.sampling_batch(row_seqs, logits.device)
        logits = apply_penalties(logits, batch)
        plain = [r for r in rows if not r.k]
        if plain:
            at = [r.start for r in plain]
            sub = (
                batch
                if len(at) == len(row_seqs)
                else self.sampling_batch([r.seq for r in plain], logits.device, penalties=False)
            )
            for r, token in zip(plain, sample(logits[at], sub, self.generator).tolist()):
                r.tokens = [token]
        if len(plain) < len(rows):
            self._verify([r for r in rows if r.k], logits)
        return self._collect(sched, rows, raw)

    def _verify(self, rows: list[SampleRows], logits: torch.Tensor) -> None:
        """Each row's emitted tokens. Greedy and seeded rows accept drafts while they equal the target's own
        choice (its argmax, or its keyed draw); the other sampled rows go through the rejection sampler,
        grouped by k."""
        own = [r for r in rows if r.seq.params.temperature == 0 or r.seq.seed is not None]
        if own:
            sub = self.sampling_batch(
                [r.seq for r in own for _ in range(r.k + 1)],
                logits.device,
                penalties=False,
                offsets=[j for r in own for j in range(r.k + 1)],
            )
            choices = iter(
                sample(logits[[i for r in own for i in r.positions]], sub, self.generator).tolist()
            )
            for r in own:
                r.tokens = verify_greedy([next(choices) for _ in range(r.k + 1)], r.seq.spec_token_ids)
        by_k: dict[int, list[SampleRows]] = {}
        for r in rows:
            if r not in own:
                by_k.setdefault(r.k, []).append(r)
        for k, group in by_k.items():
            sub = self.sampling_batch(
                [r.seq for r in group for _ in range(k + 1)], logits.device, penalties=False
            )
            p = processed_probs(logits[[i for r in group for i in r.positions]], sub).view(
                len(group), k + 1, -1
            )
            q = None
            if group[0].seq.spec_probs is not None:
                q = torch.stack([r.seq.spec_probs[:k] for r in group])
            drafts = torch.tensor([r.seq.spec_token_ids for r in group], device=logits.device)
            nxt, accepted = rejection_sample(p, q, drafts, self.generator)
            for r, token, a in zip(group, nxt.tolist(), accepted.tolist()):
                r.tokens = r.seq.spec_token_ids[:a] + [token]

    def _collect(
        self, sched: SchedulerOutput, rows: list[SampleRows], logits: torch.Tensor
    ) -> ModelRunnerOutput:
        for r in rows:
            if r.dead:  # emit nothing rather than a token the grammar did not allow; the scheduler ends it
                log.warning("event=grammar_dead_end request_id=%s", r.seq.request_id)
                r.tokens = []
        want = [(r, n) for r in rows if (n := r.seq.params.logprobs) is not None and r.tokens]
        if want:
            tokens = torch.tensor([t for r, _ in want for t in r.tokens], device=logits.device)
            top = max(n for _, n in want)
            lps = iter(
                logprobs_for(
                    logits[[r.start + j for r, _ in want for j in range(len(r.tokens))]], tokens, top
                )
            )
            for r, n in want:
                r.logprobs = [_trim_top(next(lps), n) for _ in r.tokens]
        sampled: list[list[int]] = []
        logprobs: list[list[PositionLogprobs] | None] = []
        spec_stats = SpecStats()
        taken = iter(rows)
        for item in sched.scheduled:
            if not item.sample:
                sampled.append([])
                logprobs.append(None)
                continue
            r = next(taken)
            sampled.append(r.tokens)
            logprobs.append(r.logprobs)
            if r.k and r.tokens:
                spec_stats.add(r.k, len(r.tokens) - 1, r.seq.lora.name if r.seq.lora is not None else None)
        return ModelRunnerOutput(sampled, logprobs, spec=spec_stats)

    def sampling_batch(
        self,
        seqs: list[Sequence],
        device: torch.device,
        penalties: bool = True,
        offsets: list[int] | None = None,
    ) -> SamplingBatch:
        return build_sampling_batch(seqs, self.vocab_size, self.eos_token_ids, device, penalties, offsets)


def _plain_greedy(row: SampleRows) -> bool:
    """A greedy row with nothing that changes its logits (bias, masks, penalties, an unmet min_tokens)
    and no proposals to verify: its token is the argmax, without the sampler's general machinery."""
    seq, params = row.seq, row.seq.params
    return (
        not row.k
        and params.temperature == 0
        and not params.uses_bias
        and not params.depends_on_history
        and seq.num_output_tokens >= params.min_tokens
    )


def _trim_top(lp: PositionLogprobs, want: int) -> PositionLogprobs:
    if len(lp.top) <= want:
        return lp
    return PositionLogprobs(lp.token_id, lp.logprob, dict(list(lp.top.items())[:want]), lp[lp.token_id].rank)
