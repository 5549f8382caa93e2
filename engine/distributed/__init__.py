"""Tensor parallelism: one model copy split over several processes (ranks), as Megatron-LM and vLLM do.

`sharding.py` says which slice of each weight a rank holds (pure Python over tensors, no processes);
`sharded_llama.py` is the llama model of one rank, with the collectives in its forward pass; `comm.py`
is the process group (torch.distributed: gloo on CPU, NCCL on CUDA); `workers.py` starts one process per
rank after the first and gives the engine a model it calls as if it were a single one. See
docs/architecture.md, "Tensor parallelism".
"""
