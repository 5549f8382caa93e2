"""The process group of a split model: torch.distributed over gloo (CPU) or NCCL (CUDA).

Only the communication of the forward pass runs here (tensor parallelism: an all-reduce after each
row-parallel matmul and the embedding lookup, an all-gather of the logits; pipeline parallelism: the hidden
states sent from stage to stage). Step commands travel over pipes (workers.py), so an idle
engine never sits in a collective that could time out.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits longer than this means a peer is gone or stuck: raise rather than hang. One
# step's collective takes milliseconds; the margin covers a first step that builds native kernels.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    size: int
    backend: str  # "gloo" | "nccl"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class RankGroup:
    """This process's membership of the group: rank, size, and what the split models need: the two
    collectives of tensor parallelism, point-to-point sends between pipeline stages."""

    def __init__(self, address: GroupAddress, rank: int):
        self.rank, self.size = rank, address.size
        dist.init_process_group(
            address.backend,
            init_method=f"tcp://{address.host}:{address.port}",
            rank=rank,
            world_size=address.size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def send(self, x: torch.Tensor, to: int) -> None:
        dist.send(x.contiguous(), dst=to)

    def recv(self, like: torch.Tensor, source: int) -> torch.Tensor:
        dist.recv(like, src=source)
        return like

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
