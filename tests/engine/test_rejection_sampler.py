"""The rejection sampler preserves the target distribution (chi-square on 120k draws), with and without
top-k/top-p and for a point-mass (n-gram) proposer; the same test rejects a deliberately wrong sampler."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine.sampler import SamplingBatch, processed_probs
from specfleet.engine.spec_decode.rejection import rejection_sample, verify_greedy

VOCAB, K, DRAWS = 6, 3, 120_000
# chi-square critical value for 5 degrees of freedom at p = 1e-4: a correct sampler fails 1 run in 10,000
CRITICAL = 25.74


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "drew a token the target gives probability 0"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _processed(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    rows = logits.shape[0]
    batch = SamplingBatch(
        temperature=torch.full((rows,), 0.9),
        top_k=torch.full((rows,), top_k) if top_k else None,
        top_p=torch.full((rows,), top_p) if top_p < 1 else None,
        noise_keys=[None] * rows,
        all_greedy=False,
    )
    return processed_probs(logits, batch)


def _setup(seed: int, top_k: int, top_p: float, point_mass: bool):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(K + 1, VOCAB, generator=g) * 1.5
    p = _processed(target_logits, top_k, top_p)  # [K + 1, VOCAB]
    if point_mass:
        q = None
        drafts = torch.randint(VOCAB, (DRAWS, K), generator=g)
    else:
        q_rows = _processed(torch.randn(K, VOCAB, generator=g) * 1.5, top_k, top_p)
        q = q_rows.expand(DRAWS, K, VOCAB)
        drafts = torch.stack(
            [torch.multinomial(q_rows[i], DRAWS, replacement=True, generator=g) for i in range(K)], dim=1
        )
    return p, q, drafts


def _first_token(p, q, drafts, sampler=rejection_sample):
    nxt, accepted = sampler(p.expand(DRAWS, K + 1, VOCAB), q, drafts, torch.Generator().manual_seed(7))
    return torch.where(accepted > 0, drafts[:, 0], nxt)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (4, 1.0), (0, 0.8), (5, 0.9)])
@pytest.mark.parametrize("point_mass", [False, True])
def test_first_emitted_token_follows_target(top_k, top_p, point_mass):
    p, q, drafts = _setup(3, top_k, top_p, point_mass)
    assert _chi_square(_first_token(p, q, drafts), p[0]) < CRITICAL


def test_bonus_token_after_full_acceptance_follows_target():
    p, q, drafts = _setup(5, 0, 1.0, False)
    nxt, accepted = rejection_sample(
        p.expand(DRAWS, K + 1, VOCAB), q, drafts, torch.Generator().manual_seed(11)
    )
    full = accepted == K
    assert full.sum() > 1000
    assert _chi_square(nxt[full], p[K]) < CRITICAL


def accept_if_equal(p, q, drafts, default):
    """A wrong sampler: greedy-style verification applied to sampled rows (accept a draft while it
    equals the target's most likely token, then emit that token)."""
    best = p.argmax(dim=-1)  # [batch, k + 1]
    accepted = (drafts == best[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    return best[torch.arange(len(drafts)), accepted], accepted


def test_the_test_has_power_against_a_wrong_sampler():
    p, q, drafts = _setup(3, 0, 1.0, False)
    assert _chi_square(_first_token(p, q, drafts), p[0]) < CRITICAL
    assert _chi_square(_first_token(p, q, drafts, sampler=accept_if_equal), p[0]) > 100 * CRITICAL


def test_greedy_verification():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert verify_greedy([1, 2], [3]) == [1]
