"""Gemma 2 and Gemma 3 text models (Gemma2ForCausalLM, Gemma3ForCausalLM) over the paged KV cache.

What differs from Llama, each as transformers computes it:
- embeddings scaled by sqrt(hidden_size), the factor rounded to the model's dtype;
- RMSNorm by `(1 + w)`: the one is added to every norm weight at load, so the norms run Llama's kernel;
- four norms per layer: before and after attention, before and after the MLP (the post norms apply to the
  sub-layer's output before the residual add);
- GeGLU: tanh-approximated GELU of the gate times up;
- attention scaled by `query_pre_attn_scalar ** -0.5`, not head_dim's;
- Gemma 2: attention logits and final logits soft-capped, cap * tanh(x / cap) (on the native CPU backend
  in sf_decode_layers' attention and sf_softcap_f32, tanh as 1 - 2 / (exp(2z) + 1), 16 lanes at a time);
- Gemma 3: an RMSNorm over each q and k head before rotary (q_norm, k_norm, also `(1 + w)`);
- per-layer sliding-window or full attention from the config's `layer_types` (Gemma 2 alternates, Gemma 3
  has five sliding layers per full one); Gemma 3's sliding layers rotate with their own base
  (`rope_local_base_freq`, 10k) and its full layers with `rope_theta` and the config's RoPE scaling.

A decode step on the native CPU backend runs every layer in one native call (cpu_native.DecodeLayers, as
Llama's do): the feed-forward norms, GeGLU, each layer's rotary tables, window and soft-cap are steps of
sf_decode_layers (kernels/cpu/native.cpp), whose attention reads the paged cache in place from the first
block inside the window. Other steps (prefill chunks, other backends) attend in attention/sliding_window.py:
each sliding layer reads only the keys inside its window.
The engine gives the sliding layers a KV pool of their own that keeps only each sequence's window
(engine/block_manager.py: blocks older than it are freed after every step) and these layers read and write
it through `meta.sliding`; the full layers keep the whole sequence.
Refused at start: AWQ/GPTQ checkpoints, tensor and pipeline parallelism (the loader and the engine name
them). A GGUF file's norms are stored by llama.cpp's converter as `1 + w`; the reader gives back `w`
(engine/quant/gguf_file.py) and the one is added here as for a Hugging Face checkpoint.

LoRA adapters add to q/k/v, o and gate/up/down as in Llama (LlamaLayer's maths): each delta joins its
projection's output, before the post-norms and the GeGLU that follow the projection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.nn.functional as F
from specfleet.engine.attention import sliding_window
from specfleet.engine.attention.base import AttentionBackend, AttentionMetadata
from specfleet.engine.models.llama import LlamaArgs, LlamaLayer, LlamaModel, Ops, _dense, rope_init_function
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor

SLIDING, FULL = "sliding_attention", "full_attention"
_NOT_CHECKED = (
    "not yet checked against transformers on this architecture; serve the float checkpoint, "
    "with quantization='int8' for 8-bit weights"
)


def layer_types(config) -> list[str]:
    """Each layer's attention: the config's `layer_types`, else transformers' defaults (Gemma 2: even layers
    sliding; Gemma 3: every `sliding_window_pattern`-th layer full)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = getattr(config, "sliding_window_pattern", None) or (
            6 if str(config.model_type).startswith("gemma3") else 2
        )
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must list {n} entries of {SLIDING!r} or {FULL!r}, got {list(types)!r}")
    if getattr(config, "sliding_window", None) is None:
        return [FULL] * n
    return list(types)


def _tables(inv_freq: torch.Tensor, scaling: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin, as llama.rope_tables lays them out."""
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    half = inv_freq.numel()
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def rope_tables_for(config, layer_type: str, head_dim: int, positions: int):
    """The rotary tables of one kind of layer: Gemma 3 keys `rope_parameters` by layer type, Gemma 2 has one."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    nested = layer_type in params
    own = dict(params[layer_type] if nested else params)
    rope_type = str(own.get("rope_type", own.get("type", "default")))
    if rope_type == "default":
        theta = own.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return _tables(inv_freq, 1.0, positions)
    hf = config.to_transformers() if hasattr(config, "to_transformers") else config
    kwargs = {"layer_type": layer_type} if nested else {}
    inv_freq, scaling = rope_init_function(config, rope_type)(hf, "cpu", **kwargs)
    return _tables(inv_freq, scaling, positions)


class GemmaLayer(LlamaLayer):
    def __init__(self, args: LlamaArgs, weights: Mapping[str, torch.Tensor | QuantTensor], ops: Ops):
        super().__init__(args, weights, ops)
        one = lambda name: (1.0 + _dense(weights, name).float()).to(ops.dtype).contiguous()  # noqa: E731
        self.input_norm = one("input_layernorm.weight")
        self.post_norm = one("post_attention_layernorm.weight")  # on the attention's output
        self.pre_ff_norm = one("pre_feedforward_layernorm.weight")
        self.post_ff_norm = one("post_feedforward_layernorm.weight")
        # Set by GemmaModel from the config: this layer's attention kind, window, scale and cap.
        self.kind: str = FULL
        self.window: int | None = None
        self.softcap: float | None = None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # its kind's cos/sin tables (float32 CPU)

    def decode_weights(self) -> cpu_native.DecodeLayerWeights | None:
        """This layer for the native decode layers: Llama's linears and norms plus the feed-forward norms,
        GeGLU, its own rotary tables, window and soft-cap (and Gemma 3's q/k norms)."""
        weights = super().decode_weights()
        if weights is None:
            return None
        return replace(
            weights,
            pre_ff_norm=self.pre_ff_norm,
            post_ff_norm=self.post_ff_norm,
            rope=self.rope,
            gelu=True,
            window=self.window,
            softcap=self.softcap,
            q_norm=getattr(self, "q_norm", None),
            k_norm=getattr(self, "k_norm", None),
        )

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, attn: AttentionBackend):
        if self.window is not None and meta.sliding is not None:
            meta = meta.sliding  # this layer's cache is the sliding pool (engine/block_manager.py)
        step = sliding_window.plan(meta, self.window)
        return self.forward_planned(x, cos, sin, k_cache, v_cache, meta, attn, step)

    def forward_planned(self, x, cos, sin, k_cache, v_cache, meta, attn, step: sliding_window.WindowPlan):
        """forward with the step's plan for this layer's window, which the model shares across layers."""
        a, ops, tokens = self.args, self.ops, x.shape[0]
        lora = meta.lora  # the step's adapters (engine/lora/batch.py), None for a base-only step
        h = ops.rms_norm(x, self.input_norm, a.rms_norm_eps)
        qkv = self.qkv(h) if lora is None else lora.add(self.qkv(h), h, self.index, "qkv")
        qk = self.norm_qk(qkv[:, : self.qk_size].view(tokens, a.num_heads + a.num_kv_heads, a.head_dim))
        qk = torch.addcmul(qk * cos, qk.roll(a.head_dim // 2, dims=-1), sin)
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        v = qkv[:, self.qk_size :].view(tokens, a.num_kv_heads, a.head_dim)
        attn.write_kv(k, v, k_cache, v_cache, meta)
        o = sliding_window.attend(q, k_cache, v_cache, step, self.scale, self.softcap).reshape(tokens, -1)
        y = self.o(o) if lora is None else lora.add(self.o(o), o, self.index, "o")
        x = x + ops.rms_norm(y, self.post_norm, a.rms_norm_eps)
        h = ops.rms_norm(x, self.pre_ff_norm, a.rms_norm_eps)
        gate_up = self.gate_up(h) if lora is None else lora.add(self.gate_up(h), h, self.index, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        y = self.down(act) if lora is None else lora.add(self.down(act), act, self.index, "down")
        return x + ops.rms_norm(y, self.post_ff_norm, a.rms_norm_eps)


class Gemma3Layer(GemmaLayer):
    def __init__(self, args: LlamaArgs, weights: Mapping[str, torch.Tensor | QuantTensor], ops: Ops):
        super().__init__(args, weights, ops)
        one = lambda name: (1.0 + _dense(weights, name).float()).to(ops.dtype).contiguous()  # noqa: E731
        self.q_norm, self.k_norm = one("self_attn.q_norm.weight"), one("self_attn.k_norm.weight")

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:  # [tokens, heads + kv_heads, head_dim]
        a, tokens = self.args, qk.shape[0]
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        q = self.ops.rms_norm(q.reshape(-1, a.head_dim).contiguous(), self.q_norm, a.rms_norm_eps)
        k = self.ops.rms_norm(k.reshape(-1, a.head_dim).contiguous(), self.k_norm, a.rms_norm_eps)
        return torch.cat((q.view(tokens, a.num_heads, a.head_dim), k.view(tokens, -1, a.head_dim)), dim=1)


class Gemma2Model(LlamaModel):
    layer_class: type[LlamaLayer] = GemmaLayer
    architecture = "Gemma2ForCausalLM"
    refused_quantization = {"awq": _NOT_CHECKED, "gptq": _NOT_CHECKED}
    split_refused = "its layers are not split yet"  # tensor and pipeline parallelism
    has_sliding_window = True  # the loader keeps the model's whole context (no clamp to the window)
    attn_softcap = True  # Gemma 2 soft-caps attention logits; Gemma 3 does not (transformers ignores it)

    def __init__(
        self,
        config,
        state: Mapping[str, torch.Tensor | QuantTensor],
        dtype: torch.dtype,
        device: torch.device,
        native: bool | None = None,
        quantize: str | None = None,
        activations: str = "int8",
        max_model_len: int | None = None,
    ):
        super().__init__(config, state, dtype, device, native, quantize, activations, max_model_len)
        a, types = self.args, layer_types(config)
        self.window: int | None = getattr(config, "sliding_window", None)
        softcap = getattr(config, "attn_logit_softcapping", None) if self.attn_softcap else None
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        scale = float(getattr(config, "query_pre_attn_scalar", None) or a.head_dim) ** -0.5
        self.gemma_layers: list[GemmaLayer] = [
            layer for layer in self.layers if isinstance(layer, GemmaLayer)
        ]
        for layer, kind in zip(self.gemma_layers, types):
            layer.kind, layer.window, layer.softcap, layer.scale = kind, None, softcap, scale
            if kind == SLIDING:
                layer.window = self.window
        self.ropes = {}
        for kind in set(types):
            cos, sin = rope_tables_for(config, kind, a.head_dim, a.max_position)
            self.ropes[kind] = (
                cos.to(device=device, dtype=dtype).contiguous(),
                sin.to(device=device, dtype=dtype).contiguous(),
            )
        for layer in self.gemma_layers:
            layer.rope = self.ropes[layer.kind]  # for the native decode layers (GemmaLayer.decode_weights)
        # transformers multiplies by sqrt(hidden) rounded to the activations' dtype
        self.normalizer = torch.tensor(a.hidden_size**0.5, dtype=dtype, device=device)
        self.norm = (1.0 + self.norm.float()).to(dtype).contiguous()

    def rope_tables(self, config) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables_for(config, FULL, self.args.head_dim, self.args.max_position)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, attn: AttentionBackend):
        x = self.embed_tokens(input_ids)
        fused = self._decode_layers(kv_caches, meta, attn)  # a decode step: every layer in one native call
        if fused is not None:
            return self._forward_fused(fused, x, positions, meta)
        layers = self.gemma_layers[: len(kv_caches)]
        # a sliding layer whose cache keeps only its window reads and writes the sliding pool's tables
        metas = {
            w: meta if w is None or meta.sliding is None else meta.sliding
            for w in {la.window for la in layers}
        }
        steps = {w: sliding_window.plan(m, w) for w, m in metas.items()}
        rows = {
            kind: (cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1))
            for kind, (cos, sin) in self.ropes.items()
        }
        for layer, (k_cache, v_cache) in zip(layers, kv_caches):
            cos, sin = rows[layer.kind]
            w = layer.window
            x = layer.forward_planned(x, cos, sin, k_cache, v_cache, metas[w], attn, steps[w])
        return x

    def sliding_layer_indices(self) -> list[int]:
        """The layers that attend within a window: with a window shorter than the context, the engine gives
        them a KV pool that keeps only the window (engine/block_manager.py)."""
        return [i for i, layer in enumerate(self.gemma_layers) if layer.window is not None]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.normalizer

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        if self.final_softcap is None:
            return logits
        if self.ops.native and logits.is_contiguous():
            # in place, one vectorised pass (the logits are this call's own): at c32 x 49k torch's three passes
            # and two temporaries took ~5 of a decode step's ~48 CPU ms (hidden 512, 8 layers, one thread)
            return cpu_native.softcap_(logits, self.final_softcap)
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3Model(Gemma2Model):
    layer_class = Gemma3Layer
    architecture = "Gemma3ForCausalLM"
    attn_softcap = False
