"""TritonAttentionBackend vs TorchAttentionBackend over whole steps: write the step's K/V, then attend."""

from __future__ import annotations

import pytest
import torch
from specfleet.bench.gpu.paged_cases import TOLERANCE, make_case
from specfleet.engine.attention.registry import get_attention_backend
from specfleet.engine.attention.torch_backend import TorchAttentionBackend
from specfleet.engine.attention.triton_backend import TritonAttentionBackend

STEPS = {
    "decode": ([1, 1, 1, 1], [1, 7, 33, 129]),
    "verify": ([5, 3, 5], [40, 7, 129]),
    "mixed": ([33, 1, 5, 7], [129, 40, 33, 7]),
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_matches_torch_backend(step: str, dtype: torch.dtype) -> None:
    query_lens, seq_lens = STEPS[step]
    case = make_case(query_lens, seq_lens, 9, 3, 64, 16, dtype, share_prefix=True, seed=len(step))
    gen = torch.Generator().manual_seed(2)
    num_tokens = sum(query_lens)
    key = torch.randn((num_tokens, 3, 64), generator=gen).to(dtype)
    value = torch.randn((num_tokens, 3, 64), generator=gen).to(dtype)
    meta_torch, meta_triton = case.metadata(), case.metadata()
    if step == "mixed":  # a padding row: slot -1 is skipped by both
        meta_torch.slot_mapping[3] = meta_triton.slot_mapping[3] = -1
    outputs, caches = [], []
    for backend, meta in ((TorchAttentionBackend(), meta_torch), (TritonAttentionBackend(), meta_triton)):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.prepare(meta)
        backend.write_kv(key, value, k_cache, v_cache, meta)
        outputs.append(backend.forward(case.query, k_cache, v_cache, meta, case.scale))
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outputs[1].float(), outputs[0].float(), **TOLERANCE[dtype])


def test_prepare_picks_the_kernel_per_step() -> None:
    backend = TritonAttentionBackend()
    for step, decode in (("decode", True), ("verify", True), ("mixed", False)):
        meta = make_case(*STEPS[step], 4, 4, 64, 16, torch.float32).metadata()
        backend.prepare(meta)
        assert meta.backend_state.decode is decode, step


def test_forward_without_prepare_says_so() -> None:
    case = make_case([1], [7], 4, 4, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="before prepare"):
        TritonAttentionBackend().forward(case.query, case.k_cache, case.v_cache, case.metadata(), case.scale)


def test_get_attention_backend_names_it() -> None:
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"
    assert get_attention_backend("auto", torch.device("cpu"), torch.bfloat16).name == "torch"
