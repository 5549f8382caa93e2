"""What every kernel wrapper shares: argument checks and picking the compiled or interpreted kernel.

On CUDA a wrapper launches the compiled ``@triton.jit`` kernel. On CPU tensors it launches the same kernel
through Triton's interpreter, whether or not ``TRITON_INTERPRET=1`` was set before the kernel module was
imported: the interpreted twin is built here from the kernel's Python function. That keeps the CPU tests
independent of import order (another test may import triton before the kernels' conftest runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_interpreted: dict[int, _InterpretedLaunch] = {}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@contextmanager
def _interpretable_language() -> Iterator[None]:
    """Swap ``triton.language``'s own jit helpers (tl.zeros, tl.max, ...) for interpreted twins.

    When triton was imported without TRITON_INTERPRET=1 those helpers are compiled-only JITFunctions that
    refuse to be called from Python; the interpreter needs them callable. Restored on exit.
    """
    swapped = {}
    for name in dir(tl):
        value = getattr(tl, name)
        if isinstance(value, JITFunction):
            swapped[name] = value
            setattr(tl, name, InterpretedFunction(value.fn))
    try:
        yield
    finally:
        for name, value in swapped.items():
            setattr(tl, name, value)


class _InterpretedLaunch:
    """``kernel[grid](...)`` through Triton's interpreter, on CPU tensors."""

    def __init__(self, kernel: Any) -> None:
        self._fn = InterpretedFunction(kernel.fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            with _interpretable_language():
                self._fn[grid](*args, **kwargs)

        return launch


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """The launchable form of ``kernel`` for tensors on ``device``: ``kernel_for(k, dev)[grid](...)``."""
    if device.type == "cuda":
        return kernel
    if device.type != "cpu":
        raise ValueError(
            f"device={device} is not supported: Triton kernels run on cuda (or cpu, interpreted)"
        )
    # An InterpretedFunction too (its module was imported with TRITON_INTERPRET=1, triton itself without):
    # triton.language's helpers are then compiled-only, so its launches need the swap as well.
    key = id(kernel)
    if key not in _interpreted:
        _interpreted[key] = _InterpretedLaunch(kernel)
    return _interpreted[key]


def is_interpreted(device: torch.device) -> bool:
    return device.type != "cuda"


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    device: torch.device,
    dtypes: Sequence[torch.dtype],
    ndim: int,
    contiguous: bool = False,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise ValueError naming the argument, the wrong value and what was expected."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other arguments")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}.dtype={t.dtype} is not one of {tuple(dtypes)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}), expected {ndim}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} with strides {t.stride()} must be contiguous")
    if last_dim_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}.stride(-1)={t.stride(-1)} must be 1")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}.shape={tuple(t.shape)} does not match the expected {tuple(expected)}")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
