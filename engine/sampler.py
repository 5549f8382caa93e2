"""Sampling over a batch of logits rows, vectorised: logit bias and masks, penalties, temperature, min-p,
top-k, top-p, seeds.

Random draws use the exponential-race form (argmax of p / E with E ~ Exp(1)). A seeded request's noise
for its t-th output token comes from a stream keyed by (its sample's seed, t) alone, so its tokens do not
depend on the batch it shares, on preemption, or on speculation: verification of a seeded row accepts a
draft exactly when it equals the token this noise picks from the target's distribution, so speculation on,
off, or at any k emits the same tokens. Every unseeded row shares one draw from the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specfleet.engine.outputs import PositionLogprobs
from specfleet.engine.sequence import Sequence

# A token the model gives no probability (a -inf logit) reports this logprob: JSON has no -Infinity, and
# vLLM's OpenAI server clamps to the same value.
LOGPROB_FLOOR = -9999.0
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
    min_p: torch.Tensor | None = None  # [rows] float32, None when no row uses it
    presence: torch.Tensor | None = None  # [rows] float32
    frequency: torch.Tensor | None = None  # [rows] float32
    output_counts: torch.Tensor | None = None  # [rows, vocab] float32, tokens generated so far
    repetition: torch.Tensor | None = None  # [rows] float32, 1 = off
    seen: torch.Tensor | None = None  # [rows, vocab] bool, tokens in the prompt or the output
    bias: torch.Tensor | None = None  # [rows, vocab] float32 added first: logit_bias and the masks


def build_sampling_batch(
    seqs: list[Sequence],
    vocab: int,
    eos_token_ids: set[int],
    device: torch.device,
    penalties: bool = True,
    offsets: list[int] | None = None,
) -> SamplingBatch:
    """Rows for `seqs` (a sequence appears once per row it samples). offsets: [rows] how far past the
    sequence's current output each row samples (speculative rows). penalties=False leaves out what
    `apply_penalties` needs (already applied to these logits)."""
    params = [s.params for s in seqs]
    offsets = offsets or [0] * len(seqs)
    keys = [None if s.seed is None else (s.seed, s.num_output_tokens + o) for s, o in zip(seqs, offsets)]

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    batch = SamplingBatch(
        temperature=f32([p.temperature for p in params]),
        top_k=(
            torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
            if any(p.top_k > 0 for p in params)
            else None
        ),
        top_p=f32([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        noise_keys=keys,
        all_greedy=all(p.temperature == 0 for p in params),
        min_p=f32([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
    )
    if not penalties:
        return batch
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = torch.zeros(len(seqs), vocab, device=device)
        for row, s in enumerate(seqs):
            if s.num_output_tokens and (s.params.presence_penalty or s.params.frequency_penalty):
                out = torch.tensor(s.output_token_ids, device=device)
                counts[row].scatter_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
        batch.output_counts = counts
        batch.presence = f32([p.presence_penalty for p in params])
        batch.frequency = f32([p.frequency_penalty for p in params])
    if any(p.repetition_penalty != 1.0 for p in params):
        batch.repetition = f32([p.repetition_penalty for p in params])
        batch.seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
        for row, s in enumerate(seqs):
            if s.params.repetition_penalty != 1.0:
                batch.seen[row, torch.tensor(s.token_ids, device=device)] = True
    rows = [
        (row, s, o)
        for row, (s, o) in enumerate(zip(seqs, offsets))
        if s.params.uses_bias or s.params.bad_words or s.num_output_tokens + o < s.params.min_tokens
    ]
    if rows:
        batch.bias = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=device)
        for row, s, offset in rows:
            _bias_row(batch.bias[row], s, offset, eos_token_ids)
    return batch


def _bias_row(bias: torch.Tensor, seq: Sequence, offset: int, eos_token_ids: set[int]) -> None:
    params, inf = seq.params, float("inf")
    if params.allowed_token_ids is not None:
        bias.fill_(-inf)
        bias[[t for t in params.allowed_token_ids if t < bias.numel()]] = 0.0
    for token, value in (params.logit_bias or {}).items():
        if token < bias.numel():
            bias[token] += value
    if (
        seq.num_output_tokens + offset < params.min_tokens and seq.grammar is None
    ):  # no stop before min_tokens
        # (a structured sequence's min_tokens is in its grammar mask, which may allow only a stop token)
        bias[sorted(eos_token_ids | set(params.stop_token_ids))] = -inf
    output = seq.output_token_ids
    for word in params.bad_words_token_ids or []:  # a word's last token, when the output ends with the rest
        if len(word) == 1 or (
            len(output) >= len(word) - 1 and output[len(output) - len(word) + 1 :] == word[:-1]
        ):
            bias[word[-1]] = -inf


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Bias and masks first, then repetition, frequency and presence penalties (vLLM's order)."""
    if batch.bias is not None:
        logits = logits + batch.bias
    if batch.repetition is not None:
        assert batch.seen is not None, "build_sampling_batch sets seen with repetition"
        penalty = batch.repetition.unsqueeze(1)
        logits = torch.where(batch.seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if batch.output_counts is not None:
        counts = batch.output_counts
        assert batch.frequency is not None and batch.presence is not None, "set with output_counts"
        logits = logits - counts * batch.frequency.unsqueeze(1) - (counts > 0) * batch.presence.unsqueeze(1)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
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
    """The distribution a sampled row draws from: temperature, min-p, then top-k/top-p. Greedy rows get
    a point mass on their argmax."""
    temperature = batch.temperature.clamp_min(1e-5).unsqueeze(1)
    logits = logits / temperature
    if batch.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    probs = apply_top_k_top_p(logits, batch.top_k, batch.top_p).softmax(dim=-1)
    greedy = batch.temperature == 0
    if bool(greedy.any()):
        point = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), point, probs)
    return probs


def exponential_noise(
    shape: tuple[int, ...], keys: list[NoiseKey | None], default: torch.Generator, device: torch.device
) -> torch.Tensor:
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


def logprobs_for(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[PositionLogprobs]:
    """Logprobs of the model's own distribution (before bias, penalties and temperature), as vLLM's
    default reports them: the chosen token with its rank, and the top `num_top`. Every value is finite:
    -inf and NaN become LOGPROB_FLOOR here, the one source of every logprob the engine reports."""
    logp = logits.float().log_softmax(dim=-1)
    logp = torch.nan_to_num(logp, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_min_(LOGPROB_FLOOR)
    chosen_t = logp.gather(1, tokens.view(-1, 1))
    ranks = (logp > chosen_t).sum(dim=1).add(1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    if num_top:
        top = logp.topk(num_top, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        PositionLogprobs(
            token, chosen[row], dict(zip(top_ids[row], top_vals[row])) if num_top else {}, ranks[row]
        )
        for row, token in enumerate(tokens.tolist())
    ]
