"""Giving the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

glibc keeps freed heap memory resident: a chunk freed below live ones, or below its trim threshold, stays in
the process's RSS until a later allocation reuses it. Loading a model allocates and frees a lot of such
memory (the tokenizer's parse, each layer's decode temporaries), so the loaders call `release_free_memory`
at the points where those temporaries are gone.
"""

from __future__ import annotations

import ctypes


def release_free_memory() -> None:
    """Return every free page of the C heap to the system; a no-op where the C library is not glibc."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()
