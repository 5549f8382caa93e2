"""`StructuredOutputManager`: the engine's side of structured outputs (vLLM V1 has a class of that name).

One backend, built at the first structured request; admission checks on the engine thread, compiles in a
pool (a request waits for its grammar, as vLLM's WAITING_FOR_FSM, while the others step); a matcher per
structured sequence; per step, the proposals cut to what the grammar allows and the bitmask the runner
applies to the logits."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from specfleet.engine.sequence import Sequence
from specfleet.engine.structured_output.bitmask import allocate_bitmask
from specfleet.engine.structured_output.errors import StructuredOutputError
from specfleet.engine.structured_output.spec import StructuredOutputSpec
from specfleet.engine.structured_output.speculative import draft_bitmask

if TYPE_CHECKING:  # the backend imports xgrammar (about 2 s of a cold start): the first structured request
    from specfleet.engine.structured_output.backend import GrammarBackend  # loads it, as vLLM does


@dataclass
class _Compile:
    """A grammar compiling in the pool, and the sequences that wait for it."""

    future: Future[Any]
    spec: StructuredOutputSpec
    seqs: list[Sequence]


class StructuredOutputManager:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], max_num_speculative_tokens: int
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.max_k = max_num_speculative_tokens
        self._backend: GrammarBackend | None = None
        # One compile at a time: xgrammar's compiler already spreads one grammar over two threads
        # (backend.py), and a queue of distinct schemas is served in arrival order.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiling: list[_Compile] = []

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

    def attach(self, seqs: list, spec: StructuredOutputSpec, prefix_param: str | None = None) -> None:
        """Give each of a new request's sequences its grammar. The checks that make a 400 run here
        (StructuredOutputError: the spec does not parse, matches no output, or refuses the output tokens
        the request arrived with, which `prefix_param` names); a grammar in the cache is attached now,
        any other compiles in the pool while its sequences wait (`seq.grammar_pending`), and `poll`
        attaches it when it is ready."""
        backend = self.backend
        backend.check(spec, after_reasoning(seqs[0]) or [], prefix_param)
        compiled = backend.cached(spec)
        if compiled is not None:
            for seq in seqs:
                self._start(seq, spec, compiled, prefix_param)
            return
        for seq in seqs:
            seq.grammar_pending = True
        self._compiling.append(_Compile(self._pool.submit(backend.compile, spec), spec, seqs))

    def poll(self) -> list[tuple[Sequence, str]]:
        """Attach the grammars compiled since the last call to their (unfinished) sequences; returns the
        sequences whose compile failed, with the error, for the engine to end."""
        failed: list[tuple[Sequence, str]] = []
        waiting: list[_Compile] = []
        for job in self._compiling:
            if not job.future.done():
                waiting.append(job)
                continue
            error = job.future.exception()
            for seq in job.seqs:
                if seq.is_finished:
                    continue
                seq.grammar_pending = False
                if error is not None:
                    failed.append((seq, str(error)))
                    continue
                try:
                    self._start(seq, job.spec, job.future.result())
                except StructuredOutputError as exc:  # admission accepted this prefix: not expected
                    failed.append((seq, str(exc)))
        self._compiling = waiting
        return failed

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def wait(self, timeout: float) -> None:
        """Block until a compile in flight finishes, or `timeout` seconds (a step with nothing else to do)."""
        if self._compiling:
            wait([job.future for job in self._compiling], timeout, FIRST_COMPLETED)

    def _start(
        self, seq: Sequence, spec: StructuredOutputSpec, compiled: Any, prefix_param: str | None = None
    ) -> None:
        """A matcher at the grammar's start, advanced through the sequence's output so far."""
        matcher = self.backend.matcher(spec, compiled)
        output = after_reasoning(seq)
        if output is None:  # still reasoning: the grammar waits (end_reasoning starts it)
            seq.grammar_after_reasoning = matcher
            return
        if output and not matcher.accept_tokens(output):
            raise StructuredOutputError(
                f"the output tokens {output} are not allowed by {self.backend.describe(spec)}",
                prefix_param or spec.source,
            )
        seq.grammar = matcher

    def end_reasoning(self, seq: Sequence) -> None:
        """After each token of a sequence whose grammar waits for the reasoning: start it once the output
        ends with the reasoning's end marker (the marker itself is free text)."""
        end = seq.params.reasoning_end_token_ids
        if end and seq.token_ids[-len(end) :] == end and seq.num_output_tokens >= len(end):
            seq.grammar, seq.grammar_after_reasoning = seq.grammar_after_reasoning, None

    def filter_proposals(self, seq) -> None:
        """Cut a structured sequence's proposals at the first the grammar forbids; keep the k + 1 mask rows.
        A sequence still reasoning keeps its proposals only up to the one that would end the reasoning: the
        token that ends it is the last of its step, so the tokens after it are sampled under the grammar."""
        if seq.grammar_after_reasoning is not None and seq.spec_token_ids:
            cut = _reasoning_end_at(
                seq.output_token_ids, seq.spec_token_ids, seq.params.reasoning_end_token_ids
            )
            if cut is not None:
                del seq.spec_token_ids[cut:]
                if seq.spec_probs is not None:
                    seq.spec_probs = seq.spec_probs[:cut] if cut else None
            return
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


def after_reasoning(seq: Sequence) -> list[int] | None:
    """The output tokens a grammar constrains: all of them, or (a request that reasons first) those after
    the reasoning's end marker; None while the reasoning has not ended."""
    output = seq.output_token_ids
    end = seq.params.reasoning_end_token_ids
    if not end:
        return output
    for start in range(len(output) - len(end), -1, -1):
        if output[start : start + len(end)] == end:
            return output[start + len(end) :]
    return None


def _reasoning_end_at(output: list[int], proposals: list[int], end: list[int]) -> int | None:
    """The index of the proposal that would complete `end` after `output`, or None."""
    tokens = output[-(len(end) - 1) :] if len(end) > 1 else []
    for j, token in enumerate(proposals):
        tokens.append(token)
        if tokens[-len(end) :] == end:
            return j
    return None
