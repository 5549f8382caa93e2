"""Qwen3 and Phi-3 GGUF files written by llama.cpp's own convert_hf_to_gguf.py from tiny random checkpoints
(tests/gguf_oracle.py): the engine reads them with ``quantization="gguf"`` (Qwen3's attn_q_norm/attn_k_norm;
Phi-3's fused attn_qkv and gate/up ffn_up, split by whole rows of blocks; its partial rotary and
LongRoPE factors from the file's metadata and rope_factors tensors) and writes transformers' GGUF
loader's greedy tokens with its log-probabilities, in f32 and in the converter's own q8_0."""

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
# f32: the same float32 weights on both sides, only the matmul orders differ. q8_0: the engine's Q8_0 kernel
# with float32 activations against transformers' dequantized weights, the same products summed in blocks.
LOGPROB_ATOL = {"f32": 1e-3, "q8_0": 2e-3}
# name -> (tiny_config kind, overrides, LLM options)
CASES = {
    "qwen3": ("qwen3", {}, {}),
    "phi3": ("phi3", dict(pad_token_id=0), {}),  # Phi3Config's default pad id, 32000, is past VOCAB
    # Phi-4-mini's partial rotary with LongRoPE: the converter writes the factors as rope_factors_long/short
    # tensors and the rotated width as rope.dimension_count. Every sequence here fits the original window,
    # where transformers rotates with the short factors, and so does the engine when its context does.
    "phi3-longrope": (
        "phi3",
        dict(
            partial_rotary_factor=0.5,  # 8 of head_dim 16 rotate: 4 frequencies
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 2.5],
                "long_factor": [3.0, 5.0, 7.0, 9.0],
            },
            original_max_position_embeddings=64,
            pad_token_id=0,
        ),
        dict(max_model_len=64),
    ),
}


@pytest.fixture(scope="module", params=[(case, t) for case in CASES for t in ("f32", "q8_0")], ids=str)
def converted(request, tmp_path_factory, bundled_path):
    """(outtype, the engine's tokens and logprobs, transformers' GGUF tokens and logprobs)."""
    case, outtype = request.param
    converter_source()  # skip (or fail under CI) before building anything
    kind, overrides, options = CASES[case]
    config = tiny_config(kind, vocab_size=VOCAB, **overrides)
    folder = tmp_path_factory.mktemp(f"{case}-{outtype}")
    gguf = convert(write_checkpoint(folder / "hf", config, bundled_path), folder, outtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECFLEET_CACHE", str(folder / "cache"))
        got = engine(gguf, **options)
    return outtype, got, reference(transformers_gguf(gguf, config))


def test_converted_gguf_matches_transformers_gguf_loader(converted):
    outtype, (tokens, logprobs), (ref_tokens, ref_logprobs) = converted
    assert tokens == ref_tokens
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)  # the prompts lead to different text
    for got, expected in zip(logprobs, ref_logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL[outtype])
