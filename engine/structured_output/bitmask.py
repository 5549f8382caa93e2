"""Allowed-token bitmasks: int32 rows of ceil(vocab / 32) words, bit j of word w = token 32 * w + j.

The layout is xgrammar's and vLLM's (`[num_rows, ceil(vocab / 32)]`), so a grammar backend fills a row in
place and the sampler applies it to logits without conversion. `apply_token_bitmask_` masks the words
of 0 (32 forbidden tokens) with one broadcast `masked_fill_`, then leaves the rest to xgrammar's CPU
kernel, which skips words of -1 and is fast on the few mixed ones but slow on long runs of 0: 0.2-0.4 ms
for 32 rows inside a JSON string, ~2 ms for 32 mostly-forbidden rows, where either alone took 13-190 ms
on the loaded 2-core machine (docs/results/2026-12-01-structured-mask.md).
`apply_token_bitmask_reference_` unpacks every bit in torch (any device); the tests hold the two equal.
"""

from __future__ import annotations

import torch

_BIT = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A [num_rows, ceil(vocab / 32)] int32 bitmask with every token allowed."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool, True where the token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BIT.to(bitmask.device)) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(
    logits: torch.Tensor,  # [num_rows, vocab] float
    bitmask: torch.Tensor,  # [num_masks, ceil(vocab / 32)] int32
    indices: list[int] | None = None,  # [num_masks] the logits row each mask row applies to; default i -> i
) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place. Returns dead: [num_masks] bool.

    A mask row with no allowed token (a grammar at a dead end) would leave only -inf and a NaN softmax:
    such a row is not applied, and it is flagged in `dead` so that the caller ends that request."""
    rows = _check(logits, bitmask, indices)
    dead = ~bitmask.ne(0).any(dim=1)
    if bool(dead.any()):
        bitmask = bitmask.clone()
        bitmask[dead] = -1
    num_rows, words = logits.shape[0], bitmask.shape[1]
    fast = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
    if not fast or logits.shape[1] != 32 * words:
        apply_token_bitmask_reference_(logits, bitmask, rows)
        return dead
    if rows is not None:  # one mask row per logits row, every token allowed where none was given
        spread = torch.full((num_rows, words), -1, dtype=torch.int32)
        spread[torch.tensor(rows)] = bitmask
        bitmask = spread
    zero = bitmask == 0
    if bool(zero.any()):
        logits.view(num_rows, words, 32).masked_fill_(zero.unsqueeze(-1), float("-inf"))
        bitmask = bitmask.masked_fill(zero, -1)
    import xgrammar as xgr  # here, not at the top: the model runner imports this module in every engine

    xgr.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
    return dead


def apply_token_bitmask_reference_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None = None
) -> None:
    """The torch reference of `apply_token_bitmask_` (any device and dtype), without the dead-row guard."""
    rows = torch.arange(bitmask.shape[0]) if indices is None else torch.tensor(indices, dtype=torch.long)
    rows = rows.to(logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None) -> list[int] | None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} of shape {tuple(bitmask.shape)}"
        )
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if bitmask.shape[1] != bitmask_words(logits.shape[1]):
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words a row; logits of vocab {logits.shape[1]} need "
            f"{bitmask_words(logits.shape[1])}: build it with the model's vocab size"
        )
    if indices is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"{bitmask.shape[0]} mask rows for {logits.shape[0]} logits rows: pass indices")
        return None
    indices = [int(i) for i in indices]
    if len(indices) != bitmask.shape[0]:
        raise ValueError(f"{len(indices)} indices for {bitmask.shape[0]} bitmask rows")
    if indices and not 0 <= min(indices) <= max(indices) < logits.shape[0]:
        raise ValueError(f"indices must lie in [0, {logits.shape[0]}), got {min(indices)}..{max(indices)}")
    return indices
