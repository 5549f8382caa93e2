"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 with q/k/v bias, SmolLM2) over the paged KV cache.

Written for few ops per layer, since on CPU per-op overhead rivals the weights' memory traffic:
q/k/v and gate/up are fused into one matmul each, the output and down projections fold the residual
add into the matmul, and rotary embedding is two multiply-adds with a roll over q and k together.
cos/sin rows are gathered once per step and shared by every layer.

On CPU in float32, matmuls, RMSNorm and SiLU-and-multiply run on the native kernels
(kernels/cpu/native.cpp) when they build: they read each weight once per step however many rows the
step has, where sgemm pays about 3x for 5 rows. Elsewhere (CUDA, other dtypes, no compiler) the same
layer runs on torch ops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specfleet.engine.attention.base import AttentionBackend, AttentionMetadata
from specfleet.engine.errors import UnsupportedModel
from specfleet.engine.lora.adapter import ModelShape
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor, cat_rows

log = logging.getLogger("specfleet.engine.loader")


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, config) -> LlamaArgs:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position=rope_context(config)[0],
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )


def rope_context(config) -> tuple[int, str]:
    """The positions the model's RoPE runs (what its tables hold, the engine's longest max_model_len) and the
    config fields that say so. `max_position_embeddings`; for YaRN, `original_max_position_embeddings *
    factor` when that is more: the Qwen2.5 and Qwen3 model cards extend 32K to 128K by adding `rope_scaling
    {type: yarn, factor: 4, original_max_position_embeddings: 32768}` and leave max_position_embeddings at
    32768 (vLLM reads the same length). YaRN's frequencies do not depend on the length, so transformers runs
    any length with them. Linear scaling keeps max_position_embeddings (Gemma 3's already counts its factor
    of 8), and so does dynamic NTK, which transformers rescales once a sequence is past
    max_position_embeddings: one table computed here cannot follow that."""
    positions = int(config.max_position_embeddings)
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if str(params.get("rope_type", params.get("type"))) == "yarn" and params.get("factor"):
        original = int(params.get("original_max_position_embeddings") or positions)
        scaled = int(original * float(params["factor"]))
        if scaled > positions:
            return scaled, (
                f"rope_scaling yarn original_max_position_embeddings={original} x factor={params['factor']}"
            )
    return positions, f"max_position_embeddings={positions}"


def rope_init_function(config, rope_type: str) -> Callable[..., tuple[torch.Tensor, float]]:
    """transformers' builder of a non-default RoPE's inverse frequencies (linear, dynamic, yarn, longrope,
    llama3, ...). A type it has no builder for (a multimodal `mrope`, a typo) is refused at start, naming the
    config field and the supported types, not a KeyError from inside the model's constructor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModel(
            f"architecture {getattr(config, 'architectures', None)}: rope_scaling rope_type={rope_type!r} is "
            f"not supported; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}"
        )
    return ROPE_INIT_FUNCTIONS[rope_type]


def rope_tables(
    config, head_dim: int, max_position: int, context: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin tables, [max_position, head_dim], as transformers computes them. `context`:
    the engine's max_model_len; LongRoPE takes its long factors when that is past the original window
    (transformers switches once a sequence is; one table serves every sequence here, as in vLLM)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        init = rope_init_function(config, rope_type)
        hf = config.to_transformers() if hasattr(config, "to_transformers") else config  # a ModelConfig
        kwargs = {"seq_len": context} if rope_type == "longrope" and context else {}
        inv_freq, scaling = init(hf, "cpu", **kwargs)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    half = head_dim // 2
    # rotate_half(x) * sin == roll(x, half) * cat(-sin_lo, sin_hi)
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos, sin_signed


class TorchLinear:
    """``x @ weight_t (+ bias) (+ residual)`` on torch ops; weight_t is [in, out], pre-transposed."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight_t, self.bias = weight_t.contiguous(), bias

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.bias is not None:
            y = torch.addmm(self.bias, x, self.weight_t)
            return y if residual is None else y.add_(residual)
        return x @ self.weight_t if residual is None else torch.addmm(residual, x, self.weight_t)


class Ops:
    """The layer's dense ops, native on CPU float32 when the kernels build, torch ops otherwise."""

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        native: bool | None = None,
        quantize: str | None = None,
        activations: str = "int8",
    ):
        if native is None:
            native = device.type == "cpu" and dtype == torch.float32 and cpu_native.available()
        if quantize and not native and not (quantize in ("awq", "gptq") and device.type == "cuda"):
            raise ValueError(
                f"quantization={quantize!r} needs the native CPU kernels (float32 on CPU, g++ "
                "available; see the log for why they did not build)"
            )
        self.native, self.quantize, self.activations = native, quantize, activations
        self.device, self.dtype = device, dtype

    def linear(self, weight: torch.Tensor | QuantTensor, bias: torch.Tensor | None = None):
        """weight: [out, in] as checkpoints store it, or a checkpoint's quantized weight (GGUF, AWQ, GPTQ),
        which stays quantized: native kernel on CPU, Triton dequantize-matmul on CUDA."""
        if isinstance(weight, QuantTensor):
            if self.native:
                return cpu_native.QuantLinear(weight, bias, self.activations)
            if self.device.type == "cuda":
                from specfleet.kernels.quant_matmul import TritonQuantLinear

                return TritonQuantLinear(weight, bias, self.device, self.dtype)
            raise ValueError(f"{weight.fmt} weights need the native CPU kernels or CUDA")
        if self.native:
            return cpu_native.PackedLinear(
                weight.t(), bias, quantize="int8" if self.quantize == "int8" else None
            )
        return TorchLinear(weight.t(), bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.native:
            return cpu_native.rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native:
            return cpu_native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaLayer:
    def __init__(self, args: LlamaArgs, weights: Mapping[str, torch.Tensor | QuantTensor], ops: Ops):
        self.args, self.ops = args, ops
        self.input_norm = _dense(weights, "input_layernorm.weight").contiguous()
        self.post_norm = _dense(weights, "post_attention_layernorm.weight").contiguous()
        qkv_bias = None
        if args.qkv_bias:
            qkv_bias = torch.cat([_dense(weights, f"self_attn.{p}_proj.bias") for p in "qkv"], dim=0)
        self.qkv = ops.linear(cat_rows([weights[f"self_attn.{p}_proj.weight"] for p in "qkv"]), qkv_bias)
        self.o = ops.linear(weights["self_attn.o_proj.weight"], _bias(weights, "self_attn.o_proj.bias"))
        self.init_mlp(weights, ops)
        self.qk_size = (args.num_heads + args.num_kv_heads) * args.head_dim
        self.scale = args.head_dim**-0.5
        # Tensor parallelism (engine/distributed): o and down then hold a slice of their input columns, so
        # their outputs are partial sums that `reduce` adds across ranks; the residual is added once, by the
        # rank that `owns_residual`.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.owns_residual = True
        self.index = 0  # the layer's position in the model: which of a LoRA adapter's layers it adds

    def init_mlp(self, weights: Mapping[str, torch.Tensor | QuantTensor], ops: Ops) -> None:
        """The MLP's weights (a mixture-of-experts layer has its own: engine/models/moe.py)."""
        gate_up_bias = None
        if "mlp.gate_proj.bias" in weights:  # Llama's mlp_bias
            gate_up_bias = torch.cat([_dense(weights, f"mlp.{p}_proj.bias") for p in ("gate", "up")], dim=0)
        self.gate_up = ops.linear(
            cat_rows([weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]]), gate_up_bias
        )
        self.down = ops.linear(weights["mlp.down_proj.weight"], _bias(weights, "mlp.down_proj.bias"))

    def decode_weights(self) -> cpu_native.DecodeLayerWeights | None:
        """This layer for cpu_native.DecodeLayers, or None when one of its linears has no native form."""
        qkv, o, gate_up, down = (
            lin.descriptor() if isinstance(lin, cpu_native.PackedLinear | cpu_native.QuantLinear) else None
            for lin in (self.qkv, self.o, self.gate_up, self.down)
        )
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        return cpu_native.DecodeLayerWeights(qkv, o, gate_up, down, self.input_norm, self.post_norm)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:  # [tokens, heads + kv_heads, head_dim]
        """q and k before rotary: as they come out of the projection here (Qwen3 normalizes them)."""
        return qk

    def _row_parallel(self, linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return linear(x, residual=residual)
        return self.reduce(linear(x, residual=residual if self.owns_residual else None))

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, attn: AttentionBackend):
        a, ops = self.args, self.ops
        tokens = x.shape[0]
        lora = meta.lora  # the step's adapters (engine/lora/batch.py), None for a base-only step
        h = ops.rms_norm(x, self.input_norm, a.rms_norm_eps)
        qkv = self.qkv(h) if lora is None else lora.add(self.qkv(h), h, self.index, "qkv")
        qk = self.norm_qk(qkv[:, : self.qk_size].view(tokens, a.num_heads + a.num_kv_heads, a.head_dim))
        qk = torch.addcmul(qk * cos, qk.roll(a.head_dim // 2, dims=-1), sin)
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        v = qkv[:, self.qk_size :].view(tokens, a.num_kv_heads, a.head_dim)
        attn.write_kv(k, v, k_cache, v_cache, meta)
        o = attn.forward(q, k_cache, v_cache, meta, self.scale)
        o = o.reshape(tokens, -1)
        y = self._row_parallel(self.o, o, x)
        x = y if lora is None else lora.add(y, o, self.index, "o")
        return self.mlp(ops.rms_norm(x, self.post_norm, a.rms_norm_eps), x, lora)

    def mlp(self, h: torch.Tensor, x: torch.Tensor, lora) -> torch.Tensor:  # h: normed x; returns x + MLP(h)
        h = self.gate_up(h) if lora is None else lora.add(self.gate_up(h), h, self.index, "gate_up")
        act = self.ops.silu_mul(h)
        y = self._row_parallel(self.down, act, x)
        return y if lora is None else lora.add(y, act, self.index, "down")


def _bias(weights: Mapping[str, torch.Tensor | QuantTensor], name: str) -> torch.Tensor | None:
    """A projection's bias when the checkpoint has one: Llama's and Qwen3's `attention_bias` gives o_proj one
    as well as q/k/v, Llama's `mlp_bias` the MLP's three (transformers adds them; dropped, greedy tokens
    left transformers' from the first step)."""
    return _dense(weights, name) if name in weights else None


def _dense(state: Mapping[str, torch.Tensor | QuantTensor], name: str) -> torch.Tensor:
    """A weight the engine reads as a plain tensor (embeddings, norms: quantized checkpoints keep them float)."""
    w = state[name]
    if isinstance(w, QuantTensor):
        raise ValueError(
            f"{name}: expected a dense tensor, got quantized {w.fmt} (only projections may be quantized)"
        )
    return w


class LlamaModel:
    """Plain tensors, no nn.Module: weights are loaded once and never trained.

    An architecture that differs from Llama in a few places subclasses this with its own `layer_class`,
    `llama_state` (its checkpoint's tensors under Llama's names) or `rope_tables`; everything else (the
    paged KV cache, the native decode layers, tensor and pipeline parallelism) is shared."""

    layer_class: type[LlamaLayer] = LlamaLayer
    architecture = "LlamaForCausalLM"  # the name errors give (Mistral and Qwen2 share the class)
    # quantization -> why this architecture refuses it, said at start
    refused_quantization: Mapping[str, str] = {}

    @classmethod
    def llama_state(
        cls, config, state: Mapping[str, torch.Tensor | QuantTensor]
    ) -> Mapping[str, torch.Tensor | QuantTensor]:
        """The checkpoint's tensors under Llama's names and layouts; idempotent (split workers call it before
        slicing the state, then the constructor again)."""
        return state

    def rope_tables(self, config) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [positions, head_dim]."""
        return rope_tables(config, self.args.head_dim, self.args.max_position, self.max_model_len)

    def lora_shape(self) -> ModelShape:
        """What a PEFT adapter for this model is checked against and laid out by (engine/lora/adapter.py):
        the projection sizes and the modules it may name (q/k/v/o and gate/up/down here)."""
        return ModelShape.of(self.args, self.architecture)

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
        if quantize is not None and quantize in self.refused_quantization:
            raise ValueError(
                f"quantization={quantize!r} is not supported for {self.architecture}: "
                f"{self.refused_quantization[quantize]}"
            )
        self.args = args = LlamaArgs.from_hf(config)
        self.max_model_len = max_model_len or args.max_position  # the engine's context (loader.py)
        state = self.llama_state(config, state)
        self.ops = ops = Ops(dtype, device, native, quantize, activations)
        # Names without the `model.` prefix -> the state's own. The state may be lazy (a GGUF file read tensor
        # by tensor, gguf_file.GGUFState): each tensor is taken when its layer is built and dropped once the
        # layer has packed it, so loading holds the packed model plus one layer's checkpoint tensors.
        names = {k.removeprefix("model."): k for k in state}

        def take(name: str) -> torch.Tensor | QuantTensor:
            v = state[names[name]]
            return v if isinstance(v, QuantTensor) else v.to(device=device, dtype=dtype)

        embed = take("embed_tokens.weight")
        self.norm = _dense({"norm.weight": take("norm.weight")}, "norm.weight").contiguous()
        lm_head = take("lm_head.weight") if "lm_head.weight" in names else None
        if lm_head is None or (args.tie_word_embeddings and not isinstance(lm_head, QuantTensor)):
            lm_head = embed  # a quantized head of a tied model is the checkpoint's quantized embedding
        self.lm_head = ops.linear(lm_head)
        # The embedding table: dense rows, or a quantized table whose looked-up rows are dequantized per step
        # (a GGUF's Q8_0 embedding would be 4x its size in float32); a tied one is read from the head's
        # packed panels, so the model holds it once.
        self.embed: torch.Tensor | None = None if isinstance(embed, QuantTensor) else embed
        self._quant_embed: QuantTensor | None = None
        if isinstance(embed, QuantTensor) and not (
            lm_head is embed and isinstance(self.lm_head, cpu_native.QuantLinear)
        ):
            self._quant_embed = embed
        del embed, lm_head
        self.layers = []
        unread: list[str] = []
        for i in range(args.num_layers):
            prefix = f"layers.{i}."
            weights = _TakenWhenAsked([k for k in names if k.startswith(prefix)], prefix, take)
            self.layers.append(self.layer_class(args, weights, ops))
            self.layers[-1].index = i
            unread += weights.unread()
        if unread:  # a tensor the layers do not read is a computation transformers does and this does not
            log.warning(
                "event=checkpoint_tensors_unread architecture=%s count=%d first=%s: the layers do not read "
                "them, so outputs may differ from transformers'",
                self.architecture,
                len(unread),
                unread[:6],
            )
        cos, sin = self.rope_tables(config)
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.dtype, self.device = dtype, device
        self._fused: tuple[int, cpu_native.DecodeLayers | None] | None = None  # (KV cache pointer, layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        fused = self._decode_layers(kv_caches, meta, attn)
        if fused is not None:
            return self._forward_fused(fused, x, positions, meta)
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer.forward(x, cos, sin, k_cache, v_cache, meta, attn)
        return x

    def _forward_fused(
        self,
        fused: cpu_native.DecodeLayers,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x through every layer in the one native call; windowed layers (Gemma's) read and write the step's
        sliding view when the engine gives them a pool of their own (meta.sliding)."""
        sliding = getattr(meta, "sliding", None)
        return fused(
            x,
            positions,
            self.cos,
            self.sin,
            meta.slot_mapping,
            meta.block_tables,
            meta.backend_state.short_seqs,
            meta.query_start_loc,
            meta.seq_lens,
            lora=meta.lora.native_step(len(self.layers)) if getattr(meta, "lora", None) else None,
            sliding=None if sliding is None else (sliding.slot_mapping, sliding.block_tables),
        )

    def _decode_layers(self, kv_caches, meta: AttentionMetadata, attn: AttentionBackend):
        """The layers as one native call (cpu_native.DecodeLayers) for a step the native attention backend
        runs with short queries only (decode, verification), when every layer can: native kernels, no
        tensor-parallel collective, no act-order input permutation. None: the per-layer path."""
        state = getattr(meta, "backend_state", None)
        if (
            attn.name != "native"
            # a step with adapters runs fused when the native kernel adds their deltas (LoraBatch.native)
            or not getattr(getattr(meta, "lora", None), "native", True)
            or getattr(state, "longs", True)
            or getattr(state, "short_seqs", None) is None
        ):
            return None
        key = kv_caches[0][0].data_ptr() if kv_caches else 0
        cached = self._fused
        if cached is not None and cached[0] == key:
            return cached[1]
        fused = None
        layers = self.layers[: len(kv_caches)]
        if (
            self.ops.native
            and len(layers) == len(kv_caches)
            and all(layer.reduce is None for layer in layers)
        ):
            weights = [w for w in (layer.decode_weights() for layer in layers) if w is not None]
            if len(weights) == len(layers):
                a = self.args
                fused = cpu_native.DecodeLayers(
                    weights, kv_caches, a.num_heads, a.rms_norm_eps, layers[0].scale
                )
        self._fused = (key, fused)
        return fused

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.embed is not None:
            return self.embed.index_select(0, input_ids)
        if self._quant_embed is not None:
            return self._quant_embed.select_rows(input_ids).dequantize()
        assert isinstance(self.lm_head, cpu_native.QuantLinear)  # the tied quantized table (__init__)
        return self.lm_head.weight_rows(input_ids)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden] float32
        """The last hidden states as transformers' `last_hidden_state` (after the final norm): what
        pooling reads."""
        return self.ops.rms_norm(hidden, self.norm, self.args.rms_norm_eps).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return self.lm_head(self.ops.rms_norm(hidden, self.norm, self.args.rms_norm_eps)).float()


class _TakenWhenAsked(Mapping[str, "torch.Tensor | QuantTensor"]):
    """One layer's weights by their names within the layer, each taken from the model's state only when the
    layer asks for it. With a lazy state (a GGUF file: gguf_file.GGUFState decodes a tensor when it is read)
    the layer decodes and packs one fused group (q/k/v, o, gate/up, down) before it reads the next, so loading
    holds one group's decoded codes rather than a whole layer's (45M one-byte codes in a 0.8B model's layer)."""

    def __init__(self, names: list[str], prefix: str, take: Callable[[str], torch.Tensor | QuantTensor]):
        self._names = {k[len(prefix) :]: k for k in names}
        self._take = take
        self.asked: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor | QuantTensor:
        self.asked.add(name)
        return self._take(self._names[name])

    def unread(self) -> list[str]:
        """The layer's checkpoint tensors it never asked for (model-wide names, without `model.`), less
        RoPE's `inv_freq` buffers, which older Llama checkpoints carry and nothing reads (the tables are
        computed)."""
        return [
            full
            for name, full in self._names.items()
            if name not in self.asked and not name.endswith("inv_freq")
        ]

    def __contains__(self, name: object) -> bool:
        return name in self._names  # without reading the tensor

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
