"""The Triton LoRA shrink/expand kernels under the interpreter: against the torch reference and against the
native CPU kernel (kernels/cpu/lora.cpp) on the same adapters. Mixed batches with base-model tokens
(-1), ranks 8, 16 and 64 padded to the batch's largest, fused q/k/v slices of unequal width, tokens out of
order, and the split-K shrink. Sizes stay tiny: the interpreter runs every program in Python."""

from __future__ import annotations

import pytest
import torch
from specfleet.kernels import cpu_build, cpu_lora
from specfleet.kernels.lora_reference import lora_expand_reference, lora_gather_bmm, lora_shrink_reference
from specfleet.kernels.lora_shrink_expand import LoraMapping, lora_expand, lora_shrink

# (tokens, hidden, slice widths, adapters' ranks): q/k/v-like unequal slices, one slice, a rank-64 adapter
CASES = [
    (7, 40, [24, 8, 8], [8, 16]),
    (33, 24, [40], [16, 8, 64]),
    (20, 72, [16, 16], [64]),
]


def _batch(tokens: int, hidden: int, widths: list[int], ranks: list[int], seed: int):
    """Stacked weights as the kernels take them (ranks zero-padded) and each adapter's own A/B pieces."""
    g = torch.Generator().manual_seed(seed)
    slices, loras, rmax, wmax = len(widths), len(ranks), max(ranks), max(widths)
    a = torch.zeros(slices, loras, rmax, hidden)
    b = torch.zeros(slices, loras, wmax, rmax)
    for lora, rank in enumerate(ranks):
        a[:, lora, :rank] = torch.randn(slices, rank, hidden, generator=g) / hidden**0.5
        for sl, width in enumerate(widths):
            b[sl, lora, :width, :rank] = torch.randn(width, rank, generator=g)
    # every adapter and the base model (-1) in the step, interleaved in a random order
    token_lora = (torch.arange(tokens) % (loras + 1)) - 1
    token_lora = token_lora[torch.randperm(tokens, generator=g)]
    x = torch.randn(tokens, hidden, generator=g)
    out = torch.randn(tokens, sum(widths) + 3, generator=g)  # 3 trailing columns no slice owns
    starts = [sum(widths[:i]) for i in range(slices + 1)]
    return x, a, b, starts, token_lora, out


@pytest.mark.parametrize(("tokens", "hidden", "widths", "ranks"), CASES, ids=str)
def test_shrink_expand_match_the_reference(
    tokens: int, hidden: int, widths: list[int], ranks: list[int]
) -> None:
    x, a, b, starts, token_lora, out = _batch(tokens, hidden, widths, ranks, seed=tokens)
    mapping = LoraMapping.of(token_lora)
    s = lora_shrink(x, a, mapping)
    want_s = lora_shrink_reference(x, a, token_lora)
    has = token_lora >= 0
    torch.testing.assert_close(s[:, has], want_s[:, has], rtol=1e-4, atol=1e-4)
    got = lora_expand(out.clone(), s, b, starts, mapping)
    want = lora_expand_reference(out.clone(), want_s, b, starts, token_lora)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[~has], out[~has])  # base-model tokens untouched
    assert torch.equal(got[:, starts[-1] :], out[:, starts[-1] :])  # columns of no slice untouched
    assert not torch.allclose(got[has], out[has])  # and the adapters' tokens did move
    torch.testing.assert_close(
        lora_gather_bmm(out.clone(), x, a, b, starts, token_lora), want, rtol=1e-4, atol=1e-4
    )


def test_split_k_shrink_sums_every_k_range() -> None:
    x, a, _, _, token_lora, _ = _batch(9, 80, [8], [16, 8], seed=3)
    mapping = LoraMapping.of(token_lora)
    has = token_lora >= 0
    got = lora_shrink(x, a, mapping, split_k=3)  # 80 columns in 64-wide steps: ranges of 64, 16 and none
    torch.testing.assert_close(
        got[:, has], lora_shrink_reference(x, a, token_lora)[:, has], rtol=1e-4, atol=1e-4
    )


@pytest.mark.skipif(not cpu_build.available(), reason="native CPU kernels did not build (no g++)")
def test_fused_qkv_equals_the_cpu_kernel() -> None:
    """The engine's CPU layout (A_t stacked, B_t block-diagonal, kernels/cpu_lora.py) and the Triton layout
    of the same adapters give the same fused q/k/v output."""
    tokens, hidden, widths, ranks = 11, 32, [24, 8, 8], [8, 16]
    x, a, b, starts, token_lora, out = _batch(tokens, hidden, widths, ranks, seed=11)
    descs = []
    for lora, rank in enumerate(ranks):
        a_t = torch.cat([a[sl, lora, :rank].t() for sl in range(len(widths))], dim=1).contiguous()
        b_t = torch.zeros(len(widths) * rank, out.shape[1])
        for sl, w in enumerate(widths):
            b_t[sl * rank : (sl + 1) * rank, starts[sl] : starts[sl] + w] = b[sl, lora, :w, :rank].t()
        cols = torch.tensor([[starts[i], starts[i + 1]] for i in range(len(widths))], dtype=torch.int64)
        descs.append(cpu_lora.describe(a_t, b_t, rank, cols))
    groups = cpu_lora.RowGroups.of(
        [(token_lora == lora).nonzero().flatten().tolist() for lora in range(len(ranks))]
    )
    want = cpu_lora.lora_add(out.clone(), x, groups, descs)
    mapping = LoraMapping.of_groups(groups.rows, groups.starts, tokens)
    got = lora_expand(out.clone(), lora_shrink(x, a, mapping), b, starts, mapping)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_mapping_groups_tokens_by_adapter_and_leaves_the_base_out() -> None:
    m = LoraMapping.of(torch.tensor([2, -1, 0, 2, -1, 0, 0]))
    assert m.tokens.tolist() == [2, 5, 6, 0, 3]
    assert m.starts.tolist() == [0, 3, 5]
    assert m.lora_ids.tolist() == [0, 2]
    assert LoraMapping.of(torch.full((4,), -1)).groups == 0


def test_refuses_a_rank_past_64_and_mismatched_shapes() -> None:
    x, mapping = torch.randn(3, 8), LoraMapping.of(torch.tensor([0, -1, 0]))
    with pytest.raises(ValueError, match="MAX_RANK=64"):
        lora_shrink(x, torch.randn(1, 1, 65, 8), mapping)
    with pytest.raises(ValueError, match="K=9"):
        lora_shrink(x, torch.randn(1, 1, 8, 9), mapping)
    with pytest.raises(ValueError, match="slice_starts"):
        lora_expand(torch.zeros(3, 10), torch.zeros(1, 3, 8), torch.zeros(1, 1, 4, 8), [0, 6], mapping)
