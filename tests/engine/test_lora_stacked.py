"""The CUDA path of a mixed-adapter step (engine/lora/batch.py with the Triton kernels, the adapters stacked
by engine/lora/stacked.py), run here on CPU tensors through Triton's interpreter: each projection's output
equals the native CPU kernel's on the same adapters, for adapters with different ranks and different pieces
of a fused q/k/v (one on q and v only, with a gap where k is), and base-model rows stay untouched.
What this does not cover: the compiled kernels on a GPU (bench/gpu's `lora` section checks those)."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine.lora.adapter import LoraAdapter, LoraWeights
from specfleet.engine.lora.batch import LoraBatch
from specfleet.engine.lora.stacked import StackCache, slice_bounds
from specfleet.kernels import cpu_build, cpu_lora, lora_shrink_expand

HIDDEN, Q, KV, INTER = 32, 32, 16, 48
QKV = [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]


def _weights(
    g: torch.Generator, fan_in: int, out: int, rank: int, cols: list[tuple[int, int]]
) -> LoraWeights:
    a_t = torch.randn(fan_in, len(cols) * rank, generator=g) / fan_in**0.5
    b_t = torch.zeros(len(cols) * rank, out)
    for p, (c0, c1) in enumerate(cols):
        b_t[p * rank : (p + 1) * rank, c0:c1] = torch.randn(rank, c1 - c0, generator=g)
    cols_t = torch.tensor(cols, dtype=torch.int64)
    return LoraWeights(a_t, b_t, cols_t, cpu_lora.describe(a_t, b_t, rank, cols_t))


def _adapter(name: str, rank: int, qkv: list[int], seed: int, mlp: bool) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    layer = {"qkv": _weights(g, HIDDEN, Q + 2 * KV, rank, [QKV[i] for i in qkv])}
    if mlp:
        layer["down"] = _weights(g, INTER, HIDDEN, rank, [(0, HIDDEN)])
    return LoraAdapter(name, "/nowhere", rank, 1.0, name, ("q_proj",), [layer])


ADAPTERS = [
    _adapter("qv", 8, [0, 2], seed=1, mlp=False),  # q and v only: k's columns a gap
    _adapter("all", 16, [0, 1, 2], seed=2, mlp=True),
    _adapter("wide", 64, [1], seed=3, mlp=True),
]
# 13 rows: three adapters and the base, one row per sequence of a decode step and a 4-row prefill chunk
SPANS = [
    (ADAPTERS[0], 0, 4),
    (None, 4, 1),
    (ADAPTERS[2], 5, 1),
    (ADAPTERS[1], 6, 3),
    (None, 9, 1),
    (ADAPTERS[0], 10, 3),
]


@pytest.mark.skipif(not cpu_build.available(), reason="native CPU kernels did not build (no g++)")
@pytest.mark.parametrize(("proj", "fan_in", "out"), [("qkv", HIDDEN, Q + 2 * KV), ("down", INTER, HIDDEN)])
def test_triton_step_equals_the_native_step(
    proj: str, fan_in: int, out: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches: list[int] = []
    shrink = lora_shrink_expand.lora_shrink

    def counted(*args, **kwargs):
        launches.append(1)
        return shrink(*args, **kwargs)

    monkeypatch.setattr(lora_shrink_expand, "lora_shrink", counted)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(13, fan_in, generator=g), torch.randn(13, out, generator=g)
    native = LoraBatch.build(SPANS, 13, torch.device("cpu"), triton=False)
    stacks = StackCache()
    triton = LoraBatch.build(SPANS, 13, torch.device("cpu"), triton=True)
    assert native is not None and native.native and triton is not None and triton.mapping is not None
    triton = LoraBatch(triton.adapters, triton.groups, triton.native, triton.mapping, stacks)
    want = native.add(y.clone(), x, 0, proj)
    got = triton.add(y.clone(), x, 0, proj)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert launches == [1]  # the Triton kernels added the deltas, not a fallback
    base = [4, 9]
    assert torch.equal(got[base], y[base])
    assert not torch.allclose(got, y)
    # the same set of adapters in the next step reuses the stacks; another set restacks
    first = stacks.get(triton.adapters, 0, proj, x.device, x.dtype)
    assert stacks.get(triton.adapters, 0, proj, x.device, x.dtype) is first
    assert stacks.get(triton.adapters[:2], 0, proj, x.device, x.dtype) is not first


def test_slices_cover_every_piece_and_fill_gaps() -> None:
    weights = [a.layers[0]["qkv"] for a in ADAPTERS]
    assert slice_bounds(weights[:1]) == [0, Q, Q + KV, Q + 2 * KV]  # k's gap becomes a slice of zeros
    assert slice_bounds(weights) == [0, Q, Q + KV, Q + 2 * KV]
    g = torch.Generator().manual_seed(0)
    overlapping = _weights(g, HIDDEN, Q + 2 * KV, 4, [(0, Q + 2 * KV)])  # one piece over all of q/k/v
    assert (
        slice_bounds([weights[0], overlapping]) is None
    )  # no shared slice grid: the torch reference adds it


def test_overlapping_pieces_fall_back_to_the_reference() -> None:
    g = torch.Generator().manual_seed(5)
    whole = LoraAdapter(
        "whole",
        "/nowhere",
        4,
        1.0,
        "w",
        ("qkv_proj",),
        [{"qkv": _weights(g, HIDDEN, Q + 2 * KV, 4, [(0, Q + 2 * KV)])}],
    )
    spans = [(ADAPTERS[0], 0, 2), (whole, 2, 2)]
    x, y = torch.randn(4, HIDDEN, generator=g), torch.randn(4, Q + 2 * KV, generator=g)
    batch = LoraBatch.build(spans, 4, torch.device("cpu"), triton=True)
    assert batch is not None
    got = LoraBatch(batch.adapters, batch.groups, False, batch.mapping, StackCache()).add(
        y.clone(), x, 0, "qkv"
    )
    pairs = [(w.a_t, w.b_t) for w in (a.layers[0]["qkv"] for a in batch.adapters)]
    want = cpu_lora.lora_add_reference(y.clone(), x, batch.groups, pairs)
    torch.testing.assert_close(got, want)
