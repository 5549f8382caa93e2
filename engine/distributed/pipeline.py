"""One pipeline stage's llama: a contiguous run of layers (GPipe/Megatron pipeline parallelism).

Stage 0 embeds the tokens and runs its layers, sends the hidden states to stage 1, and receives the last
stage's output, on which it computes the logits itself (it keeps the final norm and lm_head: one copy of
the head on the rank that samples, instead of a second transfer of logits). Stages after the first receive
their input from the stage before and send their output to the next (the last sends to stage 0). Each
stage's paged KV cache holds its own layers only; block ids mean the same on every stage.
"""

from __future__ import annotations

import copy

import torch
from specfleet.engine.distributed.comm import RankGroup
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


def stage_state(state: dict[str, torch.Tensor], layers: range) -> dict[str, torch.Tensor]:
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


class StageLlama(LlamaModel):
    def __init__(
        self,
        hf_config,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        group: RankGroup,
        native: bool | None = None,
    ):
        full = LlamaArgs.from_hf(hf_config)
        self.stage, self.stages = group.rank, group.size
        self.layer_range = layers = stage_layers(full.num_layers, group.size, group.rank)
        local = copy.deepcopy(hf_config)
        local.num_hidden_layers = len(layers)
        super().__init__(local, stage_state(state, layers), dtype, device, native)
        self.group = group
        if self.stage != 0:
            self.lm_head = None  # logits are computed on stage 0

    def describe(self) -> str:
        return f"layers {self.layer_range.start}-{self.layer_range.stop - 1}"

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.stage == 0:
            return super().embed_tokens(input_ids)
        like = torch.empty(input_ids.shape[0], self.args.hidden_size, dtype=self.dtype, device=self.device)
        return self.group.recv(like, self.stage - 1)

    def forward(self, input_ids, positions, kv_caches, meta, attn) -> torch.Tensor:
        x = super().forward(input_ids, positions, kv_caches, meta, attn)
        self.group.send(x, (self.stage + 1) % self.stages)
        if self.stage != 0:
            return x
        return self.group.recv(torch.empty_like(x), self.stages - 1)
