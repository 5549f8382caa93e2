"""AWQ and GPTQ 4-bit checkpoints (Hugging Face safetensors) -> `QuantTensor`s under ``<module>.weight``.

Both store, per linear module, ``qweight``/``qzeros`` (int32 holding eight 4-bit values) and ``scales``
[K / G, N] (fp16), for the weight's transpose [K = in, N = out]: ``W.T[k, n] = (q - z) * s`` with the zero
and scale of k's group. They differ in where the nibbles go:

AWQ (AutoAWQ ``WQLinear_GEMM``, version "gemm"): ``qweight`` [K, N / 8] packed along N, ``qzeros``
[K / G, N / 8] packed the same way; inside each int32 the eight columns are interleaved: nibble slot i
holds column ``AWQ_ORDER[i]`` of the eight (AutoAWQ packs with order_map [0, 2, 4, 6, 1, 3, 5, 7]).
Zeros are stored as they are.

GPTQ (AutoGPTQ / GPTQModel): ``qweight`` [K / 8, N] packed along K in order (bits 4j..4j+3 of row i hold
input row 8i + j), ``qzeros`` [K / G, N / 8] packed along N in order, ``g_idx`` [K] the group of each
input row. Checkpoints in the original format ("gptq", v1) store zero - 1; ``checkpoint_format:
gptq_v2`` stores the zero itself. With ``desc_act`` (act-order) g_idx is not monotone: the input rows
are sorted by group once here and the input is gathered in that order at run time (`QuantTensor.perm`).
"""

from __future__ import annotations

import torch
from specfleet.kernels.quantized import QuantTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble slot i of an AWQ int32 holds column AWQ_ORDER[i] of its eight
_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """[..., M] int32 -> [..., M, 8] uint8: nibble slot i of each word at index i."""
    return ((packed.unsqueeze(-1) >> _SHIFTS) & 0xF).to(torch.uint8)


def awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ [R, N / 8] int32 -> [R, N] uint8 codes in column order."""
    slots = unpack_int32(packed)
    out = torch.empty_like(slots)
    out[..., list(AWQ_ORDER)] = slots
    return out.reshape(packed.shape[0], -1)


def gptq_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K / 8, N] -> [K, N] uint8 codes."""
    return unpack_int32(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def gptq_columns(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros [R, N / 8] -> [R, N] (sequential nibbles along N)."""
    return unpack_int32(packed).reshape(packed.shape[0], -1)


def _group_size(qconfig: dict, k: int, name: str) -> int:
    g = qconfig.get("group_size", 128)
    g = k if g in (-1, None) else int(g)
    if g <= 0 or k % g:
        raise ValueError(f"{name}: group_size={g} does not divide the input size {k}")
    return g


def _to_quant(
    codes_kn: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g: int,
    fmt: str,
    perm: torch.Tensor | None = None,
) -> QuantTensor:
    """codes [K, N], zeros and scales [K / G, N] (rows already in group order) -> QuantTensor [N, K]."""
    s = scales.float()
    return QuantTensor(
        codes_kn.t().contiguous(), s.t().contiguous(), (-zeros.float() * s).t().contiguous(), g, 4, fmt, perm
    )


def awq_weight(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, qconfig: dict, name: str = "awq"
) -> QuantTensor:
    codes = awq_columns(qweight)
    k = codes.shape[0]
    g = _group_size(qconfig, k, name)
    zeros = awq_columns(qzeros)
    if zeros.shape != (k // g, codes.shape[1]) or tuple(scales.shape) != zeros.shape:
        raise ValueError(
            f"{name}: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not fit "
            f"qweight {tuple(qweight.shape)} with group_size {g}"
        )
    return _to_quant(codes, zeros, scales, g, "awq")


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    qconfig: dict,
    name: str = "gptq",
) -> QuantTensor:
    codes = gptq_rows(qweight)
    k, n = codes.shape
    g = _group_size(qconfig, k, name)
    zeros = gptq_columns(qzeros).to(torch.int16)
    if qconfig.get("checkpoint_format", "gptq") != "gptq_v2":
        zeros = zeros + 1  # v1 checkpoints store zero - 1
    if zeros.shape != (k // g, n) or tuple(scales.shape) != zeros.shape:
        raise ValueError(
            f"{name}: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not fit "
            f"qweight {tuple(qweight.shape)} with group_size {g}"
        )
    perm = None
    if g_idx is not None:
        g_idx = g_idx.long()
        in_order = torch.arange(k) // g
        if not torch.equal(g_idx, in_order):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], in_order):
                raise ValueError(f"{name}: g_idx does not give every group exactly {g} input rows")
            codes = codes[perm]
    return _to_quant(codes, zeros, scales, g, "gptq", perm)


def quantized_state(state: dict[str, torch.Tensor], qconfig) -> dict[str, torch.Tensor | QuantTensor]:
    """Replace every module's qweight/qzeros/scales(/g_idx) by one QuantTensor under ``<module>.weight``."""
    if not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict()
    method = qconfig.get("quant_method")
    if qconfig.get("bits", 4) != 4:
        raise ValueError(f"{method}: bits={qconfig.get('bits')} is not supported; only 4-bit checkpoints run")
    if method == "awq" and (
        str(qconfig.get("version", "gemm")).lower() != "gemm" or not qconfig.get("zero_point", True)
    ):
        raise ValueError(
            f"awq: version={qconfig.get('version')!r} zero_point={qconfig.get('zero_point')!r} is not "
            "supported; only AutoAWQ's GEMM layout with zero points runs"
        )
    out: dict[str, torch.Tensor | QuantTensor] = {}
    modules = {k.removesuffix(".qweight") for k in state if k.endswith(".qweight")}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if module not in modules or leaf not in ("qweight", "qzeros", "scales", "g_idx"):
            out[key] = value
    for m in sorted(modules):
        parts = [state.get(f"{m}.{leaf}") for leaf in ("qweight", "qzeros", "scales")]
        if any(p is None for p in parts):
            raise ValueError(f"{method}: {m} has a qweight but lacks qzeros or scales")
        if method == "awq":
            out[f"{m}.weight"] = awq_weight(*parts, qconfig, name=m)
        else:
            out[f"{m}.weight"] = gptq_weight(*parts, state.get(f"{m}.g_idx"), qconfig, name=m)
    return out
