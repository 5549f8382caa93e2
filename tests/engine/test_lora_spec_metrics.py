"""Draft-model speculation with two adapters: the engine counts draft and accepted tokens per adapter (the
draft proposes without the adapter, so an adapter that moves the model far from the base accepts fewer),
the server's counters carry them labelled by adapter, and unloading an adapter removes its series."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import save_random_adapter
from prometheus_client import CollectorRegistry, generate_latest
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.server.lora_metrics import LoraMetrics

pytestmark = pytest.mark.slow

PROMPTS = [[1, 450, 7483, 310, 3444, 338, 263], [1, 3439, 17332, 2501, 263, 931]]
ADAPTERS = {  # near: a small delta, the base's drafts mostly hold; far: alpha 16r, the tokens leave the base's
    "near": dict(r=8, lora_alpha=1, target_modules=["q_proj", "v_proj"]),
    "far": dict(r=16, lora_alpha=256, target_modules=["q_proj", "v_proj", "down_proj"]),
}


def test_acceptance_is_counted_per_adapter(tiny_llama: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_llama.removeprefix("file://")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folders = {
        n: save_random_adapter(base, tmp_path / n, seed=i, **c) for i, (n, c) in enumerate(ADAPTERS.items())
    }
    llm = LLM(
        model=tiny_llama,
        block_size=4,
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        speculative_method="draft",
        draft_model=tiny_llama,  # the base checkpoint drafts, without any adapter
        num_speculative_tokens=3,
    )
    for name, folder in folders.items():
        llm.engine.load_lora_adapter(name, str(folder))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    names = [n for n in ADAPTERS for _ in PROMPTS]
    llm.generate(PROMPTS * len(ADAPTERS), greedy, lora_name=names)

    drafts = llm.engine.lora_state()["drafts"]
    assert set(drafts) == {"near", "far"}
    for drafted, accepted in drafts.values():
        assert 0 <= accepted <= drafted and drafted > 0
    # every draft of this run was for an adapter's request: the split adds up to the engine's total
    assert sum(d for d, _ in drafts.values()) == llm.engine.stats.num_draft_tokens
    assert sum(a for _, a in drafts.values()) == llm.engine.stats.num_accepted_tokens
    near, far = (drafts[n][1] / drafts[n][0] for n in ("near", "far"))
    assert near > far, (near, far)

    registry = CollectorRegistry()
    metrics = LoraMetrics(registry, "tiny", max_loras=2)
    metrics.update(llm.engine.lora_state())
    text = generate_latest(registry).decode()
    for name, (drafted, accepted) in drafts.items():
        labels = f'{{lora_name="{name}",model_name="tiny"}}'
        assert f"specfleet_lora_spec_decode_draft_tokens_total{labels} {float(drafted)}" in text
        assert f"specfleet_lora_spec_decode_accepted_tokens_total{labels} {float(accepted)}" in text

    llm.engine.unload_lora_adapter("far")
    metrics.update(llm.engine.lora_state())
    text = generate_latest(registry).decode()
    assert 'lora_name="far"' not in text and 'lora_name="near"' in text
