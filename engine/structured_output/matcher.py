"""`GrammarMatcher`: one request's position in its grammar; accept, roll back, fill its next-token mask."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class GrammarMatcher:
    """Wraps xgrammar's matcher with the interface vLLM's structured-output grammars have
    (accept_tokens / validate_tokens / rollback / fill_bitmask / is_terminated).

    The matcher terminates when it accepts a stop token at a point where the grammar is complete; a
    terminated matcher's mask allows only the stop tokens. `rollback` undoes accepted tokens, at most
    `max_rollback_tokens` of them (the backend sets it to cover a speculative step)."""

    def __init__(self, compiled: xgr.CompiledGrammar, max_rollback_tokens: int):
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)
        self._stop_token_ids = list(self._m.stop_token_ids)
        self.max_rollback_tokens = max_rollback_tokens
        self.num_accepted = 0  # tokens accepted since the start (or reset), net of rollbacks

    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (and no change) if the grammar forbids it here."""
        if not self._m.accept_token(int(token)):
            return False
        self.num_accepted += 1
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance by all of `tokens`, or by none of them (False) if any is forbidden."""
        if self._within_rollback(len(tokens)):
            if self.validate_tokens(tokens) < len(tokens):
                return False
            for token in tokens:
                self.accept_token(token)
            return True
        trial = self._m.fork()  # more tokens than rollback reaches: try them on a copy
        if _advance(trial, tokens) < len(tokens):
            return False
        self._m = trial
        self.num_accepted += len(tokens)
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the grammar accepts from here; the state is unchanged."""
        if not self._within_rollback(len(tokens)):
            return _advance(self._m.fork(), tokens)
        n = 0
        for token in tokens:
            if not self.accept_token(token):
                break
            n += 1
        self.rollback(n)
        return n

    def _within_rollback(self, num_tokens: int) -> bool:
        return self.max_rollback_tokens < 0 or num_tokens <= self.max_rollback_tokens

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens == 0:
            return
        if not 0 < num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} accepted")
        if 0 <= self.max_rollback_tokens < num_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: max_rollback_tokens={self.max_rollback_tokens}"
            )
        self._m.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([rows, ceil(vocab / 32)] int32, CPU)."""
        if self._m.is_terminated():
            bitmask[row] = 0
            for token in self._stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def reset(self) -> None:
        self._m.reset()
        self.num_accepted = 0


def _advance(matcher: xgr.GrammarMatcher, tokens: Sequence[int]) -> int:
    """Accept tokens until one is refused; returns how many were accepted."""
    for n, token in enumerate(tokens):
        if not matcher.accept_token(int(token)):
            return n
    return len(tokens)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a signed value (bit 31 is the sign bit)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j
