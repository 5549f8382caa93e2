"""The int8-activation kernel (`QuantLinear(..., activations="int8")`, native.cpp's `dot_linear`) against
torch references built from gguf-py's own dequantizer.

Two oracles per case:
- emulated: x quantized in torch exactly as the kernel does (per row and 32-block, d = max|x| / 127,
  q = round(x * (1 / d))), dequantized, then a float matmul with the codes-times-scales part of gguf-py's
  dequantized weight, plus x itself (not rounded) times the mins part: the kernel applies each group's
  min to the exact float sum of x. Its integer sums are exact, so it must match to float32 rounding
  (rtol 1e-4, atol 1e-3 as the float path).
- exact: the float matmul on x itself. The only extra error is the activation rounding, at most half a step
  per value: |y - x W^T| <= sum_k |W[n, k]| * d(k) / 2 (plus float rounding). The test checks that bound.
Shapes are odd where the kernel tiles: rows 1, 3, 5, 11 (one to three 4-row tiles, with remainders),
outputs not multiples of 32, inputs of several 32-blocks, groups spanning several blocks (AWQ g64/g128) and
groups of half a block (Q6_K's 16, whose min term then takes x's float sum per 16 values).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specfleet.bench.gpu.quant_packers import pack_awq, pack_gptq, pack_q4_k, pack_q5_k, pack_q6_k
from specfleet.engine.quant.awq_gptq import awq_weight, gptq_weight
from specfleet.engine.quant.gguf_blocks import decode
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (the dequantized int8 rows, the per-value step d) exactly as the kernel rounds them."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)  # round half to even, as std::nearbyint
    return (q * d).view(m, k), d.expand(m, k // 32, 32).reshape(m, k)


def _check(q: QuantTensor, reference_weight: torch.Tensor, rows: int, seed: int = 0) -> None:
    n, k = reference_weight.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    residual = torch.randn(rows, n, generator=g)
    layer = cpu_native.QuantLinear(q, bias)
    assert layer.activations == "int8"
    got = layer(x, residual=residual)
    xq, step = quantize_activations(x)
    if q.perm is not None:  # the kernel quantizes x's columns in the weight's (act-order) order
        xq_p, step_p = quantize_activations(x[:, q.perm])
        xq, step = torch.empty_like(x), torch.empty_like(x)
        xq[:, q.perm], step[:, q.perm] = xq_p, step_p
    mins = torch.zeros(n, k) if q.mins is None else q.mins.repeat_interleave(q.group_size, dim=1)
    if q.perm is not None:
        mins[:, q.perm] = mins.clone()
    scaled = reference_weight - mins  # codes * scales, in the input's column order
    emulated = residual + bias + xq @ scaled.t() + x @ mins.t()
    torch.testing.assert_close(got, emulated, rtol=1e-4, atol=1e-3)
    exact = residual + torch.addmm(bias, x, reference_weight.t())
    bound = (step / 2) @ reference_weight.abs().t() + 1e-3 + 1e-4 * exact.abs()
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() - bound).max())
    torch.testing.assert_close(
        cpu_native.QuantLinear(q)(x), xq @ scaled.t() + x @ mins.t(), rtol=1e-4, atol=1e-3
    )


def _gguf(type_name: str, shape: tuple[int, int], seed: int = 1) -> tuple[QuantTensor, torch.Tensor]:
    w = np.random.default_rng(seed).normal(0, 0.5, size=shape).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    packers = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}  # gguf-py has no quantizer for these
    raw = packers[type_name](w) if type_name in packers else gguf.quants.quantize(w, qtype)
    return decode(raw, type_name, shape), torch.from_numpy(
        gguf.quants.dequantize(raw, qtype).astype(np.float32)
    )


@pytest.mark.parametrize(
    "type_name,shape",
    [
        ("Q4_0", (33, 96)),
        ("Q4_1", (7, 64)),
        ("Q4_1", (100, 576)),
        ("Q8_0", (45, 160)),
        ("Q4_K", (37, 512)),
        ("Q5_0", (100, 576)),
        ("Q5_1", (7, 96)),
        ("Q5_K", (37, 512)),
        ("Q6_K", (37, 512)),  # groups of 16: two scales and two mins per activation block
        ("Q6_K", (45, 1536)),  # SmolLM2's ffn_down rows
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 5, 11])
def test_gguf_types_with_int8_activations(type_name: str, shape: tuple[int, int], rows: int) -> None:
    q, reference = _gguf(type_name, shape)
    _check(q, reference, rows)


@pytest.mark.parametrize("group", [64, 128])
def test_groups_spanning_several_blocks(group: int) -> None:
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(group))
    tensors, reference = pack_awq(w, group)
    q = awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], {"group_size": group})
    _check(q, reference, rows=5)


def test_gptq_act_order() -> None:
    w = torch.randn(40, 192, generator=torch.Generator().manual_seed(3))
    tensors, reference = pack_gptq(w, 64, act_order=True)
    q = gptq_weight(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], {"group_size": 64}
    )
    assert q.perm is not None
    _check(q, reference, rows=3)


def test_zero_rows_and_extreme_codes() -> None:
    """A zero activation block (scale 0) gives exactly the bias; codes at both ends of the range (Q8_0's
    -127/127 become 1/255 after the +128 shift) do not overflow the int32 sums."""
    q, reference = _gguf("Q8_0", (32, 64))
    q = QuantTensor(torch.where(q.codes > 0, 127, -127).to(torch.int8), q.scales, None, 32, 8, "test")
    x = torch.zeros(2, 64)
    x[1] = 1e3
    layer = cpu_native.QuantLinear(q, torch.ones(32))
    got = layer(x)
    assert torch.equal(got[0], torch.ones(32))
    torch.testing.assert_close(got[1], torch.ones(32) + x[1] @ q.dequantize().t(), rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize(
    ("k", "group", "bits", "activations"),
    [
        (64, 16, 4, "int8"),  # two groups per activation block, each half summed and scaled on its own
        (48, 16, 4, "float32"),  # rows not in whole 32-blocks
        (64, 16, 8, "float32"),  # 8-bit codes take 4 rows a step: groups of 16 only for nibble codes
        (64, 8, 4, "float32"),  # groups of 8: four per block
    ],
)
def test_which_small_groups_take_int8_activations(k: int, group: int, bits: int, activations: str) -> None:
    g = torch.Generator().manual_seed(k + group + bits)
    if bits == 8:
        codes = torch.randint(-127, 128, (40, k), generator=g, dtype=torch.int8)
    else:
        codes = torch.randint(0, 16, (40, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(40, k // group, generator=g)
    mins = None if bits == 8 else -torch.rand(40, k // group, generator=g)
    q = QuantTensor(codes, scales, mins, group, bits, "test")
    layer = cpu_native.QuantLinear(q)
    assert layer.activations == activations
    x = torch.randn(5, k, generator=g)
    if activations == "float32":
        torch.testing.assert_close(layer(x), x @ q.dequantize().t(), rtol=1e-4, atol=1e-3)
    else:
        _check(q, q.dequantize(), rows=5)


def test_float32_activations_stay_selectable_and_exact() -> None:
    q, reference = _gguf("Q4_1", (33, 96))
    layer = cpu_native.QuantLinear(q, activations="float32")
    assert layer.activations == "float32"
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), x @ reference.t(), rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="activations='int4' is not one of"):
        cpu_native.QuantLinear(q, activations="int4")
