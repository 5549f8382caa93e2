"""Masks for a speculative step, as vLLM V1 builds them (PR #14702).

For a sequence with k drafted tokens the target verifies k + 1 positions. Row i of the step's mask is the
grammar's mask after the first i drafts, so the matcher is advanced through each valid draft, one row
written per position (the last row is the bonus position), then rolled back: the matcher follows only
the tokens the engine accepts after verification. Drafts are truncated at the first token the grammar
forbids, since the target could never accept it (its masked probability is 0)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from specfleet.engine.structured_output.bitmask import allocate_bitmask

if TYPE_CHECKING:  # the matcher's module imports xgrammar, which only a structured request should load
    from specfleet.engine.structured_output.matcher import GrammarMatcher


def draft_bitmask(
    matcher: GrammarMatcher, draft_tokens: Sequence[int], vocab_size: int, out: torch.Tensor | None = None
) -> tuple[int, torch.Tensor]:
    """Returns (num_valid, rows): the number of leading drafts the grammar accepts, and the
    [num_valid + 1, ceil(vocab / 32)] int32 mask rows for the positions the target verifies.

    out: optional [>= len(draft_tokens) + 1, words] int32 buffer to write into (rows is a view of it).
    The matcher's state is unchanged on return. A draft that ends the grammar (a stop token) is the
    last valid one; the row after it allows only stop tokens."""
    k = len(draft_tokens)
    if out is None:
        out = allocate_bitmask(k + 1, vocab_size)
    elif out.shape[0] < k + 1:
        raise ValueError(f"out has {out.shape[0]} rows, a step with {k} drafts needs {k + 1}")
    if k > matcher.max_rollback_tokens >= 0:
        raise ValueError(f"{k} drafts exceed the matcher's max_rollback_tokens={matcher.max_rollback_tokens}")
    num_valid = 0
    while True:
        matcher.fill_bitmask(out, num_valid)
        if num_valid == k or not matcher.accept_token(draft_tokens[num_valid]):
            break
        num_valid += 1
    matcher.rollback(num_valid)
    return num_valid, out[: num_valid + 1]
