"""The model runner: scheduler output -> batch tensors -> model -> sampled tokens per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from specfleet.engine.attention.base import AttentionMetadata, get_attention_backend
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
from specfleet.engine.scheduler import SchedulerOutput
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.rejection import rejection_sample, verify_greedy
from specfleet.engine.structured_output.bitmask import apply_token_bitmask_

# On CPU a one-token step is mostly small ops, which lose more to OpenMP overhead than its GEMVs gain
# from a second thread (measured on 2 cores: 40 ms against 44 ms per SmolLM2 decode step).
SINGLE_THREAD_MAX_TOKENS = 1


@dataclass
class SpecStats:
    num_drafts: int = 0  # sequences whose proposals were verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


@dataclass
class ModelRunnerOutput:
    sampled: list[list[int]]  # [num_scheduled] tokens each sequence gained ([] mid-prefill)
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


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, attention_backend: str,
                 eos_token_ids: set[int], seed: int):
        self.model = model
        self.block_size = block_size
        self.attn = get_attention_backend(attention_backend, model.device, model.dtype)
        a = model.args
        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=model.device),
             torch.zeros(shape, dtype=model.dtype, device=model.device))
            for _ in range(a.num_layers)
        ]
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.vocab_size = a.vocab_size

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        single = self.model.device.type == "cpu" and sched.num_batched_tokens <= SINGLE_THREAD_MAX_TOKENS
        if not single or torch.get_num_threads() == 1:
            return self._execute(sched)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._execute(sched)
        finally:
            torch.set_num_threads(threads)

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        inputs = self.prepare(sched)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.attn)
        if inputs.sample_rows:
            rows = torch.tensor(inputs.sample_rows, device=hidden.device)
            out = self._sample(sched, self.model.logits(hidden.index_select(0, rows)))
        else:
            out = ModelRunnerOutput([[] for _ in sched.scheduled], [None] * len(sched.scheduled))
        out.prompt_logprobs = self._prompt_logprobs(sched, inputs, hidden)
        return out

    def _prompt_logprobs(self, sched: SchedulerOutput, inputs: BatchInputs, hidden: torch.Tensor):
        """For requests that asked: the logprob of each prompt token this step's positions predict."""
        spans = []  # (item index, first position, rows)
        for i, item in enumerate(sched.scheduled):
            seq, start = item.seq, item.seq.num_computed_tokens
            if seq.params.prompt_logprobs is None:
                continue
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if end > start:
                spans.append((i, start, list(range(inputs.token_starts[i], inputs.token_starts[i] + end - start))))
        result: list[tuple[int, list[PositionLogprobs]] | None] = [None] * len(sched.scheduled)
        if not spans:
            return result
        rows = torch.tensor([r for _, _, rs in spans for r in rs], device=hidden.device)
        targets = torch.tensor([sched.scheduled[i].seq.token_ids[start + 1 + j] for i, start, rs in spans
                                for j in range(len(rs))], device=hidden.device)
        top = max(sched.scheduled[i].seq.params.prompt_logprobs for i, _, _ in spans)
        lps = iter(logprobs_for(self.model.logits(hidden.index_select(0, rows)), targets, top))
        for i, start, rs in spans:
            want = sched.scheduled[i].seq.params.prompt_logprobs
            result[i] = (start + 1, [_trim_top(next(lps), want) for _ in rs])
        return result

    def prepare(self, sched: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens, slens, tables, sample_rows, sample_counts, token_starts = [], [], [], [], [], []
        for item in sched.scheduled:
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
        device = self.model.device
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=device),
            block_tables=block_tables,
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
            block_size=bs,
        )
        self.attn.prepare(meta)
        return BatchInputs(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta, sample_rows, sample_counts, token_starts,
        )

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> ModelRunnerOutput:
        """logits: [rows, vocab], num_spec + 1 consecutive rows per sampling sequence."""
        if sched.grammar_bitmask is not None:  # before everything that reads logits: sampling and verification
            apply_token_bitmask_(logits, sched.grammar_bitmask)
        items = [item for item in sched.scheduled if item.sample]
        if all(_plain_greedy(item) for item in items):  # no per-row settings to build: argmax is the token
            emitted = [[token] for token in logits.argmax(dim=-1).tolist()]
            return self._collect(sched, items, list(range(len(items))), emitted, logits)
        row_seqs = [item.seq for item in items for _ in range(item.num_spec_tokens + 1)]
        raw = logits  # logprobs report the model's own distribution, as vLLM's default does
        batch = self.sampling_batch(row_seqs, logits.device)
        logits = apply_penalties(logits, batch)
        starts, row = [], 0
        for item in items:
            starts.append(row)
            row += item.num_spec_tokens + 1
        emitted: list[list[int]] = [[] for _ in items]
        plain = [i for i, item in enumerate(items) if not item.num_spec_tokens]
        if plain:
            rows = [starts[i] for i in plain]
            sub = batch if len(rows) == len(row_seqs) else self.sampling_batch([row_seqs[r] for r in rows], logits.device,
                                                                                  penalties=False)
            for i, token in zip(plain, sample(logits[rows], sub, self.generator).tolist()):
                emitted[i] = [token]
        spec = [i for i, item in enumerate(items) if item.num_spec_tokens]
        if spec:
            self._verify(items, spec, starts, logits, emitted)
        return self._collect(sched, items, starts, emitted, raw)

    def _verify(self, items, spec, starts, logits, emitted) -> None:
        """Greedy and seeded rows accept drafts while they equal the target's own choice (its argmax, or
        its keyed draw); the other sampled rows go through the rejection sampler, grouped by k."""
        own = [i for i in spec if items[i].seq.params.temperature == 0 or items[i].seq.seed is not None]
        if own:
            rows = [starts[i] + j for i in own for j in range(items[i].num_spec_tokens + 1)]
            sub = self.sampling_batch([items[i].seq for i in own for _ in range(items[i].num_spec_tokens + 1)],
                                      logits.device, penalties=False,
                                      offsets=[j for i in own for j in range(items[i].num_spec_tokens + 1)])
            choices = iter(sample(logits[rows], sub, self.generator).tolist())
            for i in own:
                target = [next(choices) for _ in range(items[i].num_spec_tokens + 1)]
                emitted[i] = verify_greedy(target, items[i].seq.spec_token_ids)
        by_k: dict[int, list[int]] = {}
        for i in spec:
            if i not in own:
                by_k.setdefault(items[i].num_spec_tokens, []).append(i)
        for k, group in by_k.items():
            rows = [starts[i] + j for i in group for j in range(k + 1)]
            sub = self.sampling_batch([items[i].seq for i in group for _ in range(k + 1)], logits.device,
                                      penalties=False)
            p = processed_probs(logits[rows], sub).view(len(group), k + 1, -1)
            seqs = [items[i].seq for i in group]
            q = None
            if seqs[0].spec_probs is not None:
                q = torch.stack([s.spec_probs[:k] for s in seqs])
            drafts = torch.tensor([s.spec_token_ids for s in seqs], device=logits.device)
            nxt, accepted = rejection_sample(p, q, drafts, self.generator)
            for i, s, token, a in zip(group, seqs, nxt.tolist(), accepted.tolist()):
                emitted[i] = s.spec_token_ids[:a] + [token]

    def _collect(self, sched, items, starts, emitted, logits) -> ModelRunnerOutput:
        want = [i for i, item in enumerate(items) if item.seq.params.logprobs is not None]
        per_item_lps: dict[int, list[PositionLogprobs]] = {}
        if want:
            rows = [starts[i] + j for i in want for j in range(len(emitted[i]))]
            tokens = torch.tensor([t for i in want for t in emitted[i]], device=logits.device)
            top = max(items[i].seq.params.logprobs for i in want)
            lps = iter(logprobs_for(logits[rows], tokens, top))
            for i in want:
                per_item_lps[i] = [_trim_top(next(lps), items[i].seq.params.logprobs) for _ in emitted[i]]
        sampled, logprobs, spec_stats = [], [], SpecStats()
        index = 0
        for item in sched.scheduled:
            if not item.sample:
                sampled.append([])
                logprobs.append(None)
                continue
            tokens = emitted[index]
            sampled.append(tokens)
            logprobs.append(per_item_lps.get(index))
            if item.num_spec_tokens:
                spec_stats.add(item.num_spec_tokens, len(tokens) - 1)
            index += 1
        return ModelRunnerOutput(sampled, logprobs, spec=spec_stats)

    def sampling_batch(self, seqs: list[Sequence], device: torch.device, penalties: bool = True,
                       offsets: list[int] | None = None) -> SamplingBatch:
        return build_sampling_batch(seqs, self.vocab_size, self.eos_token_ids, device, penalties, offsets)


def _plain_greedy(item) -> bool:
    """A greedy row with nothing that changes its logits (bias, masks, penalties, an unmet min_tokens)
    and no proposals to verify: its token is the argmax, without the sampler's general machinery."""
    seq, params = item.seq, item.seq.params
    return (not item.num_spec_tokens and params.temperature == 0 and not params.uses_bias
            and not params.depends_on_history and seq.num_output_tokens >= params.min_tokens)


def _trim_top(lp: PositionLogprobs, want: int) -> PositionLogprobs:
    if len(lp.top) <= want:
        return lp
    return PositionLogprobs(lp.token_id, lp.logprob, dict(list(lp.top.items())[:want]), lp[lp.token_id].rank)
