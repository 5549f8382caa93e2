"""Native CPU kernels (kernels/cpu/native.cpp): built with g++ on first use, loaded with ctypes.

The names callers use, gathered from the modules that hold them by concern:

- `cpu_build`: the build, its cache and ABI check (`library`, `available`), the thread count;
- `cpu_dense`: float32 / int8 weights in panels (`PackedLinear`) and the fused decode layers (`DecodeLayers`);
- `cpu_quant`: block-quantized weights in panels (`QuantLinear`, `pack_quant_panels`, `pack_dot_panels`);
- `cpu_ops`: single ops (`rms_norm`, `silu_mul`, `softcap_`, `paged_attention`).

Every wrapper checks dtype, device, shape and contiguity before passing raw pointers on: a wrong
tensor raises ValueError naming it instead of reading out of bounds.
"""

from __future__ import annotations

from specfleet.kernels.cpu_build import (
    ABI_VERSION,
    FLAGS,
    PANEL,
    SOURCE,
    _build,
    available,
    library,
    num_threads,
    set_num_threads,
)
from specfleet.kernels.cpu_dense import (
    DecodeLayers,
    DecodeLayerWeights,
    LinearDesc,
    PackedLinear,
    int8_column_scale,
    pack_panels,
)
from specfleet.kernels.cpu_ops import paged_attention, rms_norm, silu_mul, softcap_
from specfleet.kernels.cpu_quant import (
    ACTIVATIONS,
    QBLOCK,
    QuantLinear,
    QuantPanels,
    dot_backend,
    dot_supported,
    fifth_bit_plane,
    pack_dot_panels,
    pack_quant_panels,
)

__all__ = [
    "ABI_VERSION",
    "ACTIVATIONS",
    "FLAGS",
    "PANEL",
    "QBLOCK",
    "SOURCE",
    "DecodeLayerWeights",
    "DecodeLayers",
    "LinearDesc",
    "PackedLinear",
    "QuantLinear",
    "QuantPanels",
    "_build",
    "available",
    "dot_backend",
    "dot_supported",
    "fifth_bit_plane",
    "int8_column_scale",
    "library",
    "num_threads",
    "pack_dot_panels",
    "pack_panels",
    "pack_quant_panels",
    "paged_attention",
    "rms_norm",
    "set_num_threads",
    "silu_mul",
    "softcap_",
]
