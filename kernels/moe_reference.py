"""Mixture-of-experts routing and the grouped expert MLP as plain torch: the CPU path and the oracle for the
Triton fused-MoE kernel (kernels/fused_moe.py).

Grouped GEMMs: the (token, slot) pairs are sorted by expert, so each expert runs one matmul over the rows
routed to it, rather than every expert over every token (HF's loop) or a gather of per-token weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def route(
    router_logits: torch.Tensor,  # [tokens, experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [tokens, top_k] float32, expert ids [tokens, top_k]
    """softmax over all experts in float32, then the top k; `renormalize` divides them by their sum (Mixtral
    always, which is the softmax over the top-k logits; Qwen3-MoE when `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_groups(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs of `ids` [tokens, top_k] sorted by expert (flat indices, token = index //
    top_k), and how many each expert got."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


ExpertMlp = Callable[[torch.Tensor], torch.Tensor]  # [rows, hidden] -> [rows, hidden]


def grouped_experts(
    x: torch.Tensor,  # [tokens, hidden]
    weights: torch.Tensor,  # [tokens, top_k] routing weights
    ids: torch.Tensor,  # [tokens, top_k] expert ids
    experts: Sequence[ExpertMlp],
) -> torch.Tensor:  # [tokens, hidden], in x's dtype
    """sum over k of weights[t, k] * experts[ids[t, k]](x[t]), one call per expert over its routed rows."""
    top_k = ids.shape[1]
    order, counts = expert_groups(ids, len(experts))
    tokens = order // top_k
    scale = weights.flatten().index_select(0, order).to(x.dtype).unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            rows = tokens[start : start + count]
            out.index_add_(0, rows, expert(x.index_select(0, rows)) * scale[start : start + count])
        start += count
    return out


def moe_reference(
    x: torch.Tensor,  # [tokens, hidden]
    w_gate_up: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows then up rows
    w_down: torch.Tensor,  # [experts, hidden, inter]
    weights: torch.Tensor,  # [tokens, top_k]
    ids: torch.Tensor,  # [tokens, top_k]
) -> torch.Tensor:  # [tokens, hidden]
    """The grouped expert SwiGLU MLP on stacked weights, as the Triton kernel computes it."""

    def expert(e: int) -> ExpertMlp:
        def mlp(rows: torch.Tensor) -> torch.Tensor:
            gate, up = (rows @ w_gate_up[e].t()).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ w_down[e].t()

        return mlp

    return grouped_experts(x, weights, ids, [expert(e) for e in range(w_gate_up.shape[0])])
