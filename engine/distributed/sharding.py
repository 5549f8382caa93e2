"""Which slice of each llama weight a tensor-parallel rank holds (Megatron-LM's split).

- column-parallel (output rows split): q/k/v by attention head, gate/up by intermediate row;
- row-parallel (input columns split): o and down; their partial sums are added by one all-reduce each;
- KV heads: split like q when there are at least as many as ranks, otherwise replicated so that each rank
  holds the one KV head its query heads read (GQA with fewer KV heads than ranks);
- vocabulary-parallel: embedding and lm_head rows split in equal shards (the last padded with zero rows),
  the lookup masked per rank and summed, the logits gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specfleet.engine.errors import UnsupportedModel


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    num_heads: int  # the model's, all ranks together
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def heads(self) -> range:
        per = self.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> range:
        if self.num_kv_heads >= self.size:
            per = self.num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        one = self.rank * self.num_kv_heads // self.size  # the KV head this rank's query heads read
        return range(one, one + 1)

    @property
    def intermediate(self) -> range:
        per = self.intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab_shard(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        """This rank's token ids (the last shard may extend past the vocabulary: padding rows)."""
        return range(self.rank * self.vocab_shard, (self.rank + 1) * self.vocab_shard)


def plan(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, size: int, rank: int
) -> ShardPlan:
    """The rank's plan; refuses, naming the numbers, a size the model's shapes cannot be split by."""
    check_size(num_heads, num_kv_heads, intermediate_size, size)
    if not 0 <= rank < size:
        raise ValueError(f"tensor_parallel_size={size}, rank={rank}: need 0 <= rank < size")
    return ShardPlan(rank, size, num_heads, num_kv_heads, intermediate_size, vocab_size)


def check_size(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """Refuse a tensor_parallel_size the model's shapes cannot be split by, naming its shapes and the sizes
    that would do. The engine asks before it starts any worker (loader.py), every rank again in `plan`."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be an integer >= 1")
    problems = _problems(num_heads, num_kv_heads, intermediate_size, size)
    if problems:
        valid = [
            n for n in range(1, num_heads + 1) if not _problems(num_heads, num_kv_heads, intermediate_size, n)
        ]
        listed = " and ".join([", ".join(problems[:-1]), problems[-1]] if len(problems) > 1 else problems)
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {listed} (the model: "
            f"{num_heads} attention heads, {num_kv_heads} KV heads, MLP width {intermediate_size}; the size "
            f"must divide all three, or be a multiple of the KV heads); use one of {', '.join(map(str, valid))}"
        )


def _problems(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> list[str]:
    problems = []
    if num_heads % size:
        problems.append(f"{num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads")
    if intermediate_size % size:
        problems.append(f"MLP width of {intermediate_size}")
    return problems


def _rows(weight: torch.Tensor, units: range, unit: int) -> torch.Tensor:
    return weight[units.start * unit : units.stop * unit]


def _vocab_rows(weight: torch.Tensor, p: ShardPlan) -> torch.Tensor:
    rows = weight[p.vocab.start : min(p.vocab.stop, p.vocab_size)]
    pad = p.vocab_shard - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows


# Biases the split does not slice yet (o/down would be added once per rank, gate/up need the MLP's rows).
ROW_PARALLEL_BIASES = tuple(f"{m}.bias" for m in ("o_proj", "gate_proj", "up_proj", "down_proj"))


def shard_state(state: dict[str, torch.Tensor], p: ShardPlan, head_dim: int) -> dict[str, torch.Tensor]:
    """The rank's slice of a llama checkpoint's tensors (names as in the checkpoint, `model.` prefix or not);
    other tensors (norms) are replicated."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        short = name.removeprefix("model.")
        if short.endswith(ROW_PARALLEL_BIASES):
            raise UnsupportedModel(
                f"tensor_parallel_size={p.size}: {name} (config.json attention_bias or mlp_bias): biases of "
                "o_proj and the MLP are not split across ranks yet; use pipeline_parallel_size instead"
            )
        if short.endswith("self_attn.q_proj.weight") or short.endswith("self_attn.q_proj.bias"):
            out[name] = _rows(w, p.heads, head_dim)
        elif any(short.endswith(f"self_attn.{x}_proj.{t}") for x in "kv" for t in ("weight", "bias")):
            out[name] = _rows(w, p.kv_heads, head_dim)
        elif short.endswith("mlp.gate_proj.weight") or short.endswith("mlp.up_proj.weight"):
            out[name] = _rows(w, p.intermediate, 1)
        elif short.endswith("self_attn.o_proj.weight"):
            out[name] = _rows(w.t(), p.heads, head_dim).t()
        elif short.endswith("mlp.down_proj.weight"):
            out[name] = _rows(w.t(), p.intermediate, 1).t()
        elif short in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, p)
        else:
            out[name] = w
    return {name: t.contiguous() for name, t in out.items()}
