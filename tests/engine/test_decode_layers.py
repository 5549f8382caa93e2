"""The layers of a decode step in one native call (cpu_native.DecodeLayers) against the per-layer path they
replace: the same hidden states and the same KV cache contents, bit for bit, for every weight form the
native kernels run (float32, int8, 4-bit and 8-bit grouped codes with float or int8 activations), with and
without q/k/v bias, for decode and verification rows, and with a padding row that writes no slot."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_config, tiny_state, write_tiny_checkpoint
from safetensors.torch import load_file
from specfleet.bench.gpu.quant_packers import pack_q4_k, pack_q6_k
from specfleet.engine.attention.base import AttentionMetadata
from specfleet.engine.attention.native_backend import NativeAttentionBackend
from specfleet.engine.models.llama import LlamaModel
from specfleet.engine.quant.gguf_blocks import decode
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels did not build")

BLOCK = 4
HIDDEN, INTER, LAYERS = 128, 256, 2
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config(arch: str):
    # 4 attention heads: head_dim 32, as the native attention needs multiples of 16
    return tiny_config(
        arch,
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        max_position_embeddings=128,
    )


def _grouped(w: torch.Tensor, bits: int) -> QuantTensor:
    """Round-to-nearest codes in groups of 32 (4-bit with mins, as GGUF Q4_1; 8-bit symmetric, as Q8_0)."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return QuantTensor(codes.reshape(n, k), scale, lo, 32, 4, "test:q4")
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-8)
    codes = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return QuantTensor(codes.reshape(n, k), scale, None, 32, 8, "test:q8")


def _model(arch: str, form: str) -> LlamaModel:
    config = _config(arch)
    state = tiny_state(config, std=0.2)
    quantize, activations = None, "int8"
    if form == "int8":
        quantize = "int8"
    elif form != "float32":
        bits, activations = (4 if form.startswith("q4") else 8), form.split("-")[1]
        quantize = "gguf"
        for name, w in list(state.items()):
            if any(p in name for p in PROJECTIONS) and name.endswith("weight"):
                state[name] = _grouped(w, bits)
    return LlamaModel(
        config, state, torch.float32, torch.device("cpu"), quantize=quantize, activations=activations
    )


def _caches(model: LlamaModel, blocks: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a = model.args
    g = torch.Generator().manual_seed(1)
    shape = (blocks, BLOCK, a.num_kv_heads, a.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(a.num_layers)]


def _step(query_lens: list[int], seq_lens: list[int], padding: int = 0):
    """A step's inputs: sequence b owns blocks 4b..4b+3 and queries its last query_lens[b] positions;
    `padding` rows after them belong to no sequence and have slot -1 (nothing is written for them)."""
    ids, positions, slots = [], [], []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s - q, s):
            ids.append((7 * b + pos) % 256)
            positions.append(pos)
            slots.append(4 * b * BLOCK + pos)
    ids += [0] * padding
    positions += [0] * padding
    slots += [-1] * padding
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [[4 * b + j for j in range(4)] for b in range(len(seq_lens))], dtype=torch.int32
        ),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        block_size=BLOCK,
    )
    return torch.tensor(ids), torch.tensor(positions), meta


def _both_paths(model: LlamaModel, query_lens, seq_lens, padding=0):
    attn = NativeAttentionBackend()
    ids, positions, meta = _step(query_lens, seq_lens, padding)
    attn.prepare(meta)
    fused_caches = _caches(model)
    layered_caches = copy.deepcopy(fused_caches)
    fused = model.forward(ids, positions, fused_caches, meta, attn)
    assert model._decode_layers(fused_caches, meta, attn) is not None, "the fused path was not taken"
    per_layer = copy.copy(model)
    per_layer._decode_layers = lambda *args: None  # the per-layer loop of LlamaModel.forward
    layered = per_layer.forward(ids, positions, layered_caches, meta, attn)
    return fused, layered, fused_caches, layered_caches


FORMS = ("float32", "int8", "q4-int8", "q4-float32", "q8-int8", "q8-float32")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_layers_equal_the_per_layer_path(arch: str, form: str) -> None:
    model = _model(arch, form)
    # decode rows, a verification of 3 rows, and a padding row after them
    fused, layered, fc, lc = _both_paths(model, query_lens=[1, 3, 1], seq_lens=[5, 9, 13], padding=1)
    real = fused.shape[0] - 1
    assert torch.equal(fused[:real], layered[:real])
    for (fk, fv), (lk, lv) in zip(fc, lc, strict=True):
        assert torch.equal(fk, lk) and torch.equal(fv, lv)


@pytest.mark.parametrize("form", ["float32", "int8"])
def test_qwen3_q_and_k_norms_run_inside_the_decode_layers(form: str) -> None:
    from specfleet.engine.models.qwen3 import Qwen3Model

    config = _config("qwen3")
    quantize = "int8" if form == "int8" else None
    model = Qwen3Model(
        config, tiny_state(config, std=0.2), torch.float32, torch.device("cpu"), quantize=quantize
    )
    fused, layered, fc, lc = _both_paths(model, query_lens=[1, 3, 1], seq_lens=[5, 9, 13], padding=1)
    real = fused.shape[0] - 1
    assert torch.equal(fused[:real], layered[:real])
    for (fk, fv), (lk, lv) in zip(fc, lc, strict=True):
        assert torch.equal(fk, lk) and torch.equal(fv, lv)


def _k_quant_model(activations: str) -> LlamaModel:
    """A Q4_K_M-like mix from llama.cpp's own block layouts: Q4_K projections, Q6_K v and down, so the fused
    q/k/v holds 6-bit codes in groups of 16 and every K-quant keeps its two-level scales."""
    config = tiny_config(
        "llama",
        vocab_size=256,
        hidden_size=256,  # K-quant rows are whole 256-value super-blocks
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        max_position_embeddings=128,
    )
    state = tiny_state(config, std=0.2)
    for name, w in list(state.items()):
        if any(p in name for p in PROJECTIONS) and name.endswith("weight"):
            six = "v_proj" in name or "down_proj" in name
            raw = (pack_q6_k if six else pack_q4_k)(w.numpy())
            state[name] = decode(raw, "Q6_K" if six else "Q4_K", tuple(w.shape))
    return LlamaModel(
        config, state, torch.float32, torch.device("cpu"), quantize="gguf", activations=activations
    )


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_decode_layers_run_k_quants_as_packed(activations: str) -> None:
    model = _k_quant_model(activations)
    layer = model.layers[0]
    assert (layer.qkv.bits, layer.gate_up.bits, layer.down.bits) == (6, 4, 6)
    assert all(lin.two_level is not None for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    fused, layered, fc, lc = _both_paths(model, query_lens=[1, 3, 1], seq_lens=[5, 9, 13], padding=1)
    real = fused.shape[0] - 1
    assert torch.equal(fused[:real], layered[:real])
    for (fk, fv), (lk, lv) in zip(fc, lc, strict=True):
        assert torch.equal(fk, lk) and torch.equal(fv, lv)


def test_a_prefill_chunk_keeps_the_per_layer_path() -> None:
    model = _model("llama", "float32")
    attn = NativeAttentionBackend()
    ids, positions, meta = _step([20], [20])  # longer than the native backend's short queries
    attn.prepare(meta)
    assert model._decode_layers(_caches(model), meta, attn) is None


def test_bad_inputs_are_refused_naming_the_tensor() -> None:
    model = _model("llama", "float32")
    attn = NativeAttentionBackend()
    ids, positions, meta = _step([1], [5])
    attn.prepare(meta)
    fused = model._decode_layers(_caches(model), meta, attn)
    assert fused is not None
    x = model.embed_tokens(ids)
    args = (model.cos, model.sin, meta.slot_mapping, meta.block_tables, meta.backend_state.short_seqs)
    rest = (meta.query_start_loc, meta.seq_lens)
    with pytest.raises(ValueError, match="positions must be a CPU torch.int64"):
        fused(x, positions.to(torch.int32), *args, *rest)
    with pytest.raises(ValueError, match="rotary table"):
        fused(x, torch.tensor([10_000]), *args, *rest)
    with pytest.raises(ValueError, match=f"x must be contiguous \\[tokens, {HIDDEN}\\]"):
        fused(x[:, :64], positions, *args, *rest)


def _gemma(kind: str, form: str):
    """A Gemma of 4 layers (sliding ones with a 5-token window, the attention scale from
    query_pre_attn_scalar 24; Gemma 2 soft-caps at 3, so the cap bends these scores; Gemma 3's global layer
    rotates at its own base with linear scaling)."""
    from specfleet.engine.models.gemma import Gemma2Model, Gemma3Model

    extra: dict = {"attn_logit_softcapping": 3.0} if kind == "gemma2" else {}
    if kind == "gemma3":
        extra = dict(
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_theta=1e6,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        )
    config = tiny_config(
        kind,
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=4,
        head_dim=32,
        sliding_window=5,
        query_pre_attn_scalar=24,
        max_position_embeddings=128,
        **extra,
    )
    model_class = Gemma2Model if kind == "gemma2" else Gemma3Model
    return model_class(
        config,
        tiny_state(config, std=0.2),
        torch.float32,
        torch.device("cpu"),
        quantize="int8" if form == "int8" else None,
    )


def _sliding_view(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The step's view of a sliding pool (engine/model_runner.py's _sliding_meta): sequence b's blocks in
    reverse order at 1 + 4b.., its blocks wholly before the window the null block 0."""
    tables, slots = [], []
    for b, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        first = max(0, s - q + 1 - window) // BLOCK
        tables.append([0 if j < first else 1 + 4 * b + 3 - j for j in range(4)])
        slots += [tables[b][p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    slots += [-1] * (meta.slot_mapping.numel() - len(slots))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=meta.query_lens_cpu,
        seq_lens_cpu=meta.seq_lens_cpu,
        block_size=BLOCK,
        backend_state=meta.backend_state,
    )


@pytest.mark.parametrize("form", ["float32", "int8"])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
@pytest.mark.parametrize("own_pool", [False, True])
def test_gemma_layers_run_inside_the_decode_layers(kind: str, form: str, own_pool: bool) -> None:
    """Gemma's decode step in the one native call against its per-layer path (attention in
    attention/sliding_window.py, itself tested against a dense reference): the windowed, soft-capped
    attention, the post-norms, GeGLU and per-layer rotary agree to float32 rounding, and the first layer's
    KV (before any attention) is the same bit for bit. With `own_pool` the sliding layers read and write a pool of their own whose null
    block is NaN: a read of a block the window has passed would poison the output."""
    model = _gemma(kind, form)
    attn = NativeAttentionBackend()
    ids, positions, meta = _step([1, 3, 1], [5, 9, 13], padding=1)
    attn.prepare(meta)
    sliding = set(model.sliding_layer_indices())
    assert sliding and len(sliding) < len(model.layers)
    fused_caches = _caches(model)
    if own_pool:
        meta.sliding = _sliding_view(meta, window=5)
        for i in sliding:
            k, v = _caches(model)[i]
            k[0], v[0] = float("nan"), float("nan")
            fused_caches[i] = (k, v)
    layered_caches = copy.deepcopy(fused_caches)
    fused = model.forward(ids, positions, fused_caches, meta, attn)
    assert model._decode_layers(fused_caches, meta, attn) is not None, "the fused path was not taken"
    per_layer = copy.copy(model)
    per_layer._decode_layers = lambda *args: None
    layered = per_layer.forward(ids, positions, layered_caches, meta, attn)
    real = fused.shape[0] - 1
    assert torch.isfinite(fused[:real]).all()
    torch.testing.assert_close(fused[:real], layered[:real], rtol=1e-4, atol=1e-4)
    for i, ((fk, fv), (lk, lv)) in enumerate(zip(fused_caches, layered_caches, strict=True)):
        tol = 0 if i == 0 else 1e-4  # a later layer's input carries the attention's rounding
        torch.testing.assert_close(fk, lk, rtol=tol, atol=tol, equal_nan=True)
        torch.testing.assert_close(fv, lv, rtol=tol, atol=tol, equal_nan=True)


def test_gemma_decode_layers_refuse_a_bad_window_and_rope_table() -> None:
    from dataclasses import replace

    model = _gemma("gemma2", "float32")
    weights = [layer.decode_weights() for layer in model.layers]
    assert all(w is not None for w in weights)
    a = model.args
    good = [w for w in weights if w is not None]
    with pytest.raises(ValueError, match="layer 0: window must be >= 1"):
        cpu_native.DecodeLayers(
            [replace(good[0], window=0), *good[1:]], _caches(model), a.num_heads, 1e-6, 1.0
        )
    cos, sin = model.ropes["full_attention"]
    with pytest.raises(ValueError, match="rope tables must be contiguous"):
        cpu_native.DecodeLayers(
            [replace(good[0], rope=(cos[:, :16], sin[:, :16])), *good[1:]],
            _caches(model),
            a.num_heads,
            1e-6,
            1.0,
        )


@pytest.mark.parametrize("form", ["float32", "int8"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe", "qwen3moe-norm"])
def test_moe_layers_run_inside_the_decode_layers(kind: str, form: str, tmp_path) -> None:
    """Mixtral's and Qwen3-MoE's routed experts in the one native call: routing (softmax, top 2, renormalised
    or not) and the grouped experts as MoeLayer.mlp computes them. Qwen3-MoE's layer 1 is dense, with an MLP
    wider than the experts', after a sparse layer 0."""
    from specfleet.engine.models.moe import MixtralModel, Qwen3MoeModel

    arch = "mixtral" if kind == "mixtral" else "qwen3moe"
    overrides = {} if kind == "mixtral" else {"mlp_only_layers": [1], "norm_topk_prob": kind.endswith("norm")}
    config = tiny_config(arch, vocab_size=256, max_position_embeddings=128, **overrides)
    cls = MixtralModel if kind == "mixtral" else Qwen3MoeModel
    quantize = "int8" if form == "int8" else None
    # the checkpoint's tensors: transformers saves the experts one by one (in memory they are fused 3-D)
    state = load_file(write_tiny_checkpoint(tmp_path, config, std=0.2) / "model.safetensors")
    model = cls(config, state, torch.float32, torch.device("cpu"), quantize=quantize)
    # 6 decode and verification rows over 4 experts (top 2: some experts get several rows); the padding row
    # routes too
    fused, layered, fc, lc = _both_paths(model, query_lens=[1, 3, 1, 1], seq_lens=[5, 9, 13, 2], padding=1)
    real = fused.shape[0] - 1
    # the router's softmax is the native kernel's exp, not torch's: the routing weights may differ in their
    # last bit, and with them the hidden states after a sparse layer (the experts chosen are the same)
    torch.testing.assert_close(fused[:real], layered[:real], rtol=1e-5, atol=1e-6)
    for (fk, fv), (lk, lv) in zip(fc, lc, strict=True):
        torch.testing.assert_close(fk, lk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fv, lv, rtol=1e-5, atol=1e-6)
