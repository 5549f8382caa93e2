"""The GGUF reader of the quantized path, on files written here with gguf-py's own writer: the tensor
directory (metadata skipped, string arrays included), which tensors stay quantized, the q/k row order,
and the tied head."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from quant_packers import pack_q4_k
from specfleet.engine.quant.gguf_file import read_quantized, tensor_infos, unpermute_rows

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute for q/k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "é", "hello", "wörld"] * 50)  # strings to skip
    writer.add_array("tokenizer.ggml.scores", [0.5] * 200)
    writer.add_uint32("llama.block_count", 1)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reader_keeps_native_types_quantized_and_unpermutes_q_and_k(tmp_path) -> None:
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, hidden = 4, 2, 64, 256
    q_hf = rng.normal(size=(heads * head_dim, hidden)).astype(np.float32)
    k_hf = rng.normal(size=(kv_heads * head_dim, hidden)).astype(np.float32)
    down = rng.normal(size=(hidden, 512)).astype(np.float32)
    up = rng.normal(size=(512, hidden)).astype(np.float32)
    embed = rng.normal(size=(64, hidden)).astype(np.float32)
    tensors = {
        "token_embd.weight": (gguf.quants.quantize(embed, Q.Q8_0), Q.Q8_0),
        "blk.0.attn_q.weight": (gguf.quants.quantize(_permute(q_hf, heads), Q.Q4_0), Q.Q4_0),
        "blk.0.attn_k.weight": (pack_q4_k(_permute(k_hf, kv_heads)), Q.Q4_K),
        "blk.0.ffn_down.weight": (gguf.quants.quantize(down, Q.Q4_1), Q.Q4_1),
        "blk.0.ffn_up.weight": (up.astype(np.float16), Q.F16),  # not a native type: left to the float path
        "blk.0.attn_norm.weight": (np.ones(hidden, dtype=np.float32), Q.F32),
    }
    path = tmp_path / "tiny.gguf"
    _write(path, tensors)
    infos = {t.name: t for t in tensor_infos(path)}
    assert infos["blk.0.ffn_down.weight"].shape == (512, hidden)  # ne order: input dimension first
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
    out = read_quantized(path, config)
    assert set(out) == {
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    }
    q = out["layers.0.self_attn.q_proj.weight"]
    assert q.fmt == "gguf:Q4_0" and out["layers.0.self_attn.k_proj.weight"].fmt == "gguf:Q4_K"
    # q/k rows are back in Hugging Face order: each dequantized row is close to the original row
    for name, ref in (("q_proj", q_hf), ("k_proj", k_hf)):
        deq = out[f"layers.0.self_attn.{name}.weight"].dequantize().numpy()
        assert np.abs(deq - ref).max() < 0.6, name
        assert np.abs(deq - _permute(ref, heads if name == "q_proj" else kv_heads)).max() > 1.0, name
    assert torch.equal(
        out["lm_head.weight"].dequantize(),
        torch.from_numpy(gguf.quants.dequantize(tensors["token_embd.weight"][0], Q.Q8_0)),
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(24 * 3).reshape(24, 3)
    assert np.array_equal(_permute(w, 3)[unpermute_rows(24, 3).numpy()], w)


def test_a_file_that_is_not_gguf_is_refused(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all, really" * 4)
    with pytest.raises(ValueError, match="not a GGUF v2"):
        tensor_infos(path)
