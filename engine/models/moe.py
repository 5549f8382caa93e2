"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE, Llama's attention with a routed expert MLP.

The router picks `top_k` of `num_experts` SwiGLU experts per token (kernels/moe_reference.route: softmax in
float32, top k, renormalised always in Mixtral, when `norm_topk_prob` in Qwen3-MoE); the experts then run
as grouped GEMMs, one matmul per expert over the rows routed to it (CPU: the native packed kernels per
expert, so int8 and GGUF expert weights come for free; CUDA: the Triton fused-MoE kernel over stacked
weights). A GGUF file's stacked `ffn_*_exps` are read one expert at a time (engine/quant/gguf_file.py).
Qwen3-MoE keeps a dense MLP on its `mlp_only_layers` and on layers off its `decoder_sparse_step`.
A CPU decode step runs every layer, routing and experts included, in the one native call of the fused decode
layers (cpu_native.DecodeLayers, MoeLayer.decode_weights): the same router linear, expert kernels and
summation order as `MoeLayer.mlp`, only the router's softmax is the native kernel's own exp (its weights may
differ from torch's in the last bit).

LoRA adapters add to the attention projections (q/k/v/o, Llama's maths). An adapter on the MLP is refused
when it loads, naming the module: transformers 5 keeps the experts as fused 3-D parameters, which PEFT
targets only as `target_parameters` (it turns MLP names into those, the dense layers' MLP included), and
the experts do not add deltas here yet.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
from specfleet.engine.lora.adapter import ATTENTION_TARGETS, ModelShape
from specfleet.engine.models.llama import LlamaLayer, LlamaModel, Ops, _dense
from specfleet.engine.models.qwen3 import Qwen3Layer
from specfleet.kernels import cpu_native
from specfleet.kernels.moe_reference import grouped_experts, route
from specfleet.kernels.quantized import QuantTensor, cat_rows

_ROUTER = "mlp.gate.weight"


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    renormalize: bool  # divide the top-k probabilities by their sum
    sparse_layers: frozenset[int]  # the layers whose MLP is the experts

    @classmethod
    def from_hf(cls, config) -> Routing:
        num_experts: int = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0)
        top_k = config.num_experts_per_tok
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts ({num_experts})")
        if config.model_type == "mixtral":
            return cls(num_experts, top_k, True, frozenset(range(config.num_hidden_layers)))
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = {i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0}
        return cls(num_experts, top_k, bool(getattr(config, "norm_topk_prob", False)), frozenset(sparse))


class _Expert:
    """One SwiGLU expert on the layer's ops: [rows, hidden] -> [rows, hidden]."""

    def __init__(self, ops: Ops, gate_up, down):
        self.ops, self.gate_up, self.down = ops, gate_up, down

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.silu_mul(self.gate_up(rows)))


class MoeLayer(LlamaLayer):
    routing: Routing  # MoeModel gives each model a subclass that carries its config's routing

    def init_mlp(self, weights: Mapping[str, torch.Tensor | QuantTensor], ops: Ops) -> None:
        self.router: torch.Tensor | None = None
        if _ROUTER not in weights:  # a dense layer of Qwen3-MoE
            super().init_mlp(weights, ops)
            return
        self.router = _dense(weights, _ROUTER).t().contiguous()  # [hidden, experts]
        n = self.routing.num_experts
        if self.router.shape[1] != n:
            raise ValueError(f"{_ROUTER}: {self.router.shape[1]} experts, the config says {n}")
        # On the native kernels the router is a float32 packed linear (never quantized), shared with the
        # fused decode layers so both paths route from the same logits.
        self.native_router = cpu_native.PackedLinear(self.router) if ops.native else None
        names = [[f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")] for e in range(n)]
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        if ops.device.type == "cuda" and not ops.quantize:  # the Triton kernel reads stacked weights
            gate_up = torch.stack([torch.cat([_dense(weights, g), _dense(weights, u)]) for g, u, _ in names])
            self.stacked = gate_up.contiguous(), torch.stack([_dense(weights, d) for *_, d in names])
            return
        self.experts = [
            _Expert(ops, ops.linear(cat_rows([weights[g], weights[u]])), ops.linear(weights[d]))
            for g, u, d in names
        ]

    def decode_weights(self) -> cpu_native.DecodeLayerWeights | None:
        """The layer with its experts for the native decode layers (sf_decode_layers runs the routing and
        the grouped experts as mlp below does), or None when a linear has no native form."""
        if self.router is None:
            return super().decode_weights()
        if self.native_router is None or getattr(self, "experts", None) is None:
            return None
        qkv, o = (
            lin.descriptor() if isinstance(lin, cpu_native.PackedLinear | cpu_native.QuantLinear) else None
            for lin in (self.qkv, self.o)
        )
        experts: list[tuple[cpu_native.LinearDesc, cpu_native.LinearDesc]] = []
        for expert in self.experts:
            gate_up, down = (
                lin.descriptor()
                if isinstance(lin, cpu_native.PackedLinear | cpu_native.QuantLinear)
                else None
                for lin in (expert.gate_up, expert.down)
            )
            if gate_up is None or down is None:
                return None
            experts.append((gate_up, down))
        if qkv is None or o is None:
            return None
        return cpu_native.DecodeLayerWeights(
            qkv,
            o,
            experts[0][0],
            experts[0][1],
            self.input_norm,
            self.post_norm,
            experts=tuple(experts),
            router=self.native_router.descriptor(),
            top_k=self.routing.top_k,
            renormalize=self.routing.renormalize,
        )

    def mlp(self, h: torch.Tensor, x: torch.Tensor, lora) -> torch.Tensor:
        if self.router is None:
            return super().mlp(h, x, lora)
        logits = h @ self.router if self.native_router is None else self.native_router(h)
        weights, ids = route(logits, self.routing.top_k, self.routing.renormalize)
        if self.stacked is not None:
            from specfleet.kernels.fused_moe import fused_moe

            return x + fused_moe(h, *self.stacked, weights, ids)
        return x + grouped_experts(h, weights, ids, self.experts)


class Qwen3MoeLayer(MoeLayer, Qwen3Layer):
    """Qwen3's q/k norms (Qwen3Layer.norm_qk) with the expert MLP."""

    def decode_weights(self) -> cpu_native.DecodeLayerWeights | None:
        weights = MoeLayer.decode_weights(self)  # a dense layer's already has the norms (Qwen3Layer's)
        return None if weights is None else replace(weights, q_norm=self.q_norm, k_norm=self.k_norm)


class _Renamed(Mapping[str, "torch.Tensor | QuantTensor"]):
    """Mixtral's checkpoint under Qwen3-MoE's expert names, each tensor read only when asked (the state may
    be lazy): block_sparse_moe.gate -> mlp.gate, experts.E.w1/w3/w2 -> experts.E.gate/up/down_proj."""

    _PARTS = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

    def __init__(self, state: Mapping[str, torch.Tensor | QuantTensor]):
        self._state = state
        self._names = {self._rename(k): k for k in state}

    @classmethod
    def _rename(cls, name: str) -> str:
        if "block_sparse_moe." not in name:
            return name
        for old, new in cls._PARTS.items():
            name = name.replace(old, new)
        return name

    def __getitem__(self, name: str) -> torch.Tensor | QuantTensor:
        return self._state[self._names[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


_NOT_CHECKED = "not yet checked against transformers on expert weights; use quantization='int8'"


class MixtralModel(LlamaModel):
    layer_class: type[LlamaLayer] = MoeLayer
    architecture = "MixtralForCausalLM"
    refused_quantization = {"awq": _NOT_CHECKED, "gptq": _NOT_CHECKED}
    split_refused = "experts are not split across ranks yet"  # tensor and pipeline parallelism

    @classmethod
    def llama_state(cls, config, state):
        return state if isinstance(state, _Renamed) else _Renamed(state)

    def lora_shape(self) -> ModelShape:
        """Adapters on the attention only (the module's docstring says why)."""
        return ModelShape.of(self.args, self.architecture, targets=ATTENTION_TARGETS, mlp_refused=True)

    def __init__(self, config, state, dtype, device, native=None, quantize=None, activations="int8", **kw):
        routing = Routing.from_hf(config)
        self.layer_class = type(self.layer_class.__name__, (self.layer_class,), {"routing": routing})
        super().__init__(config, state, dtype, device, native, quantize, activations, **kw)
        found = {i for i, layer in enumerate(self.layers) if getattr(layer, "router", None) is not None}
        if found != routing.sparse_layers:
            raise ValueError(
                f"the checkpoint has experts in layers {sorted(found)}, but the config "
                f"(mlp_only_layers, decoder_sparse_step) puts them in {sorted(routing.sparse_layers)}"
            )


class Qwen3MoeModel(MixtralModel):
    layer_class = Qwen3MoeLayer
    architecture = "Qwen3MoeForCausalLM"
