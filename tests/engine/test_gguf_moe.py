"""Qwen3-MoE and Mixtral GGUF files written by llama.cpp's own convert_hf_to_gguf.py from tiny random
checkpoints (tests/gguf_oracle.py): the engine reads the router (ffn_gate_inp) and the stacked expert tensors
(ffn_{gate,up,down}_exps), one expert at a time, quantized like the dense projections
(engine/quant/gguf_file.py), in f32 and the converter's q8_0.

Qwen3-MoE is checked against transformers' GGUF loader. Its checkpoint renormalises the top-k weights
(norm_topk_prob, as every released Qwen3-MoE): the file does not record it, and llama.cpp always
renormalises. transformers' GGUF loader does not read Mixtral, which the converter writes as a ``llama``
file with an expert count (gguf-py has no mixtral architecture to map), so Mixtral is checked against
transformers on the checkpoint's float32 weights: exactly for f32; for q8_0, the engine's tokens scored by
transformers within Q8_0's rounding."""

from __future__ import annotations

import pytest
import torch
from gguf_oracle import (
    PROMPTS,
    VOCAB,
    convert,
    converter_source,
    engine,
    float_model,
    reference,
    scored,
    transformers_gguf,
    write_checkpoint,
)
from helpers import tiny_config
from specfleet.kernels import cpu_native

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build"),
]
# f32 and q8_0 against transformers' GGUF loader: as test_gguf_qwen3_phi3.py.
LOGPROB_ATOL = {"f32": 1e-3, "q8_0": 2e-3}
# Mixtral's q8_0 against the float weights: Q8_0 rounds each weight by up to half a step of max|w| / 127 per
# 32 values, which can turn a near-tie into another greedy token (it does on these prompts),
# so the engine's own tokens are scored by transformers (teacher forcing): each within MIXTRAL_Q8_ATOL of
# transformers' log-probability for it, and of transformers' best token there. On these prompts the gaps
# were at most 0.008 and 0.009: the bound is about five times the larger.
MIXTRAL_Q8_ATOL = 5e-2
# kind -> (overrides, tokenizer): Qwen3-MoE's converter reads only a BPE tokenizer.json (the bundled one)
CASES = {
    "qwen3moe": (dict(norm_topk_prob=True), "bundled"),
    "mixtral": (dict(vocab_size=VOCAB), "sentencepiece"),
}


@pytest.fixture(scope="module", params=[(kind, t) for kind in CASES for t in ("f32", "q8_0")], ids=str)
def converted(request, tmp_path_factory, bundled_path):
    """(kind, outtype, the engine's tokens and logprobs, the oracle model)."""
    kind, outtype = request.param
    converter_source()  # skip (or fail under CI) before building anything
    overrides, tokenizer = CASES[kind]
    config = tiny_config(kind, **overrides)
    folder = tmp_path_factory.mktemp(f"{kind}-{outtype}")
    gguf = convert(write_checkpoint(folder / "hf", config, bundled_path, tokenizer), folder, outtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECFLEET_CACHE", str(folder / "cache"))
        got = engine(gguf)
    oracle = float_model(config) if kind == "mixtral" else transformers_gguf(gguf, config)
    return kind, outtype, got, oracle


def test_converted_gguf_matches_the_oracle(converted):
    kind, outtype, (tokens, logprobs), oracle = converted
    if (kind, outtype) == ("mixtral", "q8_0"):
        given, best = scored(oracle, PROMPTS, tokens)
        for got, theirs, top in zip(logprobs, given, best):
            assert torch.allclose(torch.tensor(got), torch.tensor(theirs), atol=MIXTRAL_Q8_ATOL)
            assert (torch.tensor(top) - torch.tensor(theirs)).max() <= MIXTRAL_Q8_ATOL
        return
    ref_tokens, ref_logprobs = reference(oracle)
    assert tokens == ref_tokens
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)  # the prompts lead to different text
    for got, expected in zip(logprobs, ref_logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL[outtype])
