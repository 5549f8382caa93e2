"""Qwen3 (q/k norms, head_dim 32 over hidden 64) and Phi-3 (fused projections, partial rotary, LongRoPE)
against transformers on tiny random-weight checkpoints, and the engine's features on both."""

from __future__ import annotations

import pytest
import torch
from gguf_oracle import reference
from helpers import tiny_config, write_tiny_checkpoint
from specfleet.engine import LLM, SamplingParams
from specfleet.kernels import cpu_native

PROMPTS = [
    [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 4, 19, 23, 88, 90, 91, 92, 93, 5000],
    [42],
    [3, 1, 4, 1, 5, 9, 2, 6],
    [11, 12, 13, 14] * 5,
]
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
LOGPROB_ATOL = 1e-3  # float32 on both sides; different matmul orders differ in the last bits only
# What each case builds: (tiny_config kind, overrides).
CASES = {
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}),  # Phi-4-mini's layout, 8 of 16 rotate
}
LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0 + i / 4 for i in range(8)],  # head_dim 16: 8 frequencies
    "long_factor": [3.0 + 2 * i for i in range(8)],
}


def _checkpoint(case: str, tmp_path_factory, bundled_path, **overrides):
    from helpers import tiny_model

    kind, extra = CASES[case]
    config = tiny_config(kind, **{**extra, **overrides})
    path = tmp_path_factory.mktemp(case)
    write_tiny_checkpoint(path, config, std=0.2, tokenizer_from=bundled_path)
    return f"file://{path}", tiny_model(config, std=0.2)


@pytest.fixture(scope="module", params=list(CASES))
def arch(request, tmp_path_factory, bundled_path):
    """(case, model URL, transformers' reference tokens and logprobs) for each case."""
    url, model = _checkpoint(request.param, tmp_path_factory, bundled_path)
    return request.param, url, *reference(model, PROMPTS, NEW)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_mixed_batch_with_preemption_and_chunked_prefill_matches_transformers(arch):
    case, url, ref_tokens, ref_logprobs = arch
    # 14 blocks of 4 slots hold two of these sequences at once (the longest needs 11): the others are
    # preempted and recomputed; a 16-token step budget splits the 19- and 20-token prompts.
    llm = LLM(model=url, block_size=4, num_kv_blocks=14, max_model_len=56, max_num_batched_tokens=16)
    outs = [r.outputs[0] for r in llm.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in outs] == ref_tokens
    for out, expected in zip(outs, ref_logprobs):
        got = [next(iter(lp.values())).logprob for lp in out.logprobs]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL)
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv_blocks_in_use() == 0
    model = llm.engine.runner.model
    if cpu_native.available():  # the decode steps ran on the fused native layers, q/k norms included
        assert model._fused is not None and model._fused[1] is not None
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)


@pytest.mark.slow
def test_prefix_cache_speculation_and_structured_output(arch, tmp_path_factory):
    case, url, ref_tokens, _ = arch
    if case == "phi3-partial-rotary":
        pytest.skip("the features run the same layer as phi3; one rotary layout is enough here")
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ngram = LLM(model=url, block_size=4, speculative_method="ngram", num_speculative_tokens=3)
    assert _tokens(ngram.generate(PROMPTS, plain)) == ref_tokens
    again = ngram.generate(PROMPTS[:1], plain)  # its full blocks are in the prefix cache now
    assert again[0].num_cached_tokens >= 16 and _tokens(again) == ref_tokens[:1]
    assert ngram.engine.stats.num_draft_tokens > 0
    choices = ["alpha", "beta", "gamma"]
    picked = ngram.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": choices})
    )
    assert picked[0].outputs[0].text in choices
    ngram.close()

    # The model as its own draft: every proposal is the target's own token.
    draft = LLM(
        model=url, block_size=4, speculative_method="draft", num_speculative_tokens=3, draft_model=url
    )
    assert _tokens(draft.generate(PROMPTS, plain)) == ref_tokens
    stats = draft.engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    draft.close()


@pytest.mark.slow
def test_int8_weights_match_transformers_over_the_same_int8_weights(arch, tmp_path_factory, bundled_path):
    """quantization='int8': every projection and the head as int8 with one max-abs scale per output row
    (activations stay float32), against transformers running those very weights dequantized."""
    if not cpu_native.available():
        pytest.skip("int8 weights run on the native CPU kernels, which did not build here")
    case, url = arch[:2]
    _, model = _checkpoint(case, tmp_path_factory, bundled_path)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
                w.copy_(torch.round(w / scale).clamp(-127, 127) * scale)
    ref_tokens, ref_logprobs = reference(model, PROMPTS, 12)
    llm = LLM(model=url, block_size=4, quantization="int8")
    assert all(layer.qkv.scale is not None for layer in llm.engine.runner.model.layers)  # int8 panels
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = [r.outputs[0] for r in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in outs] == ref_tokens
    for out, expected in zip(outs, ref_logprobs):
        got = [next(iter(lp.values())).logprob for lp in out.logprobs]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL)


@pytest.mark.slow
def test_prefill_decode_pair_equals_transformers(arch):
    from specfleet.engine.kv_transfer.pair import generate_disaggregated
    from specfleet.engine.llm_engine import Engine

    case, url, ref_tokens, _ = arch
    common = dict(model=url, block_size=4, num_kv_blocks=96, max_model_len=128)
    prefill, decode = Engine(kv_role="prefill", **common), Engine(kv_role="decode", **common)
    try:
        outs = generate_disaggregated(
            prefill, decode, PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        )
        assert _tokens(outs) == ref_tokens
        assert decode.kv_connector.stats.transfers == len(PROMPTS)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.slow
@pytest.mark.parametrize("window", ["short", "long"])
def test_longrope_factors_match_transformers(window, tmp_path_factory, bundled_path):
    """LongRoPE with an original window of 32 positions of 256: an engine whose context fits the window
    rotates with the short factors, one with a longer context with the long factors, each as transformers
    does for sequences inside, respectively past, the window."""
    url, model = _checkpoint(
        "phi3", tmp_path_factory, bundled_path, rope_scaling=LONGROPE, original_max_position_embeddings=32
    )
    if window == "short":
        prompts, new, max_model_len = [PROMPTS[0][:8], PROMPTS[2]], 20, 32  # 28 positions at most
    else:
        prompts, new, max_model_len = [PROMPTS[0] * 2, PROMPTS[3] * 2], 8, 256  # 38 and 40 positions up
    ref_tokens, ref_logprobs = reference(model, prompts, new)
    llm = LLM(model=url, block_size=4, max_model_len=max_model_len)
    outs = [
        r.outputs[0]
        for r in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0)
        )
    ]
    assert [o.token_ids for o in outs] == ref_tokens
    for out, expected in zip(outs, ref_logprobs):
        got = [next(iter(lp.values())).logprob for lp in out.logprobs]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL)


@pytest.mark.parametrize(
    ("architecture", "quantization", "reason"),
    [
        ("Phi3ForCausalLM", "awq", "fused qkv_proj and gate_up_proj"),
        ("Qwen3ForCausalLM", "gptq", "not yet checked against transformers"),
    ],
)
def test_unsupported_quantization_is_refused_naming_it_and_the_architecture(
    architecture, quantization, reason
):
    from specfleet.engine.models import model_class

    kind = "phi3" if architecture.startswith("Phi3") else "qwen3"
    cls = model_class([architecture])
    with pytest.raises(
        ValueError, match=rf"quantization='{quantization}' is not supported for {architecture}: .*{reason}"
    ):
        cls(tiny_config(kind), {}, torch.float32, torch.device("cpu"), quantize=quantization)


def test_partial_rotary_permutation_pairs_what_transformers_rotates():
    from specfleet.engine.models.phi3 import head_permutation

    perm = head_permutation(16, 8).tolist()  # rotate 0-7 (pairs i, i+4), pass 8-15
    assert sorted(perm) == list(range(16))
    for i in range(4):
        assert (perm[i], perm[i + 8]) == (i, i + 4)  # transformers' pair, at roll-by-half's distance
    assert set(perm[4:8]) | set(perm[12:16]) == set(range(8, 16))
    assert head_permutation(16, 16).tolist() == list(range(16))  # full rotary: the layout unchanged
