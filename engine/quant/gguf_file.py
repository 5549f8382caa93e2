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


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``; None for what is not a projection."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


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
}
# Architectures whose q/k rows llama.cpp's converter permutes (transformers un-permutes the same ones).
_PERMUTED = ("llama", "mistral")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # ne order: innermost (input) dimension first
    offset: int  # from the start of the file


def tensor_infos(path: Path) -> list[TensorInfo]:
    """The tensor directory of a GGUF (v2/v3) file. gguf-py's reader also decodes every metadata value
    (a 49k-token vocabulary is ~100k numpy views, tens of seconds on a small CPU); this skips them."""
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
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        if key == "general.alignment":
            alignment = take("I")
        else:
            skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        shape = tuple(take("Q") for _ in range(n_dims))
        infos.append((name, take("I"), shape, take("Q")))
    start = -(-pos // alignment) * alignment
    # The helpers above form a reference cycle (skip_value calls itself) that holds `data` until the garbage
    # collector runs: released here, the 64 MB read is freed now rather than resident through the load.
    data.release()
    return [TensorInfo(name, t, shape, start + off) for name, t, shape, off in infos]


def _head(path: Path) -> bytes:
    """The file up to the end of its tensor directory (metadata is a few MB at most; read 64 MB to be safe,
    or the whole file when smaller)."""
    with path.open("rb") as f:
        return f.read(64 << 20)


def float_name(gguf_name: str) -> str | None:
    """The HF name of a tensor the engine reads as float (norms, embedding, q/k/v biases); None otherwise."""
    if gguf_name in _FLOAT_NAMES:
        return _FLOAT_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_FLOAT_NAMES:
        return f"layers.{parts[1]}.{_LAYER_FLOAT_NAMES[parts[2]]}"
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
        self._permuted = getattr(hf_config, "model_type", "llama") in _PERMUTED
        self._infos: dict[str, TensorInfo] = {}
        for t in tensor_infos(path):
            name = hf_name(t.name) or float_name(t.name)
            if name is not None:
                self._infos[name] = t
        self.native = [k for k, t in self._infos.items() if _is_native(t)]
        self._layer: str | None = None  # the layer of the last tensor asked for
        skipped: dict[int, int] = {}
        for k, t in self._infos.items():
            if (hf_name(t.name) or k == "embed_tokens.weight") and not _is_native(t):
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
            release_free_memory()
        with self.path.open("rb") as f:
            if not _is_native(t):
                w = _dequantized(f, t)
                if self._permuted and name.endswith(_QK):
                    w = w[self._unpermute(name, w.shape[0])]
                return w
            k, n = t.shape
            raw, _ = _raw(f, t)
        q = decode(raw, _TYPE_NAMES[t.type_id], (n, k))
        del raw  # the blocks: the codes hold the tensor now
        if self._permuted and name.endswith(_QK):
            q = q.select_rows(self._unpermute(name, n))
        return q

    def _unpermute(self, name: str, rows: int) -> torch.Tensor:
        return unpermute_rows(rows, self._heads if "q_proj" in name else self._kv_heads)


# q/k weights and biases, whose rows llama.cpp's converter permutes
_QK = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")


def _is_native(t: TensorInfo) -> bool:
    """Whether the tensor stays quantized: a projection or the embedding, of a type the kernels run."""
    return (
        t.type_id in _TYPE_NAMES
        and len(t.shape) == 2
        and (hf_name(t.name) is not None or t.name == "token_embd.weight")
    )


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
