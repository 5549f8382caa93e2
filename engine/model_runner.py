"""The model runner: scheduler output -> batch tensors -> model -> sampled tokens per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from specfleet.engine.attention.base import AttentionMetadata, get_attention_backend
from specfleet.engine.models.llama import LlamaModel
from specfleet.engine.outputs import Logprob
from specfleet.engine.sampler import SamplingBatch, apply_penalties, logprobs_for, processed_probs, sample
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
    logprobs: list[list[Logprob] | None]  # [num_scheduled] one per gained token, when requested
    spec: SpecStats = field(default_factory=SpecStats)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat rows whose logits are needed
    sample_counts: list[int]  # [num_scheduled] rows each sequence contributes to sample_rows


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
        if not inputs.sample_rows:
            return ModelRunnerOutput([[] for _ in sched.scheduled], [None] * len(sched.scheduled))
        rows = torch.tensor(inputs.sample_rows, device=hidden.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        return self._sample(sched, logits)

    def prepare(self, sched: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens, slens, tables, sample_rows, sample_counts = [], [], [], [], []
        for item in sched.scheduled:
            seq = item.seq
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
            meta, sample_rows, sample_counts,
        )

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> ModelRunnerOutput:
        """logits: [rows, vocab], num_spec + 1 consecutive rows per sampling sequence."""
        if sched.grammar_bitmask is not None:  # before everything that reads logits: sampling and verification
            apply_token_bitmask_(logits, sched.grammar_bitmask)
        items = [item for item in sched.scheduled if item.sample]
        row_seqs = [item.seq for item in items for _ in range(item.num_spec_tokens + 1)]
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
            self._verify(items, spec, starts, logits, batch, emitted)
        return self._collect(sched, items, starts, emitted, logits)

    def _verify(self, items, spec, starts, logits, batch: SamplingBatch, emitted) -> None:
        greedy = [i for i in spec if items[i].seq.params.temperature == 0]
        if greedy:
            argmax = logits.argmax(dim=-1).tolist()
            for i in greedy:
                k = items[i].num_spec_tokens
                emitted[i] = verify_greedy(argmax[starts[i] : starts[i] + k + 1], items[i].seq.spec_token_ids)
        by_k: dict[int, list[int]] = {}
        for i in spec:
            if items[i].seq.params.temperature != 0:
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
            nxt, accepted = rejection_sample(p, q, drafts, [s.generator for s in seqs], self.generator)
            for i, s, token, a in zip(group, seqs, nxt.tolist(), accepted.tolist()):
                emitted[i] = s.spec_token_ids[:a] + [token]

    def _collect(self, sched, items, starts, emitted, logits) -> ModelRunnerOutput:
        want = [i for i, item in enumerate(items) if item.seq.params.logprobs is not None]
        per_item_lps: dict[int, list[Logprob]] = {}
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
        return ModelRunnerOutput(sampled, logprobs, spec_stats)

    def sampling_batch(self, seqs: list[Sequence], device: torch.device, penalties: bool = True) -> SamplingBatch:
        """Per-row settings; penalties=False skips what `apply_penalties` needs (already applied)."""
        params = [s.params for s in seqs]
        all_greedy = all(p.temperature == 0 for p in params) and not any(s.generator for s in seqs)
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=device)
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        batch = SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=top_k, top_p=top_p, generators=[s.generator for s in seqs], all_greedy=all_greedy,
        )
        if penalties and any(p.uses_penalties for p in params):
            counts = torch.zeros(len(seqs), self.vocab_size, device=device)
            for row, s in enumerate(seqs):
                if s.params.uses_penalties and s.num_output_tokens:
                    out = torch.tensor(s.output_token_ids, device=device)
                    counts[row].scatter_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
            batch.output_counts = counts
            batch.presence = torch.tensor([p.presence_penalty for p in params], device=device)
            batch.frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        if penalties:
            # a structured sequence's min_tokens is in its grammar mask (the engine's grammar_bitmask)
            banned = [(row, sorted(self.eos_token_ids | set(s.params.stop_token_ids)))
                      for row, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens and s.grammar is None]
            batch.banned = banned or None
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        batch.num_logprobs = max(wanted) if wanted else None
        return batch


def _trim_top(lp: Logprob, want: int) -> Logprob:
    if len(lp.top) <= want:
        return lp
    return Logprob(lp.token_id, lp.logprob, dict(list(lp.top.items())[:want]))
