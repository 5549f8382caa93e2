"""End to end: the engine on the bundled model gives the same greedy tokens with Triton attention
(interpreted on CPU) as with the torch reference backend, through prefill, chunked prefill and decode."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a list of the eight planets of the solar system, in order from the Sun outwards, with one "
    "short fact about each of them, written for a curious child who loves rockets, telescopes and maps "
    "of the night sky, and who asks a new question every evening before bed: Mercury is the smallest, "
    "Venus is the hottest, Earth",
]


def _greedy(backend: str, **engine_args) -> list[list[int]]:
    from specfleet.engine import LLM, SamplingParams

    llm = LLM(model="bundled://smollm2-135m-instruct", attention_backend=backend, device="cpu", **engine_args)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_triton_backend_matches_torch_backend_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 32-token budget makes the engine run: a fresh prefill (short prompt + the long prompt's first
    chunk), the long prompt's next chunk over its cached prefix beside a decode row, then decode steps;
    so both Triton attention kernels and the KV write run inside the engine."""
    from specfleet.engine.attention import triton_backend

    prefill_calls: list[tuple[list[int], list[int]]] = []
    real_prefill = triton_backend.paged_prefill_attention

    def recording_prefill(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, *args, **kw):
        starts = query_start_loc.tolist()
        prefill_calls.append(([b - a for a, b in zip(starts, starts[1:], strict=False)], seq_lens.tolist()))
        return real_prefill(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, *args, **kw)

    monkeypatch.setattr(triton_backend, "paged_prefill_attention", recording_prefill)
    expected = _greedy("torch")
    assert all(len(t) == 4 for t in expected), expected

    assert _greedy("triton", max_num_batched_tokens=32) == expected
    chunk_after_prefix = [
        (q, s) for q, s in prefill_calls if any(ql < sl for ql, sl in zip(q, s, strict=True))
    ]
    assert chunk_after_prefix, f"no prefill chunk ran over a cached prefix: {prefill_calls[:2]}"
