"""Readers that turn quantized checkpoints (GGUF blocks, AWQ, GPTQ) into `QuantTensor`s the kernels run."""
