"""A GGUF file's weights under the Hugging Face names the model reads, read tensor by tensor (each read
on its own, no map of the whole file): `read_state` is the whole checkpoint of ``--quantization gguf`` (no float32 copy of the file is
made, on disk or in memory), `read_quantized` its projections alone.

The projections (q, k, v, o, gate, up, down, and the output head) of a type the kernels run
(`gguf_blocks.NATIVE_TYPES`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stay quantized; every other
tensor (norms, the embedding, which is a row lookup rather than a matmul, and projections of other types:
F16, Q2_K, ...) is dequantized on its own with gguf-py's dequantizer, the one transformers' GGUF loader
uses. With tied embeddings and no ``output.weight`` the head reuses ``token_embd`` as llama.cpp does.

llama.cpp's converter permutes the rows of Q and K (``permute`` in convert_hf_to_gguf.py) so that its
rotary embedding can rotate adjacent pairs; the engine rotates halves as transformers does, so the rows
are put back (transformers' ``reverse_permute_weights``: K uses the KV head count). A row permutation
touches whole rows, so it is done on the codes, scales and mins without dequantizing.

Beyond Llama, the names follow what the converter writes for each architecture (`hf_config.model_type`):
Qwen3's ``attn_q_norm``/``attn_k_norm``; Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate and up stacked),
split at load by engine/models/phi3.py; Gemma's four norms per layer (its ``ffn_norm`` is the pre-MLP norm,
``post_attention_norm`` and ``post_ffw_norm`` the post norms), each stored by the converter as ``1 + w`` and
read back as ``w`` (transformers' GGUF loader subtracts the same one); mixture-of-experts'
``ffn_gate_inp`` (the router) and the stacked ``ffn_{gate,up,down}_exps`` ([experts, rows, columns]),
read one expert at a time as ``mlp.experts.E.*_proj`` slices of one decoded stack, quantized like the
dense projections. Mixtral is written as a ``llama`` file with an expert count, its q/k rows permuted.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path

import numpy as np
import torch
from specfleet.engine.heap import release_free_memory
from specfleet.engine.quant.gguf_blocks import decode
from specfleet.kernels.quantized import QuantTensor

log = logging.getLogger("specfleet.engine.loader")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Where an architecture's converter writes other projections than Llama's (model_type -> GGUF -> HF module).
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused, split by phi3.py
}
# The stacked expert tensors of a mixture-of-experts file -> each expert's projection.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def hf_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``; None for what is not a projection
    (a stacked expert tensor is several: `GGUFState` names its slices)."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(model_type, {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names and parts[3] == "weight":
        return f"layers.{parts[1]}.{names[parts[2]]}.weight"
    return None


def expert_names(gguf_name: str, experts: int) -> list[str]:
    """``blk.3.ffn_up_exps.weight`` -> ``layers.3.mlp.experts.E.up_proj.weight`` for each expert E; [] for
    what is not a stacked expert tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES and parts[3] == "weight":
        return [f"layers.{parts[1]}.mlp.experts.{e}.{_EXPERT_NAMES[parts[2]]}.weight" for e in range(experts)]
    return []


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's q/k permutation: hf_weight = gguf_weight[index]."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


# GGUF metadata value types (gguf-py GGUFValueType) -> fixed byte sizes; 8 = string, 9 = array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# ggml_type ids of the natively run types (ggml.h enum ggml_type)
_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_FLOAT_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
}
_LAYER_FLOAT_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a mixture-of-experts router
}
_GEMMA_FLOAT_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ARCH_FLOAT_NAMES = {
    "gemma2": _GEMMA_FLOAT_NAMES,
    "gemma3": _GEMMA_FLOAT_NAMES,
    "gemma3_text": _GEMMA_FLOAT_NAMES,
}
# Architectures whose norms the converter stores as 1 + w (Gemma's RMSNorm multiplies by 1 + w).
_NORM_PLUS_ONE = tuple(_ARCH_FLOAT_NAMES)
# Architectures whose q/k rows llama.cpp's converter permutes (transformers un-permutes the same ones).
_PERMUTED = ("llama", "mistral", "mixtral")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # ne order: innermost (input) dimension first
    offset: int  # from the start of the file


# struct formats of the scalar metadata types (gguf-py GGUFValueType), read by `scalar_metadata`
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def tensor_infos(path: Path) -> list[TensorInfo]:
    """The tensor directory of a GGUF (v2/v3) file. gguf-py's reader also decodes every metadata value
    (a 49k-token vocabulary is ~100k numpy views, tens of seconds on a small CPU); this skips them."""
    return _directory(path)[1]


def scalar_metadata(path: Path) -> dict[str, int | float | bool | str]:
    """The file's metadata values that are numbers or strings (arrays, the vocabulary among them, skipped)."""
    return _directory(path)[0]


def _directory(path: Path) -> tuple[dict[str, int | float | bool | str], list[TensorInfo]]:
    data = memoryview(_head(path))
    pos = 0

    def take(fmt: str):
        nonlocal pos
        out = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return out[0] if len(out) == 1 else out

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(data[pos - n : pos]).decode()

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            n = take("Q")  # not `pos += take(...)`: that would add to the position before the length
            pos += n
        elif vtype == 9:
            item, count = take("I"), take("Q")
            if item in _SCALAR_BYTES:
                pos += _SCALAR_BYTES[item] * count
            else:
                for _ in range(count):
                    skip_value(item)
        else:
            pos += _SCALAR_BYTES[vtype]

    magic, version, n_tensors, n_kv = take("4s"), take("I"), take("Q"), take("Q")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a GGUF v2+ file (magic {magic!r}, version {version})")
    alignment = 32
    scalars: dict[str, int | float | bool | str] = {}
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        if vtype in _SCALAR_FORMATS:
            scalars[key] = take(_SCALAR_FORMATS[vtype])
        elif vtype == 8:
            scalars[key] = string()
        else:
            skip_value(vtype)
    alignment = int(scalars.get("general.alignment", alignment))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        shape = tuple(take("Q") for _ in range(n_dims))
        infos.append((name, take("I"), shape, take("Q")))
    start = -(-pos // alignment) * alignment
    # The helpers above form a reference cycle (skip_value calls itself) that holds `data` until the garbage
    # collector runs: released here, the 64 MB read is freed now rather than resident through the load.
    data.release()
    return scalars, [TensorInfo(name, t, shape, start + off) for name, t, shape, off in infos]


def _head(path: Path) -> bytes:
    """The file up to the end of its tensor directory (metadata is a few MB at most; read 64 MB to be safe,
    or the whole file when smaller)."""
    with path.open("rb") as f:
        return f.read(64 << 20)


def float_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The HF name of a tensor the engine reads as float (norms, embedding, q/k/v biases, a router); None
    otherwise."""
    if gguf_name in _FLOAT_NAMES:
        return _FLOAT_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = {**_LAYER_FLOAT_NAMES, **_ARCH_FLOAT_NAMES.get(model_type, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"layers.{parts[1]}.{names[parts[2]]}"
    return None


def _raw(f: BufferedReader, t: TensorInfo) -> tuple[np.ndarray, int]:
    """A tensor's bytes, [rows, bytes per row], and its row count. Read with a plain read rather than kept as
    a view of a memory map: mapped pages count in the process's resident memory for as long as the map
    lives, so the engine would hold the file once more beside the blocks decoded from it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
    cols, rows = t.shape[0], int(np.prod(t.shape[1:], dtype=np.int64))
    size = rows * (cols // values) * nbytes
    f.seek(t.offset)
    data = np.empty(size, dtype=np.uint8)
    if f.readinto(data.data) != size:
        raise ValueError(f"GGUF tensor {t.name}: the file ends before its {size} bytes")
    return data.reshape(rows, -1), rows


def _dequantized(blob: BufferedReader, t: TensorInfo) -> torch.Tensor:
    """One tensor in float32, torch order (outermost GGUF dimension first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw, rows = _raw(blob, t)
    qtype = GGMLQuantizationType(t.type_id)
    out = np.empty((rows, t.shape[0]), dtype=np.float32)
    for i in range(0, rows, _ROWS_PER_CHUNK):
        out[i : i + _ROWS_PER_CHUNK] = dequantize(np.asarray(raw[i : i + _ROWS_PER_CHUNK]), qtype)
    return torch.from_numpy(out.reshape(tuple(reversed(t.shape))))


# Rows dequantized at a time: the dequantizers' temporaries (several float32 copies of their input) then stay
# a few MB instead of several times a 49k-row embedding (113 MB in float32 for SmolLM2).
_ROWS_PER_CHUNK = 2048


def read_float_tensor(path: Path, name: str) -> torch.Tensor | None:
    """One tensor of the file by its GGUF name, dequantized to float32; None when the file has none."""
    for t in tensor_infos(path):
        if t.name == name:
            with path.open("rb") as f:
                return _dequantized(f, t)
    return None


class GGUFState(Mapping[str, "torch.Tensor | QuantTensor"]):
    """Every weight of the file by Hugging Face name (no ``model.`` prefix), read from the file only when
    asked for and never kept: the model takes one layer's tensors, packs them into its kernels' layouts and
    drops them before it asks for the next layer's, so loading holds the packed model plus one layer.

    Projections and the embedding of a native type are `QuantTensor`s (the embedding a quantized row table,
    not float32: it is as large as every projection of a small model together); the rest is dequantized to
    float32. ``lm_head.weight`` is listed only when the file has ``output.weight``: without it the head is
    the embedding (llama.cpp's tied head), which the model then reads once for both."""

    def __init__(self, path: Path, hf_config):
        self.path = path
        self._heads = hf_config.num_attention_heads
        self._kv_heads = getattr(hf_config, "num_key_value_heads", None) or self._heads
        model_type = self._model_type = str(getattr(hf_config, "model_type", "llama"))
        self._permuted = model_type in _PERMUTED
        self._plus_one = model_type in _NORM_PLUS_ONE
        self._infos: dict[str, TensorInfo] = {}
        self._expert: dict[str, int] = {}  # an expert's projection -> its index in the stacked tensor
        self._stacks: dict[str, torch.Tensor | QuantTensor] = {}  # the current layer's expert stacks
        for t in tensor_infos(path):
            experts = expert_names(t.name, t.shape[2]) if len(t.shape) == 3 else []
            for e, expert in enumerate(experts):
                self._infos[expert], self._expert[expert] = t, e
            name = hf_name(t.name, model_type) or float_name(t.name, model_type)
            if name is not None:
                self._infos[name] = t
        self.native = [k for k, t in self._infos.items() if self._native(t)]
        self._layer: str | None = None  # the layer of the last tensor asked for
        skipped: dict[int, int] = {}
        for k, t in self._infos.items():
            if (self._projection(t) or k == "embed_tokens.weight") and not self._native(t):
                skipped[t.type_id] = skipped.get(t.type_id, 0) + 1
        log.info(
            "event=gguf_quantized file=%s native=%d float32_fallback_ggml_types=%s",
            path.name,
            len(self.native),
            skipped or "none",
        )

    def __len__(self) -> int:
        return len(self._infos)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def _projection(self, t: TensorInfo) -> bool:
        return hf_name(t.name, self._model_type) is not None or bool(expert_names(t.name, 1))

    def _native(self, t: TensorInfo) -> bool:
        """Whether the tensor stays quantized: a projection (an expert stack too) or the embedding, of a type
        the kernels run."""
        return (
            t.type_id in _TYPE_NAMES
            and len(t.shape) in (2, 3)
            and (self._projection(t) or t.name == "token_embd.weight")
        )

    def __getitem__(self, name: str) -> torch.Tensor | QuantTensor:
        t = self._infos[name]
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if layer != self._layer:
            # The previous layer's temporaries are freed: give their pages back. Decoding a layer allocates
            # numpy temporaries of a few MB; once the embedding's 30 MB temporaries are freed, glibc serves
            # allocations below that size from its heap rather than their own maps (its mmap threshold
            # follows the largest chunk freed), and a freed heap chunk below live ones stays resident. Over
            # 30 layers that held about 27 MB at the end of the load, the process's peak, for nothing.
            self._layer = layer
            self._stacks.clear()
            release_free_memory()
        if name in self._expert:
            return self._expert_slice(t, self._expert[name])
        with self.path.open("rb") as f:
            if not self._native(t):
                w = _dequantized(f, t)
                if self._permuted and name.endswith(_QK):
                    w = w[self._unpermute(name, w.shape[0])]
                if self._plus_one and name.endswith("norm.weight"):
                    w = w - 1.0  # the converter's 1 + w back to the checkpoint's w
                return w
            k, n = t.shape
            raw, _ = _raw(f, t)
        q = decode(raw, _TYPE_NAMES[t.type_id], (n, k))
        del raw  # the blocks: the codes hold the tensor now
        if self._permuted and name.endswith(_QK):
            q = q.select_rows(self._unpermute(name, n))
        return q

    def _expert_slice(self, t: TensorInfo, expert: int) -> torch.Tensor | QuantTensor:
        """One expert's [rows, columns] of a stacked [experts, rows, columns] tensor. The model takes each
        expert's gate, up and down in turn, so the layer's three stacks are decoded once each and kept until
        the next layer is asked for (a layer's expert codes, beside the packed model)."""
        stack = self._stacks.get(t.name)
        if stack is None:
            cols, rows, experts = t.shape
            with self.path.open("rb") as f:
                if self._native(t):
                    raw, _ = _raw(f, t)
                    stack = decode(raw, _TYPE_NAMES[t.type_id], (experts * rows, cols))
                    del raw
                else:
                    stack = _dequantized(f, t).reshape(experts * rows, cols)
            self._stacks[t.name] = stack
        rows = t.shape[1]
        if isinstance(stack, QuantTensor):
            return stack.select_rows(torch.arange(expert * rows, (expert + 1) * rows))
        return stack[expert * rows : (expert + 1) * rows].clone()

    def _unpermute(self, name: str, rows: int) -> torch.Tensor:
        return unpermute_rows(rows, self._heads if "q_proj" in name else self._kv_heads)


# q/k weights and biases, whose rows llama.cpp's converter permutes
_QK = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")


def read_state(path: Path, hf_config) -> GGUFState:
    """Every weight of the file, by HF name, read lazily (`GGUFState`)."""
    return GGUFState(path, hf_config)


def read_quantized(path: Path, hf_config) -> dict[str, QuantTensor]:
    """Projection weights of the file whose type the kernels run natively, by Hugging Face name; with no
    ``output.weight``, the quantized embedding as ``lm_head.weight`` (the tied head)."""
    state = GGUFState(path, hf_config)
    out: dict[str, QuantTensor] = {}
    for name in state.native:
        q = state[name]
        assert isinstance(q, QuantTensor)
        if name != "embed_tokens.weight":
            out[name] = q
        elif "lm_head.weight" not in state:
            out["lm_head.weight"] = q
    return out
