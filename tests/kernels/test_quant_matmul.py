"""The Triton 4-bit dequantize-matmul (AWQ, GPTQ) under the interpreter, against the documented unpacking
then a float matmul, on odd shapes: 1, 7 and 33 rows, outputs not a multiple of the 64-column tile."""

from __future__ import annotations

import pytest
import torch
from quant_packers import pack_awq, pack_gptq
from specfleet.engine.quant.awq_gptq import awq_weight, gptq_weight
from specfleet.kernels.quant_matmul import TritonQuantLinear, pack_gptq_layout, q4_matmul

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_awq_triton_matches_reference(rows: int) -> None:
    w = torch.randn(72, 128, generator=torch.Generator().manual_seed(0))
    tensors, reference = pack_awq(w, 64)
    q = awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], {"group_size": 64})
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(72)
    residual = torch.randn(rows, 72)
    layer = TritonQuantLinear(q, bias, CPU, torch.float32)
    torch.testing.assert_close(
        layer(x, residual=residual), residual + torch.addmm(bias, x, reference.t()), rtol=1e-4, atol=1e-3
    )


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_triton_matches_reference(act_order: bool) -> None:
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    tensors, reference = pack_gptq(w, 32, act_order=act_order)
    q = gptq_weight(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], {"group_size": 32}
    )
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        TritonQuantLinear(q, None, CPU, torch.float32)(x), x @ reference.t(), rtol=1e-4, atol=1e-3
    )


def test_repacked_words_hold_the_codes() -> None:
    """pack_gptq_layout writes GPTQ's qweight: the engine's GPTQ reader reads back the same codes."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    tensors, _ = pack_gptq(w, 32)
    q = gptq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, {"group_size": 32})
    qweight, _, _ = pack_gptq_layout(q, torch.float32, CPU)
    assert torch.equal(qweight, tensors["qweight"])


def test_q4_matmul_refuses_mismatched_shapes() -> None:
    qweight = torch.zeros(8, 16, dtype=torch.int32)
    scales = torch.ones(2, 16)
    with pytest.raises(ValueError, match="shapes do not fit"):
        q4_matmul(torch.randn(2, 60), qweight, scales, scales, 32)
