"""LoRA on the architectures beyond Llama's family (test_lora_oracle.py has Llama, Mistral, Qwen2, Qwen3): Phi-3,
whose adapters name its fused `qkv_proj` and `gate_up_proj` (with partial rotary, so the engine's permuted q/k
columns are exercised), Gemma 2 and 3, and the attention of Mixtral and Qwen3-MoE. Each on a tiny checkpoint
(hidden 64, 2 layers): three adapters saved by PEFT and the base in one batch, each one's greedy tokens equal to
transformers + PEFT `merge_and_unload()`. The MoE models refuse an adapter on their experts, naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TOKENIZER_FILES, tiny_config, write_tiny_checkpoint
from lora_helpers import merged_greedy, save_random_adapter
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.lora.adapter import LoraError

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
PROMPTS = [[1, 3439, 17332, 2501, 263, 931, 29892, 727, 471, 263, 2217, 2343, 1058, 10600], [1, 8948, 2211]]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
LLAMA_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters per architecture over the modules PEFT names on it: ranks 4 to 16, rsLoRA's scale, lora_alpha
# at 4r so that each adapter's greedy tokens leave the base's (asserted: the oracle cannot pass on the base).
LLAMA_ADAPTERS: dict[str, dict[str, Any]] = {
    "all": dict(r=16, lora_alpha=64, target_modules=LLAMA_NAMES),
    "qv": dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "k-mlp-rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "up_proj", "down_proj"]),
}
ATTENTION_ADAPTERS: dict[str, dict[str, Any]] = {
    "qkvo": dict(r=16, lora_alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qv": dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "k-o-rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj"]),
}
GEMMA = dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=24)  # a window shorter than the prompt
CASES: dict[str, tuple[str, dict[str, Any], dict[str, dict[str, Any]]]] = {
    "phi3": (
        "phi3",
        dict(partial_rotary_factor=0.5),  # 8 of 16 values rotate: q/k rows permuted at load
        {
            "all": dict(
                r=16, lora_alpha=64, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
            ),
            "qkv-rs": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["qkv_proj"]),
            "mlp": dict(r=4, lora_alpha=16, target_modules=["gate_up_proj", "down_proj"]),
        },
    ),
    "gemma2": ("gemma2", GEMMA, LLAMA_ADAPTERS),
    "gemma3": ("gemma3", dict(GEMMA, layer_types=["sliding_attention", "full_attention"]), LLAMA_ADAPTERS),
    "mixtral": ("mixtral", {}, ATTENTION_ADAPTERS),
    "qwen3moe": ("qwen3moe", {}, ATTENTION_ADAPTERS),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, bundled_path, tmp_path_factory: pytest.TempPathFactory):
    """(kind, checkpoint folder, adapter folders, PEFT's merged greedy tokens per adapter and None), built once
    per architecture for the tests of this file."""
    from transformers import AutoModelForCausalLM

    kind, overrides, adapters = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    config = tiny_config(kind, **overrides, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    path = write_tiny_checkpoint(
        root / "base", config, std=0.2, tokenizer_from=bundled_path, tokenizer_files=TOKENIZER_FILES
    )
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folders = {
        name: save_random_adapter(base, root / name, seed=seed, **lora)
        for seed, (name, lora) in enumerate(adapters.items())
    }
    refs: dict[str | None, list[list[int]]] = {None: merged_greedy(str(path), None, PROMPTS, NEW_TOKENS)}
    for name, folder in folders.items():
        refs[name] = merged_greedy(str(path), folder, PROMPTS, NEW_TOKENS)
    return request.param, path, folders, refs


def test_mixed_batch_equals_peft_merged(case):
    kind, path, folders, refs = case
    for name in folders:
        assert refs[name] != refs[None], f"{kind} adapter {name} leaves the base's tokens unchanged"
    llm = LLM(model=f"file://{path}", block_size=4, max_model_len=128, enable_lora=True, max_loras=3)
    for name, folder in folders.items():
        llm.engine.load_lora_adapter(name, str(folder))
    runner, model = llm.engine.runner, llm.engine.runner.model
    seen: list[set[str | None]] = []
    fused: list[bool] = []  # decode steps with adapters: did they run the native fused decode layers
    prepare, decode_layers = runner.prepare, model._decode_layers

    def spy_prepare(items):
        seen.append({item.seq.lora.name if item.seq.lora else None for item in items})
        return prepare(items)

    def spy_decode_layers(kv_caches, meta, attn):
        layers = decode_layers(kv_caches, meta, attn)
        if meta.lora is not None:
            fused.append(layers is not None)
        return layers

    runner.prepare, model._decode_layers = spy_prepare, spy_decode_layers
    names: list[str | None] = [None, *folders]
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in names]
    results = llm.generate([PROMPTS[i] for _, i in jobs], GREEDY, lora_name=[n for n, _ in jobs])
    for (name, i), result in zip(jobs, results):
        assert list(result.outputs[0].token_ids) == refs[name][i], f"{kind} adapter {name} on prompt {i}"
    assert any(s == set(names) for s in seen), "no step mixed the three adapters and the base"
    if kind == "phi3" and runner.attn.name == "native":  # Llama's layers: the fused decode path adds them
        assert fused and all(fused)
    llm.close()


def test_moe_adapter_on_the_experts_is_refused_naming_them(case, tmp_path):
    """PEFT on transformers 5 turns MLP targets of an MoE model into `target_parameters` on the fused 3-D
    expert weights; loading one is refused naming them (the server answers the same LoraError as a 400), and
    the engine goes on serving."""
    from transformers import AutoModelForCausalLM

    kind, path, folders, refs = case
    if kind not in ("mixtral", "qwen3moe"):
        pytest.skip("the MoE models' refusal")
    mlp = ["w1", "w3", "w2"] if kind == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folder = save_random_adapter(base, tmp_path / "experts", seed=9, r=4, target_modules=["q_proj", *mlp])
    llm = LLM(model=f"file://{path}", block_size=4, max_model_len=128, enable_lora=True)
    architecture = type(llm.engine.runner.model).architecture
    with pytest.raises(
        LoraError,
        match=rf"target_parameters \[.*'gate_up_proj'.*\] are the routed experts' weights: {architecture} takes "
        r"adapters on its attention only",
    ):
        llm.engine.load_lora_adapter("experts", str(folder))
    assert llm.engine.lora_adapters() == {}
    llm.engine.load_lora_adapter("qv", str(folders["qv"]))
    result = llm.generate([PROMPTS[1]], GREEDY, lora_name="qv")[0]
    assert list(result.outputs[0].token_ids) == refs["qv"][1]
    llm.close()
