"""Sampling over a batch of logits rows, vectorised: penalties, temperature, top-k, top-p, seeds.

Random draws use the exponential-race form (argmax of p / E with E ~ Exp(1)). A seeded request's noise
for its t-th output token comes from a stream keyed by (its sample's seed, t) alone, so its tokens do not
depend on the batch it shares, on preemption, or on speculation: verification of a seeded row accepts a
draft exactly when it equals the token this noise picks from the target's distribution, so speculation on,
off, or at any k emits the same tokens. Every unseeded row shares one draw from the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specfleet.engine.outputs import Logprob

NoiseKey = tuple[int, int]  # (a sample's seed, the output position being sampled)
_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed` (n > 1 samples differ)."""
    return _mix64(seed * 0x9E3779B97F4A7C15 + index)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit seeds."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_noise(key: NoiseKey, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] Exp(1) noise that depends on `key` only."""
    generator = torch.Generator(device=device).manual_seed(_mix64(key[0] + 0x632BE59BD9B4E019 * key[1]))
    return torch.empty(vocab, device=device).exponential_(generator=generator)


@dataclass
class SamplingBatch:
    """Per-row settings for one step; rows are the logits rows that produce tokens."""

    temperature: torch.Tensor  # [rows] float32, 0 = greedy
    top_k: torch.Tensor | None  # [rows] int64 (vocab size = off), None when no row uses it
    top_p: torch.Tensor | None  # [rows] float32, None when no row uses it
    noise_keys: list[NoiseKey | None]  # [rows] a seeded row's (sample seed, output position)
    all_greedy: bool
    presence: torch.Tensor | None = None  # [rows] float32
    frequency: torch.Tensor | None = None  # [rows] float32
    output_counts: torch.Tensor | None = None  # [rows, vocab] float32, tokens generated so far
    banned: list[tuple[int, list[int]]] | None = None  # (row, token ids) masked (min_tokens)
    num_logprobs: int | None = None  # top logprobs wanted by the most demanding row


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.output_counts is not None:
        counts = batch.output_counts
        logits = logits - counts * batch.frequency.unsqueeze(1) - (counts > 0) * batch.presence.unsqueeze(1)
    if batch.banned:
        logits = logits.clone() if batch.output_counts is None else logits
        for row, token_ids in batch.banned:
            logits[row, token_ids] = float("-inf")
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k and top-p (nucleus) set."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        remove |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        remove |= before >= top_p.unsqueeze(1)
        remove[:, 0] = False  # the most likely token always stays
    mask = torch.zeros_like(remove).scatter_(1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, then top-k/top-p. Greedy rows get a
    point mass on their argmax."""
    temperature = batch.temperature.clamp_min(1e-5).unsqueeze(1)
    probs = apply_top_k_top_p(logits / temperature, batch.top_k, batch.top_p).softmax(dim=-1)
    greedy = batch.temperature == 0
    if bool(greedy.any()):
        point = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), point, probs)
    return probs


def exponential_noise(shape: tuple[int, int], keys: list[NoiseKey | None], default: torch.Generator,
                      device: torch.device) -> torch.Tensor:
    """[rows, vocab] Exp(1) noise: keyed rows from their own stream, the others from `default`."""
    noise = torch.empty(shape, device=device).exponential_(generator=default)
    for row, key in enumerate(keys):
        if key is not None:
            noise[row] = keyed_noise(key, shape[1], device)
    return noise


def sample(logits: torch.Tensor, batch: SamplingBatch, default: torch.Generator) -> torch.Tensor:
    """[rows, vocab] float32 logits (penalties already applied) -> [rows] int64 tokens."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    probs = processed_probs(logits, batch)
    noise = exponential_noise(tuple(probs.shape), batch.noise_keys, default, probs.device)
    return (probs / noise).argmax(dim=-1)


def logprobs_for(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[Logprob]:
    """Logprobs of the model's own distribution (before penalties and temperature), as OpenAI reports."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
    result = []
    if num_top:
        top_vals, top_ids = logp.topk(num_top, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for row, token in enumerate(tokens.tolist()):
        top = dict(zip(top_ids[row], top_vals[row])) if num_top else {}
        result.append(Logprob(token, chosen[row], top))
    return result
