"""End to end: the engine gives the same greedy tokens with Triton attention (interpreted on CPU) as with the
torch reference backend, through prefill, chunked prefill and decode.

The model is a 2-layer llama with the bundled model's attention shape (head dim 64, three query heads per KV
head) and the bundled tokenizer, random weights: what is under test is the engine around the kernels (block
tables, a chunk over a cached prefix beside a decode row, the KV writes) and the two backends' agreement,
which do not depend on the depth or the weights; the interpreter runs each kernel once a layer, so the bundled
model's 30 layers took 15 times as long (65 s in CI). The kernels themselves are checked against references
at that shape in test_paged_prefill.py and test_paged_decode.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_config, write_tiny_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a list of the eight planets of the solar system, in order from the Sun outwards, with one "
    "short fact about each of them, written for a curious child who loves rockets, telescopes and maps "
    "of the night sky, and who asks a new question every evening before bed: Mercury is the smallest, "
    "Venus is the hottest, Earth",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, bundled_path: Path) -> str:
    # 3 query heads over 1 KV head of 64: the bundled model's 9 over 3, as one group
    config = tiny_config(
        "llama",
        hidden_size=192,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("llama-gqa3")
    return f"file://{write_tiny_checkpoint(folder, config, std=0.2, tokenizer_from=bundled_path)}"


def _greedy(model: str, backend: str, **engine_args) -> list[list[int]]:
    from specfleet.engine import LLM, SamplingParams

    llm = LLM(model=model, attention_backend=backend, device="cpu", **engine_args)
    # ignore_eos: a random model may end early, and every prompt must reach its decode steps
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_triton_backend_matches_torch_backend_greedy(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
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
    expected = _greedy(model, "torch")
    assert all(len(t) == 4 for t in expected), expected

    assert _greedy(model, "triton", max_num_batched_tokens=32) == expected
    chunk_after_prefix = [
        (q, s) for q, s in prefill_calls if any(ql < sl for ql, sl in zip(q, s, strict=True))
    ]
    assert chunk_after_prefix, f"no prefill chunk ran over a cached prefix: {prefill_calls[:2]}"
