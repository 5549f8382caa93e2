"""The packed 5-bit layout (GGUF Q5_0, Q5_1, Q5_K): the low 4 bits in the 4-bit nibble panels and the fifth
bits in a plane beside them (kernels/cpu_native.py `fifth_bit_plane`, native.cpp "5-bit codes"). Its size,
accounted exactly, and the codes' extremes on both activation paths; tests/kernels/test_quant_native.py
and test_quant_dot.py check the formats' outputs against gguf-py on odd shapes (576 columns, odd rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specfleet.bench.gpu.quant_packers import pack_q4_k, pack_q5_k, pack_q6_k
from specfleet.engine.quant.gguf_blocks import decode
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor, cat_rows

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build")


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_q5_0_packs_to_six_bits_per_value(activations: str) -> None:
    """5 bits of code and GGUF's fp16 d and (exact) -16 d per 32 values: 6 bits a value, against the file's
    5.5 (22 bytes / 32) and the 8.5 of int8 codes with a half scale."""
    n, k = 64, 576  # whole panels: no padding columns in the count
    w = np.random.default_rng(5).normal(0, 0.5, size=(n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    q = decode(raw, "Q5_0", (n, k))
    assert q.bits == 5 and q.codes.dtype == torch.uint8 and int(q.codes.max()) < 32
    layer = cpu_native.QuantLinear(q, activations=activations)
    assert layer.high is not None
    assert layer.codes.nbytes == n * k // 2  # the low 4 bits
    assert layer.high.nbytes == n * k // 8  # the fifth bits
    assert layer.scales.dtype == torch.float16 and layer.mins is not None
    assert layer.scales.nbytes == layer.mins.nbytes == n * k // 32 * 2
    assert layer.packed_nbytes == n * k * 6 // 8
    assert layer.packed_nbytes <= raw.nbytes * 6 / 5.5


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("code", [0, 15, 16, 31])
def test_extreme_5_bit_codes(activations: str, code: int) -> None:
    """Every code one value (0 and 31, the range's ends; 15 and 16, either side of the fifth bit) against x
    at its int8 extremes: 31 gives the largest integer sums the dot path forms (the maddubs backends widen
    their int16 sums every 8 rows for this)."""
    n, k = 37, 256
    codes = torch.full((n, k), code, dtype=torch.uint8)
    scales = torch.full((n, k // 32), 0.25)
    q = QuantTensor(codes, scales, -16 * scales, 32, 5, "test")
    x = torch.ones(3, k)  # quantizes exactly: 127 * (1 / 127)
    x[1] = -1.0
    y = cpu_native.QuantLinear(q, activations=activations)(x)
    torch.testing.assert_close(y, x @ q.dequantize().t(), rtol=1e-5, atol=1e-3)


def _gguf_part(name: str, w: np.ndarray) -> tuple[QuantTensor, torch.Tensor]:
    """A GGUF tensor of type `name` decoded, and gguf-py's dequantization of the same blocks."""
    qtype = gguf.GGMLQuantizationType[name]
    packers = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}  # gguf-py has no quantizer for these
    raw = packers[name](w) if name in packers else gguf.quants.quantize(w, qtype)
    return decode(raw, name, w.shape), torch.from_numpy(gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize(
    ("types", "k", "bits", "symmetric"),
    [
        (("Q5_0", "Q5_0", "Q8_0"), 576, 8, True),  # SmolLM2 Q4_K_M's q, k, v: Q5_0's offset folds into int8
        (("Q5_1", "Q8_0"), 576, 8, False),  # an asymmetric 5-bit part: zero offsets for the Q8_0 part
        (("Q5_K", "Q8_0", "Q5_K"), 512, 8, False),
        (("Q4_0", "Q5_0"), 576, 5, False),  # 4-bit codes are 5-bit codes as they are
        (("Q4_K", "Q5_1", "Q8_0"), 512, 8, False),
        # a 2048-wide Q4_K_M's q, k, v: 6-bit codes (Q6_K's q with offset -32 d sc), groups of 16
        (("Q4_K", "Q4_K", "Q6_K"), 512, 6, False),
    ],
)
@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_mixed_width_parts_fuse_exactly(
    types: tuple[str, ...], k: int, bits: int, symmetric: bool, activations: str
) -> None:
    """Fused q/k/v (or gate/up) whose parts have different GGUF types stay one quantized weight, widened to
    the widest code, and equal gguf-py's dequantized parts stacked, bit for bit; so does the matmul, up to
    float rounding (float path) or the int8 rounding of x (half a step per value, as test_quant_dot.py)."""
    rng = np.random.default_rng(33)
    parts, refs = zip(
        *(
            _gguf_part(name, rng.normal(0, 0.5, size=((37, 11, 19)[i], k)).astype(np.float32))
            for i, name in enumerate(types)
        )
    )  # odd row counts: the fused weight ends inside a panel
    fused = cat_rows(parts)
    assert isinstance(fused, QuantTensor), "mixed widths fell back to float32"
    assert fused.bits == bits and (fused.mins is None) == symmetric
    ref = torch.cat(refs)
    assert torch.equal(fused.dequantize(), ref)
    x = torch.from_numpy(rng.normal(0, 1, size=(7, k)).astype(np.float32))
    layer = cpu_native.QuantLinear(fused, activations=activations)
    assert layer.activations == activations  # Q6_K's groups of 16 too: two per activation block
    got, exact = layer(x), x @ ref.t()
    if activations == "float32":
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-3)
        return
    step = (x.view(7, k // 32, 32).abs().amax(-1, keepdim=True) / 127.0).expand(7, k // 32, 32).reshape(7, k)
    bound = (step / 2) @ ref.abs().t() + 1e-3 + 1e-4 * exact.abs()
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() - bound).max())


def test_parts_that_cannot_share_a_kernel_stay_apart() -> None:
    """Parts whose input columns are in different orders (GPTQ act-order) cannot fuse: the group runs on the
    float path, equal to the parts' own dequantized weights."""
    g = torch.Generator().manual_seed(6)
    parts = [
        QuantTensor(
            torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8),
            torch.rand(8, 2, generator=g),
            torch.rand(8, 2, generator=g),
            32,
            4,
            "gptq",
            perm=torch.randperm(64, generator=g),
        )
        for _ in range(2)
    ]
    assert QuantTensor.cat(parts) is None
    fused = cat_rows(parts)
    assert isinstance(fused, torch.Tensor)
    assert torch.equal(fused, torch.cat([p.dequantize() for p in parts]))
