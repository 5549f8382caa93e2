"""Multi-LoRA shrink and expand as plain torch: the oracle for the Triton kernels (kernels/lora_shrink_expand.py)
and the gather-bmm baseline bench/gpu times them against.

The layout is the kernels': an adapter's fused projection (q/k/v, gate/up) is `slices` pieces, each with its
own A [rank, in] and B [out, rank]; the batch's adapters are stacked, ranks zero-padded to the batch's
largest, B's rows zero-padded to the widest slice:

    a [slices, loras, rank, in]      b [slices, loras, width, rank]      slice_starts [slices + 1]

Token t runs adapter token_lora[t] (-1: the base model, left untouched). Shrink gives s [slices, T, rank] =
x[t] @ a[s, lora]^T; expand adds s[s, t] @ b[s, lora]^T into out[t, slice_starts[s] : slice_starts[s + 1]].
The LoRA scale is folded into B, as the CPU kernel's B_t carries it (engine/lora/adapter.py).
"""

from __future__ import annotations

import torch


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """s [slices, T, rank] float32 (rows of tokens without an adapter are zero), one matmul per adapter."""
    slices, loras, rank, _ = a.shape
    s = torch.zeros(slices, x.shape[0], rank, dtype=torch.float32, device=x.device)
    for lora in range(loras):
        rows = (token_lora == lora).nonzero().flatten()
        if rows.numel():
            s[:, rows] = torch.einsum("th,srh->str", x[rows].float(), a[:, lora].float())
    return s


def lora_expand_reference(
    out: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slice_starts: list[int], token_lora: torch.Tensor
) -> torch.Tensor:
    """out [T, N] += each slice's s @ B^T in its columns, for tokens with an adapter; in place, returns out."""
    for lora in range(b.shape[1]):
        rows = (token_lora == lora).nonzero().flatten()
        if not rows.numel():
            continue
        for sl in range(b.shape[0]):
            c0, c1 = slice_starts[sl], slice_starts[sl + 1]
            delta = s[sl, rows] @ b[sl, lora, : c1 - c0].float().t()
            out[rows, c0:c1] += delta.to(out.dtype)
    return out


def lora_gather_bmm(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slice_starts: list[int],
    token_lora: torch.Tensor,
) -> torch.Tensor:
    """The plain-torch baseline: gather every token's A and B, then two batched matmuls per slice (what a
    serving stack without grouped kernels does; it copies each token's weights). Tokens without an adapter
    (-1) gather adapter 0 and are masked out. In place, returns out."""
    idx = token_lora.clamp(min=0)
    keep = (token_lora >= 0).to(out.dtype).unsqueeze(1)
    for sl in range(a.shape[0]):
        c0, c1 = slice_starts[sl], slice_starts[sl + 1]
        shrunk = torch.bmm(x.unsqueeze(1), a[sl].index_select(0, idx).transpose(1, 2))  # [T, 1, rank]
        delta = torch.bmm(shrunk, b[sl, :, : c1 - c0].index_select(0, idx).transpose(1, 2)).squeeze(1)
        out[:, c0:c1] += delta * keep
    return out
