"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layer with fused checkpoint tensors, LongRoPE and partial rotary.

- The checkpoint fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; they are split at load into
  Llama's names (LlamaLayer fuses them again, in the same order), so the layer, the native decode layers,
  int8 and tensor parallelism run Llama's code unchanged. A GGUF's packed `attn_qkv` and `ffn_up` (gate and
  up stacked, engine/quant/gguf_file.py) split the same way, by whole rows of blocks. LoRA adapters name the fused modules as PEFT does
  (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`): each of `qkv_proj` and `gate_up_proj` is one piece
  spanning the engine's fused projection, its B's q and k columns permuted as the base's rows are.
- Partial rotary (`partial_rotary_factor`, Phi-4-mini's 0.75): transformers rotates the first `rotary_dim`
  values of each head, pairing i with i + rotary_dim/2, and passes the rest. The rows of q_proj and k_proj
  are permuted within each head at load so those pairs sit at i and i + head_dim/2, where Llama's
  roll-by-half rotary pairs them; the passed values get cos 1 and sin 0. q and k are permuted alike, so
  their dot products, and so attention, are those of the unpermuted model; v is not touched.
- LongRoPE ("longrope", formerly "su"): transformers rotates with `short_factor` while a sequence fits in
  `original_max_position_embeddings`, and re-prefills it with `long_factor` once it grows past that. The
  engine picks one table for every sequence when it starts: the short factors when its context
  (max_model_len) fits the original window, so that every sequence is exact, and the long factors when it
  does not, exact for every sequence longer than the window. cos and sin carry transformers' attention
  factor, sqrt(1 + ln(max_position / original) / ln(original)).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from specfleet.engine.lora.adapter import ModelShape
from specfleet.engine.models.llama import LlamaArgs, LlamaModel
from specfleet.kernels.quantized import QuantTensor


def _rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    return params


def rotary_dim(config, head_dim: int) -> int:
    """How many values of each head rotate (transformers: int(head_dim * partial_rotary_factor))."""
    factor = _rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim * factor)
    if dim % 2 or dim < 2 or (head_dim - dim) % 2:
        raise ValueError(
            f"partial_rotary_factor={factor}: rotary_dim {dim} of head_dim {head_dim} must be even, "
            "with an even number of values left unrotated"
        )
    return dim


def head_permutation(head_dim: int, rot: int) -> torch.Tensor:
    """perm[new] = old: the pairs (i, i + rot/2) of the rotated values moved to (i, i + head_dim/2), the
    unrotated values split between the two halves after them."""
    half, rhalf, rest = head_dim // 2, rot // 2, (head_dim - rot) // 2
    first = list(range(rhalf)) + list(range(rot, rot + rest))
    second = list(range(rhalf, rot)) + list(range(rot + rest, head_dim))
    assert len(first) == len(second) == half
    return torch.tensor(first + second)


def _rows(weight: torch.Tensor | QuantTensor, index: torch.Tensor) -> torch.Tensor | QuantTensor:
    """The rows `index` of a weight, dense or packed (a GGUF's blocks run along a row: rows move whole)."""
    return weight.select_rows(index) if isinstance(weight, QuantTensor) else weight[index]


def _split(
    weight: torch.Tensor | QuantTensor, sizes: list[int], head_dim: int, perm: torch.Tensor
) -> list[torch.Tensor | QuantTensor]:
    """A fused projection's pieces of `sizes` rows; with q/k/v's three, q and k heads permuted by `perm`."""
    parts, start = [], 0
    for i, size in enumerate(sizes):
        index = torch.arange(start, start + size)
        if len(sizes) == 3 and i < 2:  # q, k: each head's rows in the rotary layout (head_permutation)
            index = index.view(-1, head_dim)[:, perm].reshape(-1)
        parts.append(_rows(weight, index))
        start += size
    return parts


def inverse_frequencies(config, rot: int, long: bool) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies over the `rot` rotated values and its cos/sin scaling factor."""
    params = _rope_parameters(config)
    exponents = torch.arange(0, rot, 2, dtype=torch.int64).float() / rot
    if params["rope_type"] == "default":
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if params["rope_type"] != "longrope":
        raise ValueError(
            f"Phi3ForCausalLM: rope type {params['rope_type']!r} is not supported; "
            "supported: default, longrope (su)"
        )
    original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = params.get("factor") or config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != rot // 2:
        which = "long_factor" if long else "short_factor"
        raise ValueError(f"rope_scaling.{which} has {ext.numel()} entries; rotary_dim {rot} needs {rot // 2}")
    return 1.0 / (ext * params["rope_theta"] ** exponents), float(attention)


def original_window(config) -> int | None:
    """LongRoPE's original context (short factors inside it), or None without LongRoPE."""
    params = _rope_parameters(config)
    if params["rope_type"] != "longrope":
        return None
    return params.get("original_max_position_embeddings") or config.original_max_position_embeddings


_FUSED = {
    "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
}


class _SplitState(Mapping[str, "torch.Tensor | QuantTensor"]):
    """The checkpoint under Llama's names, each fused tensor split when one of its pieces is asked for. The
    state may be lazy (a GGUF file, gguf_file.GGUFState): the fused tensor is read once, its pieces kept
    until the next fused tensor is read (the layer takes q, k, v, then gate, up, in turn)."""

    def __init__(
        self, state: Mapping[str, torch.Tensor | QuantTensor], sizes: list[int], head_dim: int, perm
    ):
        self._state, self._sizes, self._head_dim, self._perm = state, sizes, head_dim, perm
        self._names: dict[str, tuple[str, int]] = {}  # name -> (the state's name, piece; -1: as is)
        for name in state:
            suffix = next((f for f in _FUSED if name.endswith(f)), None)
            if suffix is None:
                self._names[name] = (name, -1)
                continue
            base = name.removesuffix(suffix)
            module = suffix.split(".")[0]
            for i, piece in enumerate(_FUSED[suffix]):
                self._names[f"{base}{module}.{piece}.weight"] = (name, i)
        self._pieces: tuple[str, list[torch.Tensor | QuantTensor]] | None = None

    def __getitem__(self, name: str) -> torch.Tensor | QuantTensor:
        source, piece = self._names[name]
        if piece < 0:
            return self._state[source]
        if self._pieces is None or self._pieces[0] != source:
            self._pieces = None  # dropped before the next fused tensor is read
            w = self._state[source]
            if source.endswith("qkv_proj.weight"):
                parts = _split(w, self._sizes, self._head_dim, self._perm)
            else:
                parts = _split(w, [w.shape[0] // 2] * 2, self._head_dim, self._perm)
            self._pieces = (source, parts)
        return self._pieces[1][piece]

    def __contains__(self, name: object) -> bool:
        return name in self._names  # without reading the tensor

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# PEFT's module names on Phi3ForCausalLM -> (the engine's fused projection, first piece, pieces spanned)
LORA_TARGETS = {
    "qkv_proj": ("qkv", 0, 3),
    "o_proj": ("o", 0, 1),
    "gate_up_proj": ("gate_up", 0, 2),
    "down_proj": ("down", 0, 1),
}


class Phi3Model(LlamaModel):
    architecture = "Phi3ForCausalLM"
    rotary: int  # values rotated per head: set by rope_tables (at construction), read by lora_shape
    refused_quantization = dict.fromkeys(
        ("awq", "gptq"),
        "not yet checked against transformers on this architecture (its fused qkv_proj and gate_up_proj "
        "are split at load); serve the float checkpoint, with quantization='int8' for 8-bit weights",
    )

    @classmethod
    def llama_state(
        cls, config, state: Mapping[str, torch.Tensor | QuantTensor]
    ) -> Mapping[str, torch.Tensor | QuantTensor]:
        if not any(k.endswith("qkv_proj.weight") or k.endswith("gate_up_proj.weight") for k in state):
            return state  # already under Llama's names (a split worker's slice)
        a = LlamaArgs.from_hf(config)
        perm = head_permutation(a.head_dim, rotary_dim(config, a.head_dim))
        sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        return _SplitState(state, sizes, a.head_dim, perm)

    def lora_shape(self) -> ModelShape:
        """The fused modules PEFT names, and the fused q/k/v columns in the order llama_state put the rows."""
        a = self.args
        perm = head_permutation(a.head_dim, self.rotary)
        q = (torch.arange(a.num_heads)[:, None] * a.head_dim + perm).flatten()
        k = (torch.arange(a.num_kv_heads)[:, None] * a.head_dim + perm).flatten() + q.numel()
        v = torch.arange(a.num_kv_heads * a.head_dim) + q.numel() + k.numel()
        columns = torch.cat((q, k, v))
        return ModelShape.of(a, self.architecture, targets=LORA_TARGETS, qkv_columns=columns)

    def rope_tables(self, config) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [positions, head_dim], in the permuted head layout (llama_state)."""
        a, window = self.args, original_window(config)
        rot = self.rotary = rotary_dim(config, a.head_dim)
        inv_freq, scaling = inverse_frequencies(
            config, rot, long=window is not None and self.max_model_len > window
        )
        freqs = torch.outer(torch.arange(a.max_position, dtype=torch.float32), inv_freq)
        cos_rot, sin_rot = freqs.cos() * scaling, freqs.sin() * scaling  # [positions, rot / 2]
        pad = (a.head_dim - rot) // 2
        ones, zeros = torch.ones(a.max_position, pad), torch.zeros(a.max_position, pad)
        cos = torch.cat((cos_rot, ones, cos_rot, ones), dim=-1)
        # rotate_half(x) * sin == roll(x, head_dim / 2) * cat(-sin, sin) in the permuted layout
        sin = torch.cat((-sin_rot, zeros, sin_rot, zeros), dim=-1)
        return cos, sin
