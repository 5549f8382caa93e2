"""GGUF's K-quants packed near their file size: the two-level scales (an integer per group, a half per
256-value super-block; native.cpp "Per-group scales") and Q6_K's 6-bit codes (nibbles and two planes of
high bits). Their sizes, accounted exactly, and the 6-bit codes' extremes on both activation paths;
test_quant_native.py checks every format's output against gguf-py on odd shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specfleet.bench.gpu.quant_packers import pack_q4_k, pack_q5_k, pack_q6_k
from specfleet.engine.quant.gguf_blocks import BLOCK_BYTES, decode
from specfleet.kernels import cpu_native, cpu_quant
from specfleet.kernels.cpu_quant import TWO_LEVEL_SCALES
from specfleet.kernels.quantized import QuantTensor, SuperScales

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build")

PACKERS = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}  # gguf-py has no quantizer for these


@pytest.mark.parametrize(
    ("type_name", "bits_per_value"),
    # codes, then per group an int8 sc (and m, except Q6_K whose offset reuses sc), per 256 the halfs d and
    # dmin: Q4_K 4 + 2 * 8 / 32 + 2 * 16 / 256, Q5_K one bit more, Q6_K 6 + 8 / 16 + 2 * 16 / 256
    [("Q4_K", 4.625), ("Q5_K", 5.625), ("Q6_K", 6.625)],
)
@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_k_quants_pack_near_their_file_size(type_name: str, bits_per_value: float, activations: str) -> None:
    n, k = 64, 512  # whole panels: no padding columns in the count
    w = np.random.default_rng(7).normal(0, 0.5, size=(n, k)).astype(np.float32)
    q = decode(PACKERS[type_name](w), type_name, (n, k))
    layer = cpu_native.QuantLinear(q, activations=activations)
    assert layer.scale_kind == TWO_LEVEL_SCALES
    assert layer.packed_nbytes == q.packed_bytes == n * k * bits_per_value / 8
    values, nbytes = BLOCK_BYTES[type_name]
    file_bits = nbytes * 8 / values
    assert layer.packed_nbytes <= n * k * file_bits / 8 * 1.03  # 4.625 / 4.5, the largest ratio of the three


def _six_bit_weight(
    code: int, n: int, k: int, two_level: bool, group: int = 32
) -> tuple[QuantTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(code)
    codes = torch.full((n, k), code, dtype=torch.uint8)
    sc = torch.randint(-63, 64, (n, k // group), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 256, generator=g) * 0.01).half()
    two = SuperScales(sc, d, sc, d * -32)  # Q6_K's form: W = d sc (q - 32)
    scales, mins = two.scales(group), two.mins(group)
    assert mins is not None
    q = QuantTensor(codes, scales, mins, group, 6, "test:6-bit", two_level=two if two_level else None)
    return q, q.dequantize()


@pytest.mark.parametrize("group", [16, 32])  # Q6_K's own 16: two groups in each activation block
@pytest.mark.parametrize("two_level", [True, False])
@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("code", [0, 15, 16, 31, 32, 47, 48, 63])
def test_extreme_6_bit_codes(activations: str, code: int, two_level: bool, group: int) -> None:
    """Every code one value (0 and 63, the range's ends; either side of the fifth and sixth bits) against x at
    its int8 extremes: 63 gives the largest integer sums the dot path forms (the maddubs backends widen
    after each 8 rows: 4 * 63 * 127 = 32004 < 32767)."""
    n, k = 37, 512  # odd rows: the last panel is padded
    q, ref = _six_bit_weight(code, n, k, two_level, group)
    layer = cpu_native.QuantLinear(q, activations=activations)
    assert layer.activations == activations
    x = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(3, 1)  # quantizes to +-127 exactly
    x[1] *= 0.5
    x[2] = torch.ones(k)
    exact = x @ ref.t()
    torch.testing.assert_close(layer(x), exact, rtol=1e-4, atol=1e-3)  # float32 sums of 512 terms
    assert torch.equal(layer.weight_rows(torch.tensor([0, 5, 36])), ref[[0, 5, 36]])


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_packing_by_panel_chunks_equals_packing_whole(
    bits: int, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight larger than one packing step (cpu_quant.PACK_VALUES) packs chunk by chunk of whole panels
    into the same bytes as at once; the last chunk ends inside a panel."""
    n, k = 100, 256
    g = torch.Generator().manual_seed(bits)
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    q = QuantTensor(
        codes, torch.rand(n, k // 32, generator=g), torch.rand(n, k // 32, generator=g), 32, bits, "t"
    )
    whole = cpu_native.QuantLinear(q, activations=activations)
    monkeypatch.setattr(
        cpu_quant, "PACK_VALUES", 32 * k * 2
    )  # two panels a chunk: 4 chunks, the last partial
    chunked = cpu_native.QuantLinear(q, activations=activations)
    assert torch.equal(chunked.codes, whole.codes)
    assert (chunked.high is None) == (whole.high is None) == (bits in (4, 8))
    if whole.high is not None and chunked.high is not None:
        assert torch.equal(chunked.high, whole.high)
    x = torch.randn(3, k, generator=g)
    assert torch.equal(chunked(x), whole(x))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_reordered_rows_keep_their_two_levels(type_name: str) -> None:
    """Undoing llama.cpp's q/k row permutation (`select_rows`) moves the two-level factors with the codes,
    and Q6_K's offset stays the same tensor as its scales (no bytes of its own)."""
    n, k = 40, 512
    w = np.random.default_rng(9).normal(0, 0.5, size=(n, k)).astype(np.float32)
    q = decode(PACKERS[type_name](w), type_name, (n, k))
    index = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    moved = q.select_rows(index)
    assert moved.two_level is not None
    assert (moved.two_level.m is moved.two_level.sc) == (type_name == "Q6_K")
    assert torch.equal(moved.dequantize(), q.dequantize()[index])
    layer = cpu_native.QuantLinear(moved, activations="float32")
    assert torch.equal(layer.weight_rows(torch.arange(n)), q.dequantize()[index])
