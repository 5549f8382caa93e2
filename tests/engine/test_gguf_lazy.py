"""``--quantization gguf`` reads a GGUF file as published, tensor by tensor: a tiny llama written here with
gguf-py's writer in llama.cpp's Q4_K_M mix for rows that are not multiples of 256 (Q5_0 projections, Q6_K
and Q5_K ffn_down, a Q5_1 head, Q8_0 embedding, F32 norms) runs every projection quantized and writes the
greedy tokens of the float32 engine over the same weights dequantized by gguf-py; its cache holds the
config and tokenizer only, no float32 copy of the weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import copy_tokenizer, tiny_config, tiny_state
from specfleet.bench.gpu.quant_packers import pack_q5_k, pack_q6_k
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.quant.gguf_file import unpermute_rows
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build"),
]
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

PROMPTS = [[1, 5, 9, 200, 31, 7, 77, 1000, 4, 19, 23, 88], [42], [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# hidden 320: a multiple of 32 but not of 256, as SmolLM2's 576, so llama.cpp's k-quant mixes put Q5_0 there
HIDDEN, INTERMEDIATE = 320, 512
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"


def _qtype(gguf_name: str) -> Q:
    if gguf_name.endswith("_norm.weight"):
        return Q.F32
    if gguf_name == "token_embd.weight":
        return Q.Q8_0
    if gguf_name == "output.weight":
        return Q.Q5_1
    if gguf_name.endswith("ffn_down.weight"):  # Q4_K_M: Q6_K on half of ffn_down; Q5_K_M's Q5_K on others
        return Q.Q6_K if gguf_name.startswith("blk.0.") else Q.Q5_K
    return Q.Q5_0


def _quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return w
    if qtype in (Q.Q5_K, Q.Q6_K):  # gguf-py has no quantizer for these: the test packers
        return pack_q5_k(w) if qtype == Q.Q5_K else pack_q6_k(w)
    return gguf.quants.quantize(w, qtype)


def _write_files(tmp_path: Path, bundled_path: Path, tied: bool = False):
    """The GGUF file and its float32 reference; `tied`: no output.weight (the head is the embedding)."""
    config = tiny_config(
        "llama", hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, tie_word_embeddings=tied
    )
    state = tiny_state(config, std=0.2)
    if tied:
        state.pop("lm_head.weight", None)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    dequantized = {}
    for name, tensor in state.items():
        w = tensor.numpy().astype(np.float32)
        gname, qtype = _gguf_name(name), _qtype(_gguf_name(name))
        if "q_proj" in name or "k_proj" in name:
            w = _permute(w, heads if "q_proj" in name else kv_heads)
        raw = _quantize(w, qtype)
        writer.add_tensor(gname, raw, raw_dtype=qtype)
        back = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(w.shape)
        if "q_proj" in name or "k_proj" in name:  # back to HF row order, as transformers' converter does
            back = back[unpermute_rows(w.shape[0], heads if "q_proj" in name else kv_heads).numpy()]
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the float32 reference: the same weights, dequantized by gguf-py, as a plain checkpoint
    from safetensors.torch import save_file

    ref = tmp_path / "dequantized"
    ref.mkdir()
    save_file(dequantized, ref / "model.safetensors")
    (ref / "config.json").write_text(json.dumps(config.to_dict()))
    copy_tokenizer(bundled_path, ref)
    return config, tmp_path / "tiny.gguf", ref


def test_gguf_q5_q6_model_loads_lazily_and_matches_its_dequantized_weights(
    tmp_path: Path, bundled_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specfleet.engine import checkpoint
    from specfleet.engine.quant import gguf_source

    config, path, ref = _write_files(tmp_path, bundled_path)

    def metadata(gguf_path: Path, folder: Path) -> None:  # the tiny file carries no tokenizer metadata
        (folder / "config.json").write_text(json.dumps(config.to_dict()))
        copy_tokenizer(bundled_path, folder)

    monkeypatch.setattr(gguf_source, "_write_metadata", metadata)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECFLEET_CACHE", str(cache))
    state = checkpoint.checkpoint_state(tmp_path, path, config, "gguf")
    formats = {k: v.fmt for k, v in state.items() if isinstance(v, QuantTensor)}
    assert formats["layers.0.mlp.down_proj.weight"] == "gguf:Q6_K"
    assert formats["layers.1.mlp.down_proj.weight"] == "gguf:Q5_K"
    assert formats["layers.0.self_attn.q_proj.weight"] == "gguf:Q5_0"
    assert formats["lm_head.weight"] == "gguf:Q5_1"
    assert formats["embed_tokens.weight"] == "gguf:Q8_0"  # a quantized row table, not float32 rows
    assert len(formats) == 2 * 7 + 2  # every projection, the head and the embedding stay quantized
    expected = [
        r.outputs[0].token_ids
        for r in LLM(model=f"file://{ref}", block_size=4, kv_cache_gib=0.02).generate(PROMPTS, GREEDY)
    ]
    llm = LLM(
        model=f"file://{path}",
        quantization="gguf",
        quantized_activations="float32",
        block_size=4,
        kv_cache_gib=0.02,
    )
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert len({tuple(e) for e in expected}) == len(expected)
    # the cache holds the metadata folder only: no float32 conversion of the weights
    folders = [p for p in (cache / "models").iterdir() if not p.name.startswith(".")]
    assert [p.name.endswith("-metadata") for p in folders] == [True]
    assert not list(folders[0].glob("*.safetensors"))
    # the API server's process reads its tokenizer from the same folder (engine/core/client.py)
    assert gguf_source.resolve_source(f"file://{path}", "gguf").path == folders[0]


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_gguf_loads_one_fused_group_at_a_time_and_keeps_the_embedding_quantized(
    tmp_path: Path, bundled_path: Path, monkeypatch: pytest.MonkeyPatch, activations: str
) -> None:
    """The memory property of --quantization gguf, structurally: the model asks for a fused group's tensors
    (q/k/v, o, gate/up, down) only once every other group's decoded tensors are gone (held: the packed model
    plus one group's decoded codes), and a tied quantized embedding lives once, in the head's packed panels
    (no float32 table of vocab rows)."""
    import weakref

    from specfleet.engine.models.llama import LlamaModel
    from specfleet.engine.quant.gguf_file import GGUFState

    config, path, ref = _write_files(tmp_path, bundled_path, tied=True)
    state = GGUFState(path, config)
    handed: list[tuple[int, str, weakref.ref]] = []  # (layer, group, a decoded projection handed out)
    groups = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}

    class Watched(dict):
        def __getitem__(self, name: str):
            parts = name.split(".")
            layer, group = (
                (int(parts[1]), groups.get(parts[3], parts[3])) if parts[0] == "layers" else (-1, "")
            )
            alive = [(n, g) for n, g, r in handed if r() is not None and n > -1 and (n, g) != (layer, group)]
            assert not alive, f"{name} asked for while {alive} are still decoded"
            value = state[name]
            if isinstance(value, QuantTensor):  # decoded codes (float norms are the model's own, kept)
                handed.append((layer, group, weakref.ref(value)))
            return value

    model = LlamaModel(
        config,
        Watched.fromkeys(state),
        torch.float32,
        torch.device("cpu"),
        quantize="gguf",
        activations=activations,
    )
    assert sorted({n for n, _, _ in handed}) == [-1, 0, 1]
    assert model.embed is None and isinstance(model.lm_head, cpu_native.QuantLinear)
    tensors = [t for t in vars(model).values() if isinstance(t, torch.Tensor)]
    assert not [t for t in tensors if t.dtype == torch.float32 and t.shape[0] == config.vocab_size]
    ids = torch.tensor([0, 5, 31, 32, 33, 1000, config.vocab_size - 1])
    embed = state["embed_tokens.weight"]
    assert isinstance(embed, QuantTensor) and embed.fmt == "gguf:Q8_0"
    assert torch.equal(model.embed_tokens(ids), embed.select_rows(ids).dequantize())
    if activations == "float32":  # exact: the float32 engine's greedy tokens over the dequantized weights
        expected = [
            r.outputs[0].token_ids
            for r in LLM(model=f"file://{ref}", block_size=4, kv_cache_gib=0.02).generate(PROMPTS, GREEDY)
        ]
        from specfleet.engine.quant import gguf_source

        def metadata(gguf_path: Path, folder: Path) -> None:
            (folder / "config.json").write_text(json.dumps(config.to_dict()))
            copy_tokenizer(bundled_path, folder)

        monkeypatch.setattr(gguf_source, "_write_metadata", metadata)
        monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path / "cache"))
        llm = LLM(
            model=f"file://{path}",
            quantization="gguf",
            quantized_activations="float32",
            block_size=4,
            kv_cache_gib=0.02,
        )
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected
