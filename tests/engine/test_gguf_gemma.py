"""Gemma 2 and Gemma 3 GGUF files written by llama.cpp's own convert_hf_to_gguf.py from tiny random
checkpoints (tests/gguf_oracle.py): the converter stores every norm as 1 + w and the engine reads w back
(engine/quant/gguf_file.py), maps the four norms per layer and the q/k norms, and takes the soft-caps,
window and sliding layers' RoPE base from the file's metadata (engine/quant/gguf_source.py); it writes
transformers' GGUF loader's greedy tokens with its log-probabilities, in f32 and the converter's q8_0.

A GGUF file does not carry Gemma's query_pre_attn_scalar or layer pattern: the checkpoints keep
transformers' defaults for them (256; Gemma 2 alternating, Gemma 3 five sliding layers to one full), which
is what a reader of the file, transformers' or the engine, assumes. The window (5 tokens) is short enough
that the sliding layers drop keys in every prompt that is longer. Gemma 2's converter drops lm_head (Gemma 2
ties it to the embedding), so that checkpoint is tied."""

from __future__ import annotations

import pytest
import torch
from gguf_oracle import (
    VOCAB,
    convert,
    converter_source,
    engine,
    reference,
    transformers_gguf,
    write_checkpoint,
)
from helpers import tiny_config
from specfleet.kernels import cpu_native

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_native.available(), reason="native kernels did not build"),
]
LOGPROB_ATOL = {"f32": 1e-3, "q8_0": 2e-3}  # as test_gguf_qwen3_phi3.py
# (tiny_config kind, overrides): both with the tests' own sentencepiece tokenizer (gguf_oracle.VOCAB)
CASES = {
    "gemma2": ("gemma2", dict(num_hidden_layers=4, tie_word_embeddings=True)),
    "gemma3": ("gemma3", dict(num_hidden_layers=6)),
}
COMMON = dict(head_dim=16, sliding_window=5, vocab_size=VOCAB)


@pytest.fixture(scope="module", params=[(case, t) for case in CASES for t in ("f32", "q8_0")], ids=str)
def converted(request, tmp_path_factory, bundled_path):
    """(outtype, the engine's tokens and logprobs, transformers' GGUF tokens and logprobs)."""
    case, outtype = request.param
    converter_source()  # skip (or fail under CI) before building anything
    kind, overrides = CASES[case]
    config = tiny_config(kind, **COMMON, **overrides)
    folder = tmp_path_factory.mktemp(f"{case}-{outtype}")
    gguf = convert(write_checkpoint(folder / "hf", config, bundled_path), folder, outtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECFLEET_CACHE", str(folder / "cache"))
        got = engine(gguf)
    return outtype, got, reference(transformers_gguf(gguf, config))


def test_converted_gguf_matches_transformers_gguf_loader(converted):
    outtype, (tokens, logprobs), (ref_tokens, ref_logprobs) = converted
    assert tokens == ref_tokens
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)  # the prompts lead to different text
    for got, expected in zip(logprobs, ref_logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL[outtype])
