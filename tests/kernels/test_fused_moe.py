"""The Triton fused-MoE kernel under the interpreter against the torch grouped reference, on odd shapes:
1, 7 and 33 tokens, experts some tokens never reach, widths off the 64-column tile."""

from __future__ import annotations

import pytest
import torch
from specfleet.kernels.fused_moe import align_blocks, fused_moe
from specfleet.kernels.moe_reference import moe_reference, route


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (7, 8, 2), (33, 5, 3)])
def test_fused_moe_matches_reference(tokens: int, experts: int, top_k: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    hidden, inter = 40, 24
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, renormalize=tokens % 2 == 1)
    expected = moe_reference(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(fused_moe(x, w_gate_up, w_down, weights, ids), expected, rtol=1e-4, atol=1e-4)


def test_align_blocks_pads_each_expert_to_whole_blocks() -> None:
    ids = torch.tensor([[0, 2], [2, 0], [2, 1]])
    pair_ids, block_expert = align_blocks(ids, 4, block_m=2)
    assert block_expert.tolist() == [0, 1, 2, 2]  # expert 3 gets no block, expert 2's three pairs two
    assert pair_ids.tolist() == [0, 3, 5, 6, 1, 2, 4, 6]  # 6 = the padding sentinel (num_pairs)


def test_fused_moe_refuses_mismatched_weights() -> None:
    x, ids = torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="w_down.shape"):
        fused_moe(x, torch.randn(2, 12, 8), torch.randn(2, 8, 5), torch.ones(3, 2), ids)
