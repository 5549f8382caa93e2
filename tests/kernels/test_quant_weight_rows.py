"""`QuantLinear.weight_rows` reads rows of a weight back from its packed panels (a tied quantized embedding
looks its rows up there): equal to the `QuantTensor`'s own dequantized rows, for each code width, with and
without mins, on both panel layouts, outputs not a multiple of the 32-column panel."""

from __future__ import annotations

import pytest
import torch
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build")


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("mins", [True, False])
@pytest.mark.parametrize("group", [32, 16])  # 16: Q6_K's groups, float panels only (dot_supported)
def test_weight_rows_equal_the_dequantized_rows(activations: str, bits: int, mins: bool, group: int) -> None:
    g = torch.Generator().manual_seed(bits + group)
    n, k = 70, 128
    if bits in (4, 5):
        codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    scales = torch.rand(n, k // group, generator=g) + 0.01
    offsets = -torch.rand(n, k // group, generator=g) if mins else None
    q = QuantTensor(codes, scales, offsets, group, bits, "test")
    linear = cpu_native.QuantLinear(q, activations=activations)
    ids = torch.tensor([0, 1, 15, 16, 31, 32, 45, 63, 64, 69, 1, 0])
    assert torch.equal(linear.weight_rows(ids), q.select_rows(ids).dequantize())
