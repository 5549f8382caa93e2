"""Tensor parallelism: one model copy split over several processes (ranks), as Megatron-LM and vLLM do.

`sharding.py` says which slice of each weight a rank holds (pure Python over tensors, no processes);
`sharded_llama.py` is the llama model of one rank, with the collectives in its forward pass; `comm.py`
is the process group (torch.distributed: gloo on CPU, NCCL on CUDA); `workers.py` starts one process per
rank after the first and gives the engine a model it calls as if it were a single one. See
docs/architecture.md, "Tensor parallelism".

`WorkerDied` lives here, not in `workers.py`, so that the engine core can tell it apart without loading
torch.distributed and multiprocessing in an engine that does not split its model.
"""

from __future__ import annotations

__all__ = ["WorkerDied"]


class WorkerDied(RuntimeError):
    """A rank of a split model is gone (or never came up): the message names the rank and its exit code.

    Fatal for the engine: the model cannot take another step, so the engine core exits (and the server
    with it, non-zero) instead of failing the step's requests and serving on."""
