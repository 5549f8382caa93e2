"""Mixtral and Qwen3-MoE (8 experts, top 2) against transformers on tiny random-weight checkpoints: greedy
tokens and log-probabilities in a mixed batch with preemption and chunked prefill, n-gram speculation,
int8 expert weights, and the features these architectures refuse by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import tiny_model, write_tiny_checkpoint
from specfleet.engine import LLM, SamplingParams
from specfleet.kernels import cpu_native

PROMPTS = [
    [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 4, 19, 23, 88, 90, 91, 92, 93, 5000],
    [42],
    [3, 1, 4, 1, 5, 9, 2, 6],
    [11, 12, 13, 14] * 5,
]
NEW = 16
LOGPROB_ATOL = 1e-3  # float32 on both sides; different matmul orders differ in the last bits only
COMMON = dict(
    vocab_size=49152,  # the bundled tokenizer's
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
)


def moe_config(kind: str) -> transformers.PretrainedConfig:
    """Mixtral: 2 layers of 8 experts. Qwen3-MoE: 3 layers, the middle one dense (mlp_only_layers), the
    top-2 probabilities renormalised (norm_topk_prob) so both routings are exercised."""
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=8, sliding_window=None,
            architectures=["MixtralForCausalLM"],
        )  # fmt: skip
    return transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=3, head_dim=32,
        num_experts=8, norm_topk_prob=kind == "qwen3moe-norm", mlp_only_layers=[1],
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip


def _reference(model, prompts, new: int = NEW) -> tuple[list[list[int]], list[list[float]]]:
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            chosen = out.sequences[0, len(ids) :]
            logits = torch.cat(out.logits).float().log_softmax(-1)
            tokens.append(chosen.tolist())
            logprobs.append(logits.gather(1, chosen[:, None])[:, 0].tolist())
    return tokens, logprobs


@pytest.fixture(scope="module", params=["mixtral", "qwen3moe", "qwen3moe-norm"])
def arch(request, tmp_path_factory, bundled_path):
    config = moe_config(request.param)
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), config, std=0.2, tokenizer_from=bundled_path
    )
    model = tiny_model(config, std=0.2)
    return request.param, f"file://{path}", model, *_reference(model, PROMPTS)


def _check(outs, ref_tokens, ref_logprobs) -> None:
    assert [o.token_ids for o in outs] == ref_tokens
    for out, expected in zip(outs, ref_logprobs):
        got = [next(iter(lp.values())).logprob for lp in out.logprobs]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=LOGPROB_ATOL)


@pytest.mark.slow
def test_mixed_batch_with_preemption_and_ngram_speculation_match_transformers(arch):
    kind, url, _, ref_tokens, ref_logprobs = arch
    # 14 blocks of 4 slots hold two sequences at once: the others are preempted and recomputed; a 16-token
    # step budget splits the 19- and 20-token prompts.
    llm = LLM(model=url, block_size=4, num_kv_blocks=14, max_model_len=40, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    _check([r.outputs[0] for r in llm.generate(PROMPTS, params)], ref_tokens, ref_logprobs)
    assert llm.engine.stats.num_preemptions > 0 and llm.engine.kv_blocks_in_use() == 0
    model = llm.engine.runner.model
    sparse = [i for i, layer in enumerate(model.layers) if layer.router is not None]
    assert sparse == ([0, 1] if kind == "mixtral" else [0, 2])  # Qwen3-MoE's layer 1 is dense
    llm.close()
    ngram = LLM(model=url, block_size=4, speculative_method="ngram", num_speculative_tokens=3)
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert [r.outputs[0].token_ids for r in ngram.generate(PROMPTS, plain)] == ref_tokens
    assert ngram.engine.stats.num_draft_tokens > 0
    ngram.close()


@pytest.mark.slow
def test_int8_experts_match_transformers_over_the_same_int8_weights(arch):
    """quantization='int8': every projection, each expert's included, as int8 with one max-abs scale per
    output row (the router stays float), against transformers running those weights dequantized."""
    if not cpu_native.available():
        pytest.skip("int8 weights run on the native CPU kernels, which did not build here")
    kind, url, model = arch[:3]
    if kind == "qwen3moe-norm":
        pytest.skip("the same expert layers as qwen3moe")

    def rows_int8(w: torch.Tensor) -> None:  # per output row: the last dim is the input
        scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        w.copy_(torch.round(w / scale).clamp(-127, 127) * scale)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight", "lm_head.weight", "experts.gate_up_proj", "experts.down_proj")):
                rows_int8(p)
    ref_tokens, ref_logprobs = _reference(model, PROMPTS, 8)
    llm = LLM(model=url, block_size=4, quantization="int8")
    layer = llm.engine.runner.model.layers[0]
    assert all(e.gate_up.scale is not None and e.down.scale is not None for e in layer.experts)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    _check([r.outputs[0] for r in llm.generate(PROMPTS, params)], ref_tokens, ref_logprobs)
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 2}, "experts are not split across ranks yet"),
    ],
)
def test_unsupported_features_are_refused_by_name(arch, options, message):
    kind, url = arch[:2]
    if kind != "mixtral":
        pytest.skip("the refusals are the MoE models' shared class attributes")
    with pytest.raises(ValueError, match=message):
        LLM(model=url, block_size=4, **options)


@pytest.mark.parametrize(("kind", "quantization"), [("mixtral", "gptq"), ("qwen3moe", "awq")])
def test_unsupported_quantization_is_refused_naming_it_and_the_architecture(kind, quantization):
    from specfleet.engine.models import model_class

    config = moe_config(kind)
    with pytest.raises(
        ValueError, match=rf"quantization='{quantization}' is not supported for {config.architectures[0]}"
    ):
        model_class(config.architectures)(
            config, {}, torch.float32, torch.device("cpu"), quantize=quantization
        )
