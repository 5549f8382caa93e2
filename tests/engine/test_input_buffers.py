"""The persistent step buffers give the tensors a step used to build from lists, and a step's views stay
intact while the other sets of the ring are filled."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine.input_buffers import INITIAL_TOKEN_ENTRIES, StepBuffers


def _step(seed: int, num_seqs: int, tokens_each: int) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    tables = [
        torch.randint(0, 900, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_seqs)
    ]
    qlens = [tokens_each] * num_seqs
    n = sum(qlens)
    return {
        "ids": torch.randint(0, 49152, (n,), generator=g).tolist(),
        "positions": list(range(n)),
        "slots": torch.randint(0, 10_000, (n,), generator=g).tolist(),
        "query_lens": qlens,
        "seq_lens": [q + 5 for q in qlens],
        "tables": tables,
    }


def _expected(step: dict[str, list]) -> dict[str, torch.Tensor]:
    width = max(len(t) for t in step["tables"])
    starts = [0]
    for q in step["query_lens"]:
        starts.append(starts[-1] + q)
    return {
        "input_ids": torch.tensor(step["ids"], dtype=torch.int64),
        "positions": torch.tensor(step["positions"], dtype=torch.int64),
        "slot_mapping": torch.tensor(step["slots"], dtype=torch.int64),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "seq_lens": torch.tensor(step["seq_lens"], dtype=torch.int32),
        "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in step["tables"]], dtype=torch.int32),
    }


def _check(got, want: dict[str, torch.Tensor]) -> None:
    for name, tensor in want.items():
        view = getattr(got, name)
        assert view.dtype == tensor.dtype and view.is_contiguous(), name
        assert torch.equal(view, tensor), name


def test_views_equal_the_tensors_built_from_lists_and_survive_the_ring() -> None:
    buffers = StepBuffers(torch.device("cpu"), ring=3)
    steps = [_step(i, num_seqs=3 + i, tokens_each=1 + i % 2) for i in range(3)]
    got = [buffers.fill(**s) for s in steps]
    for g, s in zip(got, steps):  # each set untouched by filling the two others
        _check(g, _expected(s))
    buffers.fill(**_step(9, 2, 1))  # the ring comes round: set 0 is reused
    _check(got[1], _expected(steps[1]))
    _check(got[2], _expected(steps[2]))


def test_a_step_larger_than_the_buffers_grows_them_and_a_smaller_one_pads_its_table_with_zeros() -> None:
    buffers = StepBuffers(torch.device("cpu"), ring=1)
    big = _step(
        1, num_seqs=300, tokens_each=INITIAL_TOKEN_ENTRIES // 300
    )  # 300 sequences, 8100 tokens (3 rows each)
    _check(buffers.fill(**big), _expected(big))
    small = _step(2, num_seqs=2, tokens_each=3)
    small["tables"] = [[5, 6, 7, 8, 9, 10], [4]]  # the second row is padded after a wider step used it
    _check(buffers.fill(**small), _expected(small))
    small["tables"] = [[5, 6], [7, 8]]  # equal widths: copied as one block
    _check(buffers.fill(**small), _expected(small))


def test_a_ring_needs_a_set() -> None:
    with pytest.raises(ValueError, match="ring=0 must be >= 1"):
        StepBuffers(torch.device("cpu"), ring=0)
