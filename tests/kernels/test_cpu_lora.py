"""The native gathered LoRA kernel (kernels/cpu/lora.cpp) against its torch reference: odd row counts,
ranks and widths, groups of one row and of every row, rows out of order, a group an adapter skips, fused
pieces whose columns leave gaps, and each thread count."""

from __future__ import annotations

import pytest
import torch
from specfleet.kernels import cpu_build, cpu_lora

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="native CPU kernels did not build (no g++)")


def _adapter(gen: torch.Generator, k: int, n: int, rank: int, cols: list[tuple[int, int]]):
    """a_t [k, pieces * rank] and a block-diagonal b_t [pieces * rank, n]: each piece writes its columns."""
    a_t = torch.randn(k, len(cols) * rank, generator=gen)
    b_t = torch.zeros(len(cols) * rank, n)
    for p, (c0, c1) in enumerate(cols):
        b_t[p * rank : (p + 1) * rank, c0:c1] = torch.randn(rank, c1 - c0, generator=gen)
    cols_t = torch.tensor(cols, dtype=torch.int64).reshape(len(cols), 2)
    return a_t, b_t, cpu_lora.describe(a_t, b_t, rank, cols_t)


@pytest.mark.parametrize("tokens", [1, 7, 33, 129])
@pytest.mark.parametrize("k_n", [(40, 33), (96, 200), (17, 300)], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_gathered_deltas_equal_the_reference(tokens: int, k_n: tuple[int, int], threads: int) -> None:
    k, n = k_n
    gen = torch.Generator().manual_seed(tokens * 1000 + k)
    third = n // 3
    adapters = [
        _adapter(gen, k, n, 5, [(0, n)]),
        _adapter(gen, k, n, 16, [(0, third), (third + 3, n)]),  # two pieces, a gap of untouched columns
        _adapter(gen, k, n, 1, [(0, n)]),
        None,  # an adapter that leaves this projection alone
    ]
    order = torch.randperm(tokens, generator=gen).tolist()
    base_rows = order[: tokens // 5]  # rows of the base model: never written
    rest = order[tokens // 5 :]
    groups = cpu_lora.RowGroups.of([rest[0::4], rest[1::4], rest[2::4], rest[3::4]])
    x = torch.randn(tokens, k, generator=gen)
    y = torch.randn(tokens, n, generator=gen)
    want = cpu_lora.lora_add_reference(
        y.clone(), x, groups, [(a, b) if d else None for a, b, d in _pairs(adapters)]
    )
    cpu_build.set_num_threads(threads)
    try:
        got = cpu_lora.lora_add(y.clone(), x, groups, [d for _, _, d in _pairs(adapters)])
    finally:
        cpu_build.set_num_threads(torch.get_num_threads())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    untouched = base_rows + rest[3::4]
    assert torch.equal(got[untouched], y[untouched])


def _pairs(adapters):
    return [(None, None, None) if a is None else a for a in adapters]


def test_one_group_of_every_row_and_strided_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    a_t, b_t, desc = _adapter(gen, 64, 96, 8, [(0, 96)])
    wide = torch.randn(9, 100, generator=gen)
    x = wide[:, :64]  # rows with a stride wider than their values, as a slice of a fused output
    y = torch.randn(9, 96, generator=gen)
    groups = cpu_lora.RowGroups.of([list(range(9))])
    want = y + (x @ a_t) @ b_t
    torch.testing.assert_close(cpu_lora.lora_add(y, x, groups, [desc]), want, atol=1e-4, rtol=1e-4)


def test_wrong_shapes_are_refused_with_the_shapes() -> None:
    gen = torch.Generator().manual_seed(3)
    _, _, desc = _adapter(gen, 32, 48, 4, [(0, 48)])
    groups = cpu_lora.RowGroups.of([[0, 1]])
    with pytest.raises(ValueError, match=r"x must be \[rows, 32\]"):
        cpu_lora.lora_add(torch.zeros(2, 48), torch.zeros(2, 31), groups, [desc])
    with pytest.raises(ValueError, match="1 weights for 2 row groups"):
        cpu_lora.lora_add(torch.zeros(2, 48), torch.zeros(2, 32), cpu_lora.RowGroups.of([[0], [1]]), [desc])
    with pytest.raises(ValueError, match="rows must index both"):
        cpu_lora.lora_add(torch.zeros(1, 48), torch.zeros(1, 32), groups, [desc])
    with pytest.raises(ValueError, match="a multiple of rank=5"):
        cpu_lora.describe(torch.zeros(32, 8), torch.zeros(8, 48), 5, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="fall outside b_t's 48 columns"):
        cpu_lora.describe(torch.zeros(32, 4), torch.zeros(4, 48), 4, torch.tensor([[0, 49]]))
