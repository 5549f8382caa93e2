"""Gemma 2 (soft-capping, alternating sliding layers) and Gemma 3 (q/k norms, local and global RoPE bases,
linear scaling on the global layers) against transformers on tiny random-weight checkpoints whose sliding
window (5 tokens) is shorter than the prompts, so the window changes the tokens; and the features Gemma
refuses, each by name."""

from __future__ import annotations

import pytest
import torch
from gguf_oracle import reference
from helpers import tiny_config, write_tiny_checkpoint
from specfleet.engine import LLM, SamplingParams

PROMPTS = [
    [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 4, 19, 23, 88, 90, 91, 92, 93, 5000],
    [42],
    [3, 1, 4, 1, 5, 9, 2, 6],
    [11, 12, 13, 14] * 5,
]
NEW = 20
LOGPROB_ATOL = 1e-3  # float32 on both sides; different matmul orders differ in the last bits only
# 4 layers of head_dim 16, a window of 5; the attention scale from query_pre_attn_scalar 24, not head_dim.
COMMON = dict(num_hidden_layers=4, head_dim=16, sliding_window=5, query_pre_attn_scalar=24)
CASES = {
    "gemma2": ("gemma2", {}),  # layers 0 and 2 sliding; soft-capping 50 (attention) and 30 (final)
    "gemma3": (
        "gemma3",
        dict(
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=1e6,  # the global layers', scaled linearly; the sliding ones rotate at base 10k
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def gemma(request, tmp_path_factory, bundled_path):
    """(case, model URL, transformers' reference tokens and logprobs) for each case."""
    from helpers import tiny_model

    kind, extra = CASES[request.param]
    config = tiny_config(kind, **COMMON, **extra)
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(path, config, std=0.2, tokenizer_from=bundled_path)
    model = tiny_model(config, std=0.2)
    tokens, logprobs = reference(model, PROMPTS, NEW)
    # The first prompt, its continuation and the prompt again: n-gram lookup then has a match to propose
    # from (the random model's own text rarely repeats).
    echo = PROMPTS[0] + tokens[0] + PROMPTS[0]
    echo_tokens, _ = reference(model, [echo], NEW)
    return request.param, f"file://{path}", tokens, logprobs, echo, echo_tokens[0]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_mixed_batch_with_preemption_and_chunked_prefill_matches_transformers(gemma):
    _, url, ref_tokens, ref_logprobs, _, _ = gemma
    # 14 blocks of 4 slots hold two of these sequences at once (the longest needs 10): the others are
    # preempted and recomputed; a 16-token step budget splits the 19- and 20-token prompts into chunks that
    # start inside the window of the chunk before.
    llm = LLM(model=url, block_size=4, num_kv_blocks=14, max_model_len=56, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = [r.outputs[0] for r in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in outs] == ref_tokens
    for out, expected in zip(outs, ref_logprobs):
        got = [next(iter(lp.values())).logprob for lp in out.logprobs]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL)
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv_blocks_in_use() == 0
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)
    llm.close()


@pytest.mark.slow
def test_prefix_cache_and_ngram_speculation_on_the_torch_backend(gemma):
    """The torch attention backend writes the cache here (the test above ran the CPU default); the prefix
    cache's blocks are read by a second request's sliding and full layers; n-gram proposals are verified
    as rows of up to k + 1 queries under the window."""
    _, url, ref_tokens, _, echo, echo_tokens = gemma
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm = LLM(
        model=url,
        block_size=4,
        attention_backend="torch",
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    assert _tokens(llm.generate([*PROMPTS, echo], plain)) == [*ref_tokens, echo_tokens]
    again = llm.generate(PROMPTS[:1], plain)  # its full blocks are in the prefix cache now
    assert again[0].num_cached_tokens >= 16 and _tokens(again) == ref_tokens[:1]
    assert llm.engine.stats.num_draft_tokens > 0
    llm.close()


@pytest.mark.slow
def test_draft_speculation_and_a_prefill_decode_pair_match_transformers(gemma):
    """The model as its own draft (every proposal accepted), and the KV of every layer sent from a prefill
    engine to a decode engine."""
    from specfleet.engine.kv_transfer.pair import generate_disaggregated
    from specfleet.engine.llm_engine import Engine

    _, url, ref_tokens, _, _, _ = gemma
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    draft = LLM(
        model=url, block_size=4, speculative_method="draft", num_speculative_tokens=3, draft_model=url
    )
    assert _tokens(draft.generate(PROMPTS, plain)) == ref_tokens
    stats = draft.engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    draft.close()
    common = dict(model=url, block_size=4, num_kv_blocks=96, max_model_len=128)
    prefill, decode = Engine(kv_role="prefill", **common), Engine(kv_role="decode", **common)
    try:
        assert _tokens(generate_disaggregated(prefill, decode, PROMPTS, plain)) == ref_tokens
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
@pytest.mark.parametrize("quantization", ["awq", "gptq"])
def test_packed_quantization_is_refused_naming_it_and_the_architecture(architecture, quantization):
    from specfleet.engine.models import model_class

    kind = "gemma2" if architecture.startswith("Gemma2") else "gemma3"
    with pytest.raises(
        ValueError, match=rf"quantization='{quantization}' is not supported for {architecture}"
    ):
        model_class([architecture])(
            tiny_config(kind, **COMMON), {}, torch.float32, torch.device("cpu"), quantize=quantization
        )


def test_tensor_and_pipeline_parallelism_are_refused_naming_the_architecture():
    from specfleet.engine.config import EngineConfig
    from specfleet.engine.loader import _check_split_support
    from specfleet.engine.models import model_class

    cls = model_class(["Gemma3ForCausalLM"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: architecture \['Gemma3ForCausalLM'\]"):
        _check_split_support(
            EngineConfig(model="x", tensor_parallel_size=2), None, cls, ["Gemma3ForCausalLM"], ("tensor", 2)
        )


def test_layer_types_follow_the_config_and_transformers_defaults():
    from specfleet.engine.models.gemma import FULL, SLIDING, layer_types

    assert layer_types(tiny_config("gemma2", **COMMON)) == [SLIDING, FULL] * 2
    six = tiny_config("gemma3", **{**COMMON, "num_hidden_layers": 6})
    assert layer_types(six) == [SLIDING] * 5 + [FULL]  # 5:1, the sixth layer global
    assert layer_types(tiny_config("gemma3", **{**COMMON, "sliding_window": None})) == [FULL] * 4


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_sliding_window_attention_equals_a_dense_reference(window, softcap, monkeypatch):
    """Decode, verification and a prefill chunk after a cached prefix in one step, over blocks in shuffled
    order, against masked attention written out in full; prefill rows in slices of 7 (LONG_ROWS)."""
    from specfleet.engine.attention import sliding_window
    from specfleet.engine.attention.base import AttentionMetadata

    monkeypatch.setattr(sliding_window, "LONG_ROWS", 7)
    torch.manual_seed(0)
    bs, heads, kv_heads, dim, scale = 4, 4, 2, 8, 0.3
    shapes = [(1, 13), (3, 10), (20, 25)]  # (query rows, context)
    blocks = torch.randperm(24).to(torch.int32)
    tables = torch.zeros(len(shapes), 8, dtype=torch.int32)
    used = 0
    for b, (_, s) in enumerate(shapes):
        n = -(-s // bs)
        tables[b, :n], used = blocks[used : used + n], used + n
    k_cache, v_cache = torch.randn(24, bs, kv_heads, dim), torch.randn(24, bs, kv_heads, dim)
    query = torch.randn(sum(q for q, _ in shapes), heads, dim)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(query.shape[0], dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1, 4, 24], dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=[q for q, _ in shapes],
        seq_lens_cpu=[s for _, s in shapes],
        block_size=bs,
    )
    got = sliding_window.attend(query, k_cache, v_cache, sliding_window.plan(meta, window), scale, softcap)
    row = 0
    for b, (q, s) in enumerate(shapes):
        slots = (tables[b].long()[:, None] * bs + torch.arange(bs)).flatten()[:s]
        k = k_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
        v = v_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
        scores = query[row : row + q].transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, q, s]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos, key = torch.arange(s - q, s)[:, None], torch.arange(s)[None, :]
        seen = (key <= pos) & ((key > pos - window) if window is not None else True)
        expected = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1)
        torch.testing.assert_close(got[row : row + q], expected, atol=1e-5, rtol=1e-5)
        row += q
