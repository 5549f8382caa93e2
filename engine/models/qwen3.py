"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and k head before rotary, and no q/k/v bias.

head_dim comes from the config and may differ from hidden / heads (Qwen3-0.6B: 16 heads of 128 over a
hidden size of 1024), which LlamaArgs already reads. On the native decode path the two norms are one
extra step of sf_decode_layers (kernels/cpu/native.cpp) between the q/k/v projection and rotary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from specfleet.engine.models.llama import LlamaArgs, LlamaLayer, LlamaModel, Ops, _dense
from specfleet.kernels import cpu_native
from specfleet.kernels.quantized import QuantTensor


class Qwen3Layer(LlamaLayer):
    def __init__(self, args: LlamaArgs, weights: Mapping[str, torch.Tensor | QuantTensor], ops: Ops):
        super().__init__(args, weights, ops)
        self.q_norm = _dense(weights, "self_attn.q_norm.weight").contiguous()  # [head_dim]
        self.k_norm = _dense(weights, "self_attn.k_norm.weight").contiguous()

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:  # [tokens, heads + kv_heads, head_dim]
        a, tokens = self.args, qk.shape[0]
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]  # strided views into the q/k/v rows
        q = self.ops.rms_norm(q.reshape(-1, a.head_dim).contiguous(), self.q_norm, a.rms_norm_eps)
        k = self.ops.rms_norm(k.reshape(-1, a.head_dim).contiguous(), self.k_norm, a.rms_norm_eps)
        return torch.cat((q.view(tokens, a.num_heads, a.head_dim), k.view(tokens, -1, a.head_dim)), dim=1)

    def decode_weights(self) -> cpu_native.DecodeLayerWeights | None:
        weights = super().decode_weights()
        return None if weights is None else replace(weights, q_norm=self.q_norm, k_norm=self.k_norm)


class Qwen3Model(LlamaModel):
    layer_class = Qwen3Layer
    architecture = "Qwen3ForCausalLM"
    refused_quantization = dict.fromkeys(
        ("awq", "gptq"),
        "not yet checked against transformers on this architecture; serve the float checkpoint, "
        "with quantization='int8' for 8-bit weights",
    )
