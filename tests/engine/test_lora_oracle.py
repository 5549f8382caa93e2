"""LoRA: the engine's greedy tokens for each adapter, in batches that mix four adapters and the base, equal
transformers + PEFT's `merge_and_unload()` for that adapter; prefix-cache blocks never cross adapters (nor
a reload under the same name); speculation stays exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TOKENIZER_FILES, tiny_config, write_tiny_checkpoint
from lora_helpers import merged_greedy, save_random_adapter
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.errors import ParameterError

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
# Four adapters that together cover every projection, ranks from 4 to the limit, rsLoRA's scale and
# targets on a fused projection's middle piece (k) alone. lora_alpha at 4r: deltas large enough that each
# adapter's greedy tokens leave the base's (checked below, so the oracle cannot pass on the base alone).
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=16,
        lora_alpha=64,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]),
    "k-up": dict(r=64, lora_alpha=256, target_modules=["k_proj", "up_proj"]),
}
PROMPTS = [
    [1, 450, 7483, 310, 3444, 338, 263, 4192, 310],
    [1, 3439, 17332, 2501, 263, 931, 29892, 727, 471, 263, 2217, 2343, 1058, 10600],
    [1, 8948, 2211],
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _base_path(uri: str) -> str:
    return uri.removeprefix("file://")


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(_base_path(tiny_llama), dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_random_adapter(base, root / name, seed=seed, **lora)
        for seed, (name, lora) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def references(tiny_llama: str, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    path = _base_path(tiny_llama)
    refs: dict[str | None, list[list[int]]] = {None: merged_greedy(path, None, PROMPTS, NEW_TOKENS)}
    for name, folder in adapters.items():
        refs[name] = merged_greedy(path, folder, PROMPTS, NEW_TOKENS)
    return refs


def _lora_llm(tiny_llama: str, adapters: dict[str, Path], **kwargs) -> LLM:
    settings = {"block_size": 4, "max_model_len": 128, "enable_lora": True, "max_loras": 4, **kwargs}
    llm = LLM(model=tiny_llama, **settings)
    for name, folder in adapters.items():
        llm.engine.load_lora_adapter(name, str(folder))
    return llm


def _tokens(results) -> list[list[int]]:
    return [list(r.outputs[0].token_ids) for r in results]


def test_adapters_change_the_output(references):
    for name in ADAPTERS:
        assert references[name] != references[None], f"adapter {name} leaves the base's tokens unchanged"


def test_mixed_batch_equals_peft_merged(tiny_llama, adapters, references):
    llm = _lora_llm(tiny_llama, adapters)
    runner = llm.engine.runner
    seen: list[set[str | None]] = []
    prepare = runner.prepare

    def spy(items):
        inputs = prepare(items)
        seen.append({item.seq.lora.name if item.seq.lora else None for item in items})
        return inputs

    runner.prepare = spy
    names: list[str | None] = [None, *ADAPTERS]
    jobs = [(name, p) for p in PROMPTS for name in names]
    results = llm.generate([p for _, p in jobs], GREEDY, lora_name=[n for n, _ in jobs])
    for (name, prompt), tokens in zip(jobs, _tokens(results)):
        assert tokens == references[name][PROMPTS.index(prompt)], f"adapter {name} on prompt {prompt}"
    assert any(s == set(names) for s in seen), "no step mixed the four adapters and the base"


def test_max_loras_caps_the_adapters_of_a_step(tiny_llama, adapters, references):
    llm = _lora_llm(tiny_llama, adapters, max_loras=2)
    runner = llm.engine.runner
    widest = 0
    prepare = runner.prepare

    def spy(items):
        nonlocal widest
        widest = max(widest, len({item.seq.lora for item in items if item.seq.lora is not None}))
        return prepare(items)

    runner.prepare = spy
    names = list(ADAPTERS)
    results = llm.generate([PROMPTS[0]] * len(names), GREEDY, lora_name=names)
    assert _tokens(results) == [references[n][0] for n in names]
    assert widest == 2


def test_decode_steps_run_fused_with_and_without_adapters(tiny_llama, adapters, references):
    """The fused decode layers add the adapters' deltas with the same native kernel as the per-layer path
    (and the tokens stay PEFT's, checked here on the fused steps' output)."""
    llm = _lora_llm(tiny_llama, adapters)
    if llm.engine.runner.attn.name != "native":
        pytest.skip("the native decode path needs the native CPU kernels")
    model = llm.engine.runner.model
    fused_steps = []
    decode_layers = model._decode_layers

    def spy(kv_caches, meta, attn):
        fused = decode_layers(kv_caches, meta, attn)
        fused_steps.append((meta.lora is not None, fused is not None))
        return fused

    model._decode_layers = spy
    llm.generate([PROMPTS[0]], GREEDY)
    mixed = llm.generate([PROMPTS[0]] * 2, GREEDY, lora_name=["all", "qv"])
    assert _tokens(mixed) == [references["all"][0], references["qv"][0]]
    assert (False, True) in fused_steps  # base decode steps ran fused
    assert (True, True) in fused_steps  # and so did steps with adapters


def test_prefix_cache_blocks_never_cross_adapters(tiny_llama, adapters, references, tmp_path):
    llm = _lora_llm(tiny_llama, adapters)
    prompt = PROMPTS[1]  # 14 tokens: three full 4-token blocks
    base = llm.generate([prompt], GREEDY)[0]
    first = llm.generate([prompt], GREEDY, lora_name="all")[0]
    again = llm.generate([prompt], GREEDY, lora_name="all")[0]
    other = llm.generate([prompt], GREEDY, lora_name="qv")[0]
    assert base.num_cached_tokens == 0 and first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 12  # the same adapter does hit its own blocks
    assert list(other.outputs[0].token_ids) == references["qv"][1]
    # A reload under the same name with other weights is another adapter: its blocks start cold.
    llm.engine.load_lora_adapter("all", str(adapters["qv"]))
    reloaded = llm.generate([prompt], GREEDY, lora_name="all")[0]
    assert reloaded.num_cached_tokens == 0
    assert list(reloaded.outputs[0].token_ids) == references["qv"][1]


def test_ngram_speculation_with_adapters_is_exact(tiny_llama, adapters, references):
    llm = _lora_llm(tiny_llama, adapters, speculative_method="ngram", num_speculative_tokens=3)
    names: list[str | None] = [None, *ADAPTERS]
    results = llm.generate([PROMPTS[0]] * len(names), GREEDY, lora_name=names)
    assert _tokens(results) == [references[n][0] for n in names]


def test_unknown_adapter_and_lora_off_are_refused(tiny_llama, adapters):
    llm = _lora_llm(tiny_llama, adapters)
    with pytest.raises(ParameterError, match="'nope' is neither the served model nor a loaded LoRA adapter"):
        llm.generate([PROMPTS[0]], GREEDY, lora_name="nope")
    llm.engine.unload_lora_adapter("qv")
    with pytest.raises(ParameterError, match="'qv' is neither"):
        llm.generate([PROMPTS[0]], GREEDY, lora_name="qv")
    plain = LLM(model=tiny_llama, block_size=4, max_model_len=128)
    with pytest.raises(ParameterError, match="--enable-lora"):
        plain.generate([PROMPTS[0]], GREEDY, lora_name="qv")


def test_draft_model_speculation_with_adapters_is_exact(tiny_llama, adapters, references):
    """The draft (here the base checkpoint itself) proposes without the adapter; verification runs with it,
    so each adapter's greedy tokens are still PEFT's, and the draft's runner never applies an adapter."""
    llm = _lora_llm(
        tiny_llama, adapters, speculative_method="draft", draft_model=tiny_llama, num_speculative_tokens=3
    )
    names: list[str | None] = [None, *ADAPTERS]
    results = llm.generate([PROMPTS[1]] * len(names), GREEDY, lora_name=names)
    assert _tokens(results) == [references[n][1] for n in names]
    from specfleet.engine.spec_decode.draft import DraftModelProposer

    proposer = llm.engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert llm.engine.runner.use_lora and not proposer.runner.use_lora


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_equal_peft_merged(kind, bundled_path, tmp_path):
    """The same oracle on the rest of Llama's family (q/k/v bias, q/k norms, Mistral): two adapters and the
    base in one batch. Phi-3, Gemma and the MoE models: test_lora_architectures.py."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    path = write_tiny_checkpoint(
        tmp_path / kind, config, std=0.2, tokenizer_from=bundled_path, tokenizer_files=TOKENIZER_FILES
    )
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folders = {
        name: save_random_adapter(base, tmp_path / name, seed=seed, **ADAPTERS[name])
        for seed, name in enumerate(("all", "k-up"))
    }
    llm = LLM(model=f"file://{path}", block_size=4, max_model_len=128, enable_lora=True, max_loras=2)
    for name, folder in folders.items():
        llm.engine.load_lora_adapter(name, str(folder))
    names: list[str | None] = [None, *folders]
    results = llm.generate([PROMPTS[1]] * len(names), GREEDY, lora_name=names)
    wants = {
        n: merged_greedy(str(path), folders[n] if n else None, [PROMPTS[1]], NEW_TOKENS)[0] for n in names
    }
    assert wants["all"] != wants[None] and wants["k-up"] != wants[None]  # the adapters do change the tokens
    for name, tokens in zip(names, _tokens(results)):
        assert tokens == wants[name], f"{kind} adapter {name}"
