"""One tensor-parallel rank's llama: the rank's slice of the weights (sharding.py) in an ordinary
LlamaModel whose forward pass adds the collectives.

The rank's model is built from a copy of the Hugging Face config with the rank's head counts and vocab
shard, so LlamaModel itself (fused q/k/v, native kernels, rotary) runs unchanged on the slice; its KV
cache holds only the rank's KV heads. Activations between layers are whole on every rank.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import torch
from specfleet.engine.distributed.comm import RankGroup
from specfleet.engine.distributed.sharding import ShardPlan, plan, shard_state
from specfleet.engine.models.llama import LlamaArgs, LlamaModel


def shard_plan(hf_config, size: int, rank: int) -> ShardPlan:
    full = LlamaArgs.from_hf(hf_config)
    return plan(full.num_heads, full.num_kv_heads, full.intermediate_size, full.vocab_size, size, rank)


def rank_config(hf_config, p: ShardPlan):
    """The config of the rank's slice: its heads, MLP width and vocab shard; head_dim stays the model's."""
    full = LlamaArgs.from_hf(hf_config)
    local = copy.deepcopy(hf_config)
    local.num_attention_heads = len(p.heads)
    local.num_key_value_heads = len(p.kv_heads)
    local.intermediate_size = len(p.intermediate)
    local.vocab_size = p.vocab_shard
    local.head_dim = full.head_dim
    return local


@functools.cache
def split_class(base: type[ShardedLlama], model: type[LlamaModel]) -> type[ShardedLlama]:
    """`base` (ShardedLlama or StageLlama) over an architecture's model class: the split model's
    constructor runs the architecture's (its layer class, checkpoint names, rotary tables)."""
    if model is LlamaModel:
        return base
    return type(f"{base.__name__}[{model.__name__}]", (base, model), {})


class ShardedLlama(LlamaModel):
    """A LlamaModel over one rank's slice; `args.vocab_size` is the whole vocabulary (logits are gathered)."""

    def __init__(
        self,
        hf_config,
        state: dict,
        dtype: torch.dtype,
        device: torch.device,
        group: RankGroup,
        native: bool | None = None,
        quantize: str | None = None,
        max_model_len: int | None = None,
    ):
        self.plan = p = shard_plan(hf_config, group.tp_size, group.tp_rank)
        state = dict(self.llama_state(hf_config, state))  # Llama's names, which shard_state slices
        self.split_tensors = group.tp_size > 1  # one rank per stage: the layers run whole, no collectives
        if self.split_tensors and quantize not in (None, "int8"):
            raise ValueError(
                f"quantization={quantize!r} with tensor_parallel_size={group.tp_size}: its packed "
                "blocks are not sliced by head or MLP row; use pipeline_parallel_size to split it"
            )
        head_dim = LlamaArgs.from_hf(hf_config).head_dim
        local = shard_state(state, p, head_dim) if self.split_tensors else state
        super().__init__(
            rank_config(hf_config, p), local, dtype, device, native, quantize, max_model_len=max_model_len
        )
        self.group = group
        self.vocab_size = hf_config.vocab_size
        self.args = replace(self.args, vocab_size=self.vocab_size)  # the runner sees gathered logits
        for i, layer in enumerate(self.layers if self.split_tensors else ()):
            layer.reduce = group.all_reduce
            layer.owns_residual = group.tp_rank == 0
            if quantize == "int8" and self.ops.native:
                self._whole_int8_scales(layer, i, state, local)

    def _whole_int8_scales(self, layer, index: int, state: dict, local: dict) -> None:
        """Row-parallel o and down hold a slice of their input columns: quantized with the slice's own
        max-abs, their codes would differ from the unsplit model's; quantize them with the whole weight's
        column scales instead, so every rank holds exactly its slice of the unsplit int8 weights."""
        from specfleet.kernels.cpu_native import PackedLinear, int8_column_scale

        for attr, name in (("o", "self_attn.o_proj.weight"), ("down", "mlp.down_proj.weight")):
            key = next(k for k in (f"model.layers.{index}.{name}", f"layers.{index}.{name}") if k in state)
            whole = state[key].to(self.dtype)
            sliced = local[key].to(device=self.device, dtype=self.dtype)
            setattr(
                layer,
                attr,
                PackedLinear(sliced.t(), quantize="int8", int8_scale=int8_column_scale(whole.t())),
            )

    def describe(self) -> str:
        return (
            f"heads {self.plan.heads.start}-{self.plan.heads.stop - 1}, KV heads "
            f"{self.plan.kv_heads.start}-{self.plan.kv_heads.stop - 1}"
        )

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.split_tensors:
            return super().embed_tokens(input_ids)
        start = self.plan.vocab.start
        local = input_ids - start
        mine = (local >= 0) & (local < self.plan.vocab_shard)
        assert self.embed is not None  # a vocab-split table is dense (quantized ones are not split)
        x = self.embed.index_select(0, local.clamp(0, self.plan.vocab_shard - 1))
        x = x * mine.unsqueeze(1).to(x.dtype)  # rows of other ranks' tokens are zero before the sum
        return self.group.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.split_tensors:
            return super().logits(hidden)
        return self.group.all_gather_last(super().logits(hidden))[:, : self.vocab_size]
