"""Draft-model proposals: a small llama-family model with the target's tokenizer runs k steps over the
whole batch at once, with its own paged KV cache beside the target's.

Each speculating sequence has a shadow in the draft: its block table and how many of its tokens the
draft has computed. A call first catches the draft up (prompt on first use, then the tokens the target
accepted and added since), then feeds its own proposals back k - 1 times. Proposals the target
rejected are dropped from the shadow's KV on the next call by comparing them with what was kept.
"""

from __future__ import annotations

import torch
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.model_runner import ModelRunner
from specfleet.engine.sampler import exponential_noise, processed_probs
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.proposer import Proposal


class _Shadow(Sequence):
    base: int = 0  # where this call's fed-back proposals start


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int):
        self.runner = runner
        self.kv = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.shadows: dict[int, _Shadow] = {}

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        active: list[tuple[int, _Shadow, int]] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k and (shadow := self._sync(seq, k)) is not None:
                active.append((i, shadow, k))
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in active}
        for step in range(max((k for _, _, k in active), default=0)):
            group = [(i, sh) for i, sh, k in active if step < k]
            logits = self.runner.next_token_logits([sh for _, sh in group])
            tokens, dist = self._draw(logits, [seqs[i] for i, _ in group], step)
            for n, ((i, sh), token) in enumerate(zip(group, tokens)):
                sh.num_computed_tokens = sh.num_tokens
                sh.token_ids.append(token)
                proposals[i].token_ids.append(token)
                if dist is not None:
                    probs[i].append(dist[n])
        for i, _, _ in active:
            if probs[i] and len(probs[i]) == len(proposals[i].token_ids):
                proposals[i].probs = torch.stack(probs[i])
        return proposals

    def _draw(
        self, logits: torch.Tensor, seqs: list[Sequence], step: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """The draft's token for each sequence at `step` past its output. A seeded sequence draws with the
        noise the target will use at that position, so a draft close to the target proposes what the
        target's draw picks (verification of seeded rows accepts only that)."""
        if all(s.params.temperature == 0 for s in seqs):
            return logits.argmax(dim=-1).tolist(), None
        batch = self.runner.sampling_batch(seqs, logits.device, penalties=False, offsets=[step] * len(seqs))
        dist = processed_probs(logits, batch)
        noise = exponential_noise(tuple(dist.shape), batch.noise_keys, self.runner.generator, dist.device)
        return (dist / noise).argmax(dim=-1).tolist(), dist

    def _sync(self, seq: Sequence, k: int) -> _Shadow | None:
        """Bring the shadow's tokens in line with the sequence and reserve slots for k - 1 fed proposals."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = _Shadow(
                seq.seq_id, seq.request_id, seq.index, [], 0, seq.params
            )
        valid = shadow.base
        while (
            valid < shadow.num_computed_tokens
            and valid < seq.num_tokens
            and shadow.token_ids[valid] == seq.token_ids[valid]
        ):
            valid += 1
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, valid)
        shadow.token_ids = list(seq.token_ids)
        shadow.base = seq.num_tokens
        self.kv.trim(shadow, shadow.num_computed_tokens)
        if not self.kv.can_allocate(shadow, seq.num_tokens + k - 1):
            return None
        self.kv.allocate(shadow, seq.num_tokens + k - 1)
        return shadow

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.kv.free_seq(shadow)

    def blocks_in_use(self) -> int:
        return self.kv.num_used_blocks
