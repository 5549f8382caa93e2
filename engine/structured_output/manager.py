"""`StructuredOutputManager`: the engine's side of structured outputs (vLLM V1 has a class of that name).

One backend, built at the first structured request; a matcher per structured sequence; per step, the
proposals cut to what the grammar allows and the bitmask the runner applies to the logits."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from specfleet.engine.structured_output.bitmask import allocate_bitmask
from specfleet.engine.structured_output.spec import StructuredOutputSpec
from specfleet.engine.structured_output.speculative import draft_bitmask

if TYPE_CHECKING:  # the backend imports xgrammar (about 2 s of a cold start): the first structured request
    from specfleet.engine.structured_output.backend import GrammarBackend  # loads it, as vLLM does


class StructuredOutputManager:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], max_num_speculative_tokens: int
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.max_k = max_num_speculative_tokens
        self._backend: GrammarBackend | None = None

    @property
    def backend(self) -> GrammarBackend:
        if (
            self._backend is None
        ):  # import and build: ~2 s, paid once, by engines that serve structured requests
            from specfleet.engine.structured_output.backend import GrammarBackend

            self._backend = GrammarBackend(
                self.tokenizer, self.vocab_size, self.eos_token_ids, max_rollback_tokens=self.max_k + 1
            )
        return self._backend

    def attach(self, seqs: list, spec: StructuredOutputSpec) -> None:
        """Give each sequence a matcher at the grammar's start; StructuredOutputError if it cannot compile."""
        self.backend.compile(spec)
        for seq in seqs:
            seq.grammar = self.backend.matcher(spec)

    def filter_proposals(self, seq) -> None:
        """Cut a structured sequence's proposals at the first the grammar forbids; keep the k + 1 mask rows."""
        if seq.grammar is None or not seq.spec_token_ids:
            return
        if seq.grammar_rows is None:
            seq.grammar_rows = allocate_bitmask(self.max_k + 1, self.vocab_size)
        num_valid, _ = draft_bitmask(seq.grammar, seq.spec_token_ids, self.vocab_size, out=seq.grammar_rows)
        if num_valid < len(seq.spec_token_ids):
            del seq.spec_token_ids[num_valid:]
            if seq.spec_probs is not None:
                seq.spec_probs = seq.spec_probs[:num_valid] if num_valid else None

    def bitmask(self, scheduled) -> torch.Tensor | None:
        """[num_sample_rows, words] for the step's sampling items (num_spec_tokens + 1 rows each), or None."""
        items = [item for item in scheduled if item.sample]
        if not any(item.seq.grammar is not None for item in items):
            return None
        mask = allocate_bitmask(sum(item.num_spec_tokens + 1 for item in items), self.vocab_size)
        row = 0
        for item in items:
            seq, n = item.seq, item.num_spec_tokens + 1
            if seq.grammar is not None:
                if item.num_spec_tokens:  # rows written when the proposals were filtered; a prefix if cut
                    mask[row : row + n] = seq.grammar_rows[:n]
                else:
                    seq.grammar.fill_bitmask(mask, row)
                    if seq.num_output_tokens < seq.params.min_tokens:
                        self._ban_stop_tokens(mask, row, seq.params.stop_token_ids)
            row += n
        return mask

    def accept(self, seq, token: int) -> str:
        """The matcher takes the sequence's next token: "ok", "rejected" (the grammar refuses it) or
        "terminated" (a stop token ended the grammar)."""
        if not seq.grammar.accept_token(token):
            return "rejected"
        return "terminated" if seq.grammar.is_terminated() else "ok"

    def _ban_stop_tokens(self, mask: torch.Tensor, row: int, stop_token_ids: Iterable[int]) -> None:
        """min_tokens: no EOS or stop token yet, unless the grammar allows nothing else (it wins)."""
        saved = mask[row].clone()
        for token in self.eos_token_ids | set(stop_token_ids):
            word, bit = divmod(token, 32)
            mask[row, word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF
        if not bool(mask[row].ne(0).any()):
            mask[row] = saved
