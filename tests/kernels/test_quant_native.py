"""Grouped-quantized weights on the native CPU kernel, format by format, against torch references.

The float32-activation path (exact up to float rounding); tests/kernels/test_quant_dot.py covers the
int8-activation one. Reference for GGUF: gguf-py's own dequantizer (``gguf.quants.dequantize``), then a float matmul. For AWQ
and GPTQ: the documented ``(q - z) * s`` over the integers the test packer wrote. Shapes are odd on every
axis the kernel tiles: rows 1, 3 and 11 (more than one 8-row tile), outputs not a multiple of 32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specfleet.bench.gpu.quant_packers import pack_awq, pack_gptq, pack_q4_k, pack_q5_k, pack_q6_k
from specfleet.engine.quant.awq_gptq import awq_weight, gptq_weight
from specfleet.engine.quant.gguf_blocks import decode
from specfleet.kernels import cpu_native
from specfleet.kernels.cpu_quant import TWO_LEVEL_SCALES

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build")


def _check_linear(q, reference_weight: torch.Tensor, rows: int, seed: int = 0) -> None:
    n, k = reference_weight.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    residual = torch.randn(rows, n, generator=g)
    layer = cpu_native.QuantLinear(q, bias, activations="float32")
    expected = residual + torch.addmm(bias, x, reference_weight.t())
    torch.testing.assert_close(layer(x, residual=residual), expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(
        cpu_native.QuantLinear(q, activations="float32")(x), x @ reference_weight.t(), rtol=1e-4, atol=1e-3
    )


def _gguf_roundtrip(type_name: str, w: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    qtype = gguf.GGMLQuantizationType[type_name]
    packers = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}  # gguf-py has no quantizer for these
    raw = packers[type_name](w) if type_name in packers else gguf.quants.quantize(w, qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize(
    "type_name,shape",
    [
        ("Q4_0", (33, 96)),
        ("Q4_1", (7, 64)),
        ("Q8_0", (45, 160)),
        ("Q4_K", (37, 512)),
        ("Q5_0", (37, 576)),  # llama.cpp's Q5_0 goes on rows that are not a multiple of 256 (SmolLM2: 576)
        ("Q5_1", (7, 96)),
        ("Q5_K", (37, 512)),
        ("Q6_K", (37, 512)),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 11])
def test_gguf_types_match_gguf_dequantize(type_name: str, shape: tuple[int, int], rows: int) -> None:
    w = np.random.default_rng(1).normal(0, 0.5, size=shape).astype(np.float32)
    raw, reference = _gguf_roundtrip(type_name, w)
    q = decode(raw, type_name, shape)
    assert q.dequantize().equal(reference)  # the decoded codes, scales and mins are exact
    assert (q.dequantize() - torch.from_numpy(w)).abs().max() < 0.3  # and they are a quantization of w
    _check_linear(q, reference, rows)
    # GGUF's fp16 d and m stream as halfs; the K types' d * sc products as their two levels (exact)
    layer = cpu_native.QuantLinear(q)
    if type_name.endswith("_K"):
        assert layer.scale_kind == TWO_LEVEL_SCALES and layer.two_level is not None
    else:
        assert layer.scales is not None and layer.scales.dtype == torch.float16


HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_0": [0], "Q5_1": [0, 2]}
HALF_FIELDS |= {"Q5_K": [0, 2], "Q6_K": [208]}  # byte offsets of each block's fp16 fields


def _random_blocks(type_name: str, n: int, k: int, seed: int = 3) -> np.ndarray:
    """Any bytes are a valid block once its fp16 fields are finite."""
    from specfleet.engine.quant.gguf_blocks import BLOCK_BYTES

    rng = np.random.default_rng(seed)
    values, nbytes = BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, size=(n, k // values * nbytes), dtype=np.uint8)
    blocks = raw.reshape(n, k // values, nbytes)
    for at in HALF_FIELDS[type_name]:
        halves = rng.normal(0, 0.01, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_random_blocks_decode_as_gguf_dequantize(type_name: str) -> None:
    """Every code, high bit and 6-bit scale pattern decodes bit for bit as gguf-py's dequantizer reads it."""
    n, k = 9, 512
    raw = _random_blocks(type_name, n, k)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32)
    assert decode(raw, type_name, (n, k)).dequantize().equal(torch.from_numpy(reference))


@pytest.mark.parametrize("type_name", sorted(HALF_FIELDS))
def test_large_tensors_decode_in_row_chunks(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor larger than one decode step (gguf_blocks.DECODE_VALUES) decodes chunk by chunk into the same
    codes, scales and mins: 11 rows in steps of 4 (a short last chunk), against gguf-py's dequantizer."""
    from specfleet.engine.quant import gguf_blocks

    n, k = 11, 512
    raw = _random_blocks(type_name, n, k)
    monkeypatch.setattr(gguf_blocks, "DECODE_VALUES", 4 * k)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32)
    assert decode(raw, type_name, (n, k)).dequantize().equal(torch.from_numpy(reference))


def test_decoding_a_vocabulary_table_holds_one_chunk_of_temporaries() -> None:
    """A tied Q6_K embedding (the head of a Q4_K_M file) is the largest tensor a load decodes: its numpy
    temporaries (traced by tracemalloc; the torch outputs are not) stay those of one chunk of
    gguf_blocks.DECODE_VALUES values, about 10 bytes a value of the chunk (39 MB), where decoding the whole
    table at once took 7.3 bytes a value of the table (122 MB for these 16M values)."""
    import tracemalloc

    from specfleet.engine.quant.gguf_blocks import DECODE_VALUES

    k = 2048
    n = 4 * DECODE_VALUES // k
    raw = _random_blocks("Q6_K", n, k)
    tracemalloc.start()
    try:
        q = decode(raw, "Q6_K", (n, k))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert q.codes.shape == (n, k)
    assert peak < 12 * DECODE_VALUES, f"{peak / 2**20:.0f} MB of temporaries for {n * k / 2**20:.0f}M values"


@pytest.mark.parametrize("type_name", ["Q5_K", "Q6_K"])
def test_k_packers_are_gguf_blocks(type_name: str) -> None:
    """The test-only Q5_K and Q6_K packers write what gguf-py reads, close to the input."""
    w = np.random.default_rng(4).normal(0, 1.0, size=(3, 512)).astype(np.float32)
    packer = pack_q5_k if type_name == "Q5_K" else pack_q6_k
    back = gguf.quants.dequantize(packer(w), gguf.GGMLQuantizationType[type_name])
    assert np.abs(back - w).max() < 0.15


def test_q4_k_packer_is_gguf_q4_k() -> None:
    """The test-only Q4_K packer writes what gguf-py reads: its dequantized values approximate the input
    to within one quantization step of each 32-value sub-block."""
    w = np.random.default_rng(2).normal(0, 1.0, size=(3, 256)).astype(np.float32)
    back = gguf.quants.dequantize(pack_q4_k(w), gguf.GGMLQuantizationType.Q4_K)
    step = (w.reshape(3, 8, 32).max(-1) - np.minimum(w.reshape(3, 8, 32).min(-1), 0)) / 15
    assert np.all(np.abs(back - w).reshape(3, 8, 32) <= step[..., None] * 1.5 + 0.05)


def test_decode_refuses_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="do not match 32-value blocks of 20 bytes"):
        decode(np.zeros((4, 21), dtype=np.uint8), "Q4_1", (4, 32))
    with pytest.raises(ValueError, match="Q2_K is not run natively"):
        decode(np.zeros((4, 84), dtype=np.uint8), "Q2_K", (4, 256))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 11])
def test_awq_weight_matches_documented_unpacking(group: int, rows: int) -> None:
    w = torch.randn(72, 256, generator=torch.Generator().manual_seed(group))
    tensors, reference = pack_awq(w, group)
    q = awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], {"group_size": group})
    torch.testing.assert_close(q.dequantize(), reference, rtol=1e-6, atol=1e-6)
    _check_linear(q, reference, rows)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows", [1, 11])
def test_gptq_weight_matches_documented_unpacking(act_order: bool, rows: int) -> None:
    w = torch.randn(40, 192, generator=torch.Generator().manual_seed(3))
    tensors, reference = pack_gptq(w, 64, act_order=act_order)
    q = gptq_weight(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], {"group_size": 64}
    )
    assert (q.perm is not None) == act_order
    torch.testing.assert_close(q.dequantize(), reference, rtol=1e-6, atol=1e-6)
    _check_linear(q, reference, rows)


def test_awq_nibble_order_is_interleaved() -> None:
    """One int32 holding columns 0..7 = codes 0..7: AutoAWQ puts column c at slot [0, 4, 1, 5, 2, 6, 3, 7][c]."""
    word = sum(c << (4 * slot) for c, slot in enumerate([0, 4, 1, 5, 2, 6, 3, 7]))
    q = awq_weight(
        torch.tensor([[word]] * 32, dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, 8, dtype=torch.float16),
        {"group_size": 32},
    )
    assert q.codes[:, 0].tolist() == list(range(8))


def test_gptq_refuses_uneven_groups() -> None:
    tensors, _ = pack_gptq(torch.randn(8, 64), 32)
    g_idx = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(ValueError, match="every group exactly 32"):
        gptq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, {"group_size": 32})
