"""Sampling on synthetic logits: top-k and top-p keep exactly the right tokens; seeds reproduce."""

from __future__ import annotations

import torch
from specfleet.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    apply_top_k_top_p,
    processed_probs,
    sample,
    sample_seed,
)


def _batch(rows, temperature=1.0, top_k=None, top_p=None, keys=None):
    return SamplingBatch(
        temperature=torch.full((rows,), temperature),
        top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        noise_keys=keys or [None] * rows,
        all_greedy=temperature == 0,
    )


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 5.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 6]), None)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [4, 5]
    assert torch.isfinite(out[1]).all()


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    logits = probs.log()
    # 0.5 < 0.6, 0.5 + 0.25 >= 0.6 -> two tokens
    kept = torch.isfinite(apply_top_k_top_p(logits, None, torch.tensor([0.6]))).nonzero()[:, 1].tolist()
    assert kept == [0, 1]
    kept = torch.isfinite(apply_top_k_top_p(logits, None, torch.tensor([0.5]))).nonzero()[:, 1].tolist()
    assert kept == [0]
    kept = torch.isfinite(apply_top_k_top_p(logits, None, torch.tensor([0.91]))).nonzero()[:, 1].tolist()
    assert kept == [0, 1, 2, 3]


def test_top_k_and_top_p_combined_renormalise():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = processed_probs(logits, _batch(1, top_k=[3], top_p=[0.7]))
    assert (probs[0, 3:] == 0).all()
    assert abs(float(probs.sum()) - 1) < 1e-6


def test_sampling_frequencies_follow_the_distribution():
    target = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = target.clamp_min(1e-12).log().repeat(20000, 1)
    tokens = sample(logits, _batch(20000), torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, target, atol=0.015)


def test_seeded_rows_reproduce_regardless_of_batch():
    logits = torch.randn(3, 50)
    key = (1234, 5)
    alone = [
        int(sample(logits[1:2], _batch(1, keys=[key]), torch.Generator().manual_seed(s))) for s in (1, 2)
    ]
    in_batch = sample(logits, _batch(3, keys=[None, key, None]), torch.Generator().manual_seed(99))
    assert alone[0] == alone[1] == int(in_batch[1])


def test_keyed_draws_follow_the_distribution_and_differ_by_position():
    target = torch.tensor([0.5, 0.3, 0.2])
    logits = target.log().repeat(6000, 1)
    keys = [(sample_seed(7, 0), position) for position in range(6000)]
    tokens = sample(logits, _batch(6000, keys=keys), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 6000
    assert torch.allclose(freq, target, atol=0.03)
    other = sample(
        logits, _batch(6000, keys=[(sample_seed(7, 1), p) for p in range(6000)]), torch.Generator()
    )
    assert 0.3 < float((tokens == other).float().mean()) < 0.45  # n > 1 samples are independent: 0.38


def test_penalties_lower_generated_tokens():
    logits = torch.zeros(1, 5)
    batch = _batch(1)
    batch.output_counts = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]])
    batch.presence = torch.tensor([0.5])
    batch.frequency = torch.tensor([0.25])
    out = apply_penalties(logits, batch)
    assert out[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0]
