"""kernels/huge_pages.py: the packed weights' memory is zeroed, aligned to 2 MiB, advised onto transparent
huge pages over its whole 2 MiB pages only, and lives as long as the tensor; packing is unchanged.

Whether the OS then backs the range with huge pages depends on its THP mode and free memory, so the
tests read the advice (the mapping's `hg` VmFlag in /proc/self/smaps), which is deterministic, not
AnonHugePages."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from specfleet.kernels.cpu_dense import pack_panels
from specfleet.kernels.huge_pages import HUGE_PAGE, huge_page_zeros

SMAPS = Path("/proc/self/smaps")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address`, read from /proc/self/smaps."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps")
def test_whole_huge_pages_are_advised_and_the_tail_is_not() -> None:
    t = huge_page_zeros((3, 1 << 20), torch.float32)  # 12 MiB: six whole huge pages
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    assert "hg" in _vm_flags(t.data_ptr()) and "hg" in _vm_flags(t.data_ptr() + 12 * (1 << 20) - 1)
    odd = huge_page_zeros((HUGE_PAGE + 4096,), torch.int8)  # one whole page and a 4 KiB tail
    assert "hg" in _vm_flags(odd.data_ptr())
    assert "hg" not in _vm_flags(odd.data_ptr() + HUGE_PAGE)


def test_small_tensors_are_torch_zeros_and_big_ones_outlive_their_mapping_object() -> None:
    small = huge_page_zeros((4, 8), torch.float16)
    assert small.shape == (4, 8) and small.dtype == torch.float16 and not small.any()
    big = huge_page_zeros((HUGE_PAGE // 4,), torch.float32)
    gc.collect()  # only the tensor refers to the mmap now
    big.fill_(3.0)
    assert big.sum().item() == 3.0 * big.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_pack_panels_on_huge_pages_is_the_plain_panel_layout(dtype: torch.dtype) -> None:
    weight_t = (torch.randn(512, 3000) * 50).to(dtype)  # 94 panels, the last one padded with zeros
    panels = pack_panels(weight_t)
    padded = torch.zeros(512, 94 * 32, dtype=dtype)
    padded[:, :3000] = weight_t
    assert torch.equal(panels, padded.view(512, 94, 32).transpose(0, 1).contiguous())
    assert panels.dtype == dtype and panels.is_contiguous()
