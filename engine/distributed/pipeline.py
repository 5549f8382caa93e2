"""One pipeline stage's llama: a contiguous run of layers (GPipe/Megatron pipeline parallelism).

Stage 0 embeds the tokens and runs its layers, sends the hidden states to stage 1, and later receives the
last stage's output, on which it computes the logits itself (it keeps the final norm and lm_head: one copy of
the head on the rank that samples, instead of a second transfer of logits). Stages after the first receive
their input from the stage before and send their output to the next (the last sends to stage 0). Each
stage's paged KV cache holds its own layers only; block ids mean the same on every stage. With tensor
parallelism as well, each stage is split over its own ranks like a whole model (ShardedLlama).
"""

from __future__ import annotations

import copy

import torch
from specfleet.engine.distributed.comm import RankGroup
from specfleet.engine.distributed.sharded_llama import ShardedLlama
from specfleet.engine.models.llama import LlamaArgs, LlamaModel


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The layers of `stage`: equal runs, the first `num_layers % stages` stages one layer longer."""
    if not 1 <= stages <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size={stages} must be between 1 and the model's {num_layers} layers"
        )
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (1 if stage < extra else 0))


def stage_state(state: dict, layers: range) -> dict:
    """The checkpoint's tensors a stage needs, its layers renumbered from 0 (embeddings and norms kept)."""
    out = {}
    for name, tensor in state.items():
        short = name.removeprefix("model.")
        if short.startswith("layers."):
            index, _, rest = short[len("layers.") :].partition(".")
            if int(index) in layers:
                out[f"layers.{int(index) - layers.start}.{rest}"] = tensor
        else:
            out[name] = tensor
    return out


class StageLlama(ShardedLlama):
    """A stage's run of layers; with tensor parallelism too, the rank's slice of them (ShardedLlama: its
    collectives run among the stage's ranks)."""

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
        full = LlamaArgs.from_hf(hf_config)
        self.stage, self.stages = group.stage, group.stages
        self.layer_range = layers = stage_layers(full.num_layers, group.stages, group.stage)
        local = copy.deepcopy(hf_config)
        local.num_hidden_layers = len(layers)
        state = dict(self.llama_state(hf_config, state))  # Llama's names, which stage_state renumbers
        super().__init__(
            local,
            stage_state(state, layers),
            dtype,
            device,
            group,
            native,
            quantize,
            max_model_len=max_model_len,
        )
        if self.stage != 0:
            self.lm_head = None  # logits are computed on stage 0

    def describe(self) -> str:
        where = f"layers {self.layer_range.start}-{self.layer_range.stop - 1}"
        return f"{where}, {super().describe()}" if self.split_tensors else where

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.stage == 0:
            return super().embed_tokens(input_ids)
        like = torch.empty(input_ids.shape[0], self.args.hidden_size, dtype=self.dtype, device=self.device)
        return self.group.recv(like, self.group.peer(self.stage - 1))

    def forward(self, input_ids, positions, kv_caches, meta, attn) -> torch.Tensor:
        x = self.launch(input_ids, positions, kv_caches, meta, attn)
        return self.collect(x.shape[0]) if self.group.rank == 0 else x

    def launch(self, input_ids, positions, kv_caches, meta, attn) -> torch.Tensor:
        """Run this stage's layers on a micro-batch and send the result on without waiting for the next
        stage to take it: stage 0 can then run its layers on the next micro-batch while the later stages
        work on this one (the pipeline's overlap). The last stage's tensor-parallel ranks hold the same
        activations: its rank 0 alone sends them back to rank 0."""
        x = LlamaModel.forward(self, input_ids, positions, kv_caches, meta, attn)
        if self.stage + 1 < self.stages:
            self.group.isend(x, self.group.peer(self.stage + 1))
        elif self.group.tp_rank == 0:
            self.group.isend(x, 0)
        return x

    def collect(self, num_tokens: int) -> torch.Tensor:
        """Rank 0: the last stage's output for the oldest micro-batch launched and not yet collected
        (point-to-point messages between two ranks arrive in the order they were sent)."""
        like = torch.empty(num_tokens, self.args.hidden_size, dtype=self.dtype, device=self.device)
        return self.group.recv(like, self.group.peer(self.stages - 1, 0))
