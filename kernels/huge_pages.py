"""Zeroed tensors backed by transparent huge pages, for the packed weights the native kernels stream.

A decode step reads every packed weight once, front to back. With 4 KiB pages each 4 KiB of weight costs a
TLB miss and a page walk, which the kernels' arithmetic does not hide when the rows per weight are few: at 32
rows a Mixtral layer (8 experts, top 2, hidden 512, expert MLP 1536) runs each expert over ~8 rows and
streams 75 MB of experts, four times the bytes of the dense model of the same active parameters. On the
2-core EPYC host (docs/results/2026-12-06-bench-architectures.md) eight such layers' experts took 32 ms of
CPU per 32-row step on 4 KiB pages and 27 ms on 2 MiB pages; the dense twin's MLPs 24.5 and 23.2 ms.

The host's THP mode is usually ``madvise``: only ranges marked MADV_HUGEPAGE get huge pages. torch's
allocator marks nothing (unless THP_MEM_ALLOC_ENABLE is set before its first allocation), so
`huge_page_zeros` maps its own anonymous memory, 2 MiB aligned, marks the whole 2 MiB pages the tensor
covers (its tail stays on small pages: no page is rounded up) before anything touches them, and hands
the tensor a view of it; the tensor keeps the mapping alive. Where the OS refuses the advice (no THP) the
memory is the same, on small pages.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page; smaller tensors gain nothing from the advice


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zeroed tensor, its whole 2 MiB pages advised onto transparent huge pages; tensors under
    2 MiB come from torch.zeros."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # private anonymous memory: zero-filled, untouched until written (a shared mapping would be shmem,
    # which follows shmem_enabled, not the THP mode)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf for as long as any view lives
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: small pages, same contents
        pass
    return raw[start : start + nbytes].view(dtype).view(shape)
