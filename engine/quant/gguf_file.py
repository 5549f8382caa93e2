"""A GGUF file's quantized linear weights, kept quantized, under the Hugging Face names the model reads.

Only the projections (q, k, v, o, gate, up, down, and the output head) are taken; embeddings and norms
come from the float32 folder converted once by model_loader (an embedding is a row lookup, not a
matmul). Tensors of types the kernels do not run (Q5_K, Q6_K, F16, ...) are left out, so they keep the
float32 path. With tied embeddings and no ``output.weight`` the head reuses ``token_embd`` as llama.cpp
does.

llama.cpp's converter permutes the rows of Q and K (``permute`` in convert_hf_to_gguf.py) so that its
rotary embedding can rotate adjacent pairs; the engine rotates halves as transformers does, so the rows
are put back (transformers' ``reverse_permute_weights``: K uses the KV head count). A row permutation
touches whole rows, so it is done on the codes, scales and mins without dequantizing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from specfleet.engine.quant.gguf_blocks import NATIVE_TYPES, decode
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


def read_quantized(path: Path, hf_config) -> dict[str, QuantTensor]:
    """Projection weights of the file whose type the kernels run natively, by Hugging Face name."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    out: dict[str, QuantTensor] = {}
    skipped: dict[str, int] = {}
    embed = None
    for t in reader.tensors:
        type_name = t.tensor_type.name
        name = hf_name(t.name)
        if name is None and t.name != "token_embd.weight":
            continue
        if type_name not in NATIVE_TYPES:
            skipped[type_name] = skipped.get(type_name, 0) + 1
            continue
        q = decode(t.data, type_name, (int(t.shape[1]), int(t.shape[0])))
        if t.name == "token_embd.weight":
            embed = q
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            q = q.select_rows(unpermute_rows(q.shape[0], heads if "q_proj" in name else kv_heads))
        out[name] = q
    if "lm_head.weight" not in out and embed is not None and not any(t.name == "output.weight" for t in reader.tensors):
        out["lm_head.weight"] = embed
    log.info("event=gguf_quantized file=%s native=%d float32_fallback=%s", path.name, len(out), skipped or "none")
    return out
