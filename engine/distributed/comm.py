"""The process group of a split model: torch.distributed over gloo (CPU) or NCCL (CUDA).

Only the communication of the forward pass runs here (tensor parallelism: an all-reduce after each
row-parallel matmul and the embedding lookup, an all-gather of the logits; pipeline parallelism: the hidden
states sent from stage to stage). Step commands travel over pipes (workers.py), so an idle
engine never sits in a collective that could time out.
"""

from __future__ import annotations

import datetime
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits longer than this means a peer is gone or stuck: raise rather than hang. One
# step's collective takes milliseconds; the margin covers a first step that builds native kernels.
COLLECTIVE_TIMEOUT_S = 120.0
# Sends a rank leaves in flight before it waits for the oldest: a pipeline of P stages has at most P
# micro-batches in flight, each with one send per rank; the margin keeps a fast stage from ever waiting on
# a send it could have left running.
MAX_PENDING_SENDS = 16


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    size: int  # all ranks: tensor_parallel_size x pipeline_parallel_size
    backend: str  # "gloo" | "nccl"
    tensor_parallel_size: int = 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class RankGroup:
    """This process's membership of the group and what the split models need: the two collectives of
    tensor parallelism (within the rank's stage), point-to-point sends between pipeline stages.

    Rank r is tensor-parallel rank `r % tp` of stage `r // tp`: the ranks of a stage are consecutive, and a
    stage's tensor-parallel rank t sends its activations to rank t of the next stage."""

    def __init__(self, address: GroupAddress, rank: int):
        self.rank, self.size = rank, address.size
        self.tp_size = address.tensor_parallel_size
        if self.tp_size < 1 or address.size % self.tp_size:
            raise ValueError(
                f"{address.size} ranks cannot hold stages of tensor_parallel_size={self.tp_size}"
            )
        self.stages = address.size // self.tp_size
        self.stage, self.tp_rank = divmod(rank, self.tp_size)
        dist.init_process_group(
            address.backend,
            init_method=f"tcp://{address.host}:{address.port}",
            rank=rank,
            world_size=address.size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self._tp_group = None  # the whole world when there is one stage
        if self.stages > 1 and self.tp_size > 1:
            for stage in range(self.stages):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(stage * self.tp_size, (stage + 1) * self.tp_size)))
                if stage == self.stage:
                    self._tp_group = group
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def peer(self, stage: int, tp_rank: int | None = None) -> int:
        """The global rank of `tp_rank` (default: this rank's) in `stage`."""
        return stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self._tp_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every tensor-parallel rank's `x` along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self._tp_group)
        return torch.cat(parts, dim=-1)

    def send(self, x: torch.Tensor, to: int) -> None:
        dist.send(x.contiguous(), dst=to)

    def isend(self, x: torch.Tensor, to: int) -> None:
        """Send without waiting for the receiver to take it (gloo hands the data over only once the peer
        posts its receive). The tensor and its request are kept until then; the oldest sends are waited
        for once more than MAX_PENDING_SENDS are outstanding, and all at close."""
        x = x.contiguous()
        work = dist.isend(x, dst=to)
        assert work is not None  # None only for a rank outside the default group; ours are all in it
        self._pending.append((work, x))
        while len(self._pending) > MAX_PENDING_SENDS:
            self._pending.popleft()[0].wait()

    def recv(self, like: torch.Tensor, source: int) -> torch.Tensor:
        dist.recv(like, src=source)
        return like

    def close(self) -> None:
        self._pending.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
