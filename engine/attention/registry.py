"""The attention backends by name: `get_attention_backend(name, device, dtype)` builds the one
`EngineConfig.attention_backend` names, "auto" choosing by device and dtype.

Apart from `base.py` (the protocol and metadata every backend imports), so that the protocol does not
import its own implementations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from specfleet.engine.attention.base import AttentionBackend


def _torch(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    from specfleet.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _native(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"attention_backend='native' runs on CPU float32 only, not {device.type} {dtype}")
    from specfleet.engine.attention.native_backend import NativeAttentionBackend

    return NativeAttentionBackend()


def _triton(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    from specfleet.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


# attention_backend -> factory. A new backend is one entry here plus its name in config.ATTENTION_BACKENDS
# (a test keeps the two equal, "auto" aside).
ATTENTION_BACKENDS: dict[str, Callable[[torch.device, torch.dtype], AttentionBackend]] = {
    "torch": _torch,
    "native": _native,
    "triton": _triton,
}


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    """Triton on CUDA when it imports; on CPU the native kernels for float32 when they build; the torch
    reference everywhere else."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    if device.type == "cpu" and dtype == torch.float32:
        from specfleet.kernels import cpu_native

        if cpu_native.available():
            return "native"
    return "torch"


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    if name == "auto":
        name = _auto(device, dtype)
    factory = ATTENTION_BACKENDS.get(name)
    if factory is None:
        raise ValueError(
            f"attention_backend={name!r} is not one of 'auto', {', '.join(map(repr, ATTENTION_BACKENDS))}"
        )
    return factory(device, dtype)
