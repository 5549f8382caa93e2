"""Verification of proposals against the target (Leviathan et al. 2023; Chen et al. 2023).

Greedy rows accept while the proposal equals the target's argmax and then emit the argmax. Sampled
rows accept proposal x at position i with probability min(1, p_i(x) / q_i(x)); at the first rejection
they emit a draw from norm(max(p_i - q_i, 0)), and when all k are accepted a bonus draw from p_k.
p and q are the *processed* distributions (temperature, top-k, top-p applied alike), so the emitted
tokens follow the target's distribution exactly. A proposer without q (n-gram) is a point mass.

Seeded rows are not verified here: they accept a draft while it equals the target's own keyed draw
(`verify_greedy` on those draws; see sampler.py), which keeps their output independent of speculation.
"""

from __future__ import annotations

import torch
from specfleet.engine.sampler import exponential_noise


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """target_argmax: [k + 1] the target's choice after each prefix (its argmax, or a seeded row's keyed
    draw); returns the emitted tokens."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return target_argmax[: accepted + 1]


def rejection_sample(
    p: torch.Tensor,  # [batch, k + 1, vocab] target probabilities after each prefix
    q: torch.Tensor | None,  # [batch, k, vocab] draft probabilities, None for a point mass
    drafts: torch.Tensor,  # [batch, k] int64 proposed tokens
    default: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (next_tokens [batch] int64, num_accepted [batch] int64): the emitted tokens of row b
    are drafts[b, :num_accepted[b]] followed by next_tokens[b]."""
    batch, k = drafts.shape
    device = p.device
    rows = torch.arange(batch, device=device)
    p_draft = p[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    ratio = p_draft if q is None else p_draft / q.gather(2, drafts.unsqueeze(-1)).squeeze(-1).clamp_min(1e-20)
    uniform = torch.rand((batch, k), generator=default, device=device)
    accept = uniform < ratio.clamp(max=1.0)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading run of acceptances

    target = p[rows, num_accepted]  # [batch, vocab]: the distribution at the first rejection (or bonus)
    rejected = num_accepted < k
    at = num_accepted.clamp(max=k - 1)
    if q is None:
        draft_row = torch.zeros_like(target).scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
    else:
        draft_row = q[rows, at]
    residual = (target - draft_row).clamp_min(0.0)
    mass = residual.sum(dim=1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-20), target)
    dist = torch.where(rejected.unsqueeze(1), residual, target)
    noise = exponential_noise(tuple(dist.shape), [None] * batch, default, device)
    return (dist / noise).argmax(dim=1), num_accepted
