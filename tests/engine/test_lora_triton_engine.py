"""The engine's CUDA LoRA path end to end, on CPU: every step's adapter deltas go through the Triton
shrink/expand kernels (run by Triton's interpreter, as `LoraBatch.build(..., triton=True)` does on CUDA),
and each adapter's greedy tokens, in a batch mixing two adapters and the base, equal transformers + PEFT's
`merge_and_unload()`. What it does not cover: compiled kernels and bf16 on a GPU (bench/gpu's lora section)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import merged_greedy, save_random_adapter
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.lora.batch import LoraBatch
from specfleet.kernels import lora_shrink_expand

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
PROMPTS = [[1, 450, 7483, 310, 3444, 338, 263, 4192, 310], [1, 8948, 2211]]
ADAPTERS = {  # different ranks, and q/v only beside every projection: slices with a gap, padded ranks
    "qv": dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=16,
        lora_alpha=64,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}


def test_triton_path_equals_peft_merged(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_llama.removeprefix("file://")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folders = {
        n: save_random_adapter(base, tmp_path / n, seed=i, **c) for i, (n, c) in enumerate(ADAPTERS.items())
    }
    names: list[str | None] = [None, *ADAPTERS]
    want = {n: merged_greedy(path, folders[n] if n else None, PROMPTS, NEW_TOKENS) for n in names}
    assert want["qv"] != want[None] and want["all"] != want[None]  # the oracle is not the base's tokens

    build = LoraBatch.build.__func__
    monkeypatch.setattr(
        LoraBatch,
        "build",
        classmethod(lambda cls, spans, n, device, triton=None: build(cls, spans, n, device, True)),
    )
    launches: list[int] = []
    shrink = lora_shrink_expand.lora_shrink

    def counted(*args, **kwargs):
        launches.append(1)
        return shrink(*args, **kwargs)

    monkeypatch.setattr(lora_shrink_expand, "lora_shrink", counted)
    llm = LLM(model=tiny_llama, block_size=4, max_model_len=64, enable_lora=True, max_loras=2)
    for adapter, folder in folders.items():
        llm.engine.load_lora_adapter(adapter, str(folder))
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    jobs = [(n, i) for i in range(len(PROMPTS)) for n in names]
    results = llm.generate([PROMPTS[i] for _, i in jobs], greedy, lora_name=[n for n, _ in jobs])
    for (name, i), result in zip(jobs, results):
        assert list(result.outputs[0].token_ids) == want[name][i], f"adapter {name} on prompt {i}"
    assert launches, "no step ran the Triton kernels"
