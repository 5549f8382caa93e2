"""`bench quant quality`'s agreement figures are with float32's greedy tokens, whichever forms are asked for
(a run of `--kinds Q8_0,Q4_0` once compared Q4_0 with Q8_0 and Q8_0 with itself: "agree 1.0")."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest


def test_agreement_is_with_float32_even_when_float32_is_not_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from specfleet.bench import quant

    # Each form's greedy tokens: float32 [1, 2, 3, 4]; Q8_0 diverges at the third token; Q4_0 at the first.
    tokens = {"fp32": [1, 2, 3, 4], "Q8_0": [1, 2, 9, 9], "Q4_0": [7, 7, 7, 7]}
    loaded: list[str] = []

    @contextmanager
    def weights(kind: str) -> Any:
        yield {"kind": kind}

    class FakeLLM:  # the engine at its constructor: only which form it runs matters here
        def __init__(self, **kw: Any) -> None:
            self.kind = kw["kind"]
            loaded.append(self.kind)

    monkeypatch.setattr(quant, "weights", weights)
    monkeypatch.setattr(quant, "LLM", FakeLLM)
    monkeypatch.setattr(quant, "greedy", lambda llm, prompts: [tokens[llm.kind]] * len(prompts))
    monkeypatch.setattr(quant, "perplexity", lambda llm: 1.0)

    out = quant.quality(["Q8_0", "Q4_0"])

    assert loaded == ["fp32", "Q8_0", "Q4_0"]  # the reference first
    assert "fp32" not in out  # not asked for, so not reported
    assert out["Q8_0"]["agree_prefix"] == 0.5 and out["Q8_0"]["exact"] == 0.0
    assert out["Q4_0"]["agree_prefix"] == 0.0
    both = quant.quality(["fp32", "Q8_0"])
    assert both["fp32"]["agree_prefix"] == 1.0 and both["Q8_0"]["agree_prefix"] == 0.5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["awq", "gptq-act-order"])
def test_quality_checkpoints_hold_the_bundled_weights_in_the_formats_layout(kind: str, tmp_path) -> None:
    """The AWQ/GPTQ rows run checkpoints written from the bundled float32 weights: a projection read back
    through the engine's format reader is that weight to within one quantization step."""
    import json

    import torch
    from safetensors.torch import load_file
    from specfleet.bench import quant
    from specfleet.engine.checkpoint import load_state_dict
    from specfleet.engine.model_source import resolve_model
    from specfleet.engine.quant.awq_gptq import quantized_state

    quant.write_checkpoint(kind, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    qconfig = config["quantization_config"]
    assert qconfig["quant_method"] == kind.split("-")[0] and qconfig["group_size"] == quant.CHECKPOINT_GROUP
    assert (tmp_path / "tokenizer.json").exists()
    stored = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.qweight" in stored and "model.embed_tokens.weight" in stored
    assert ("model.layers.0.mlp.down_proj.g_idx" in stored) == (kind == "gptq-act-order")
    layer0 = {k: v for k, v in stored.items() if k.startswith("model.layers.0.mlp.down_proj.")}
    read = quantized_state(layer0, qconfig)["model.layers.0.mlp.down_proj.weight"]
    original = load_state_dict(resolve_model(quant.BUNDLED).path)["model.layers.0.mlp.down_proj.weight"]
    deq = read.dequantize()
    assert deq.shape == original.shape
    # at most one quantization step of the row's widest group (half a step but for the rare code that
    # GPTQ v1's zero >= 1 clips); shuffled act-order groups make per-group bounds meaningless
    step = read.scales.amax(-1, keepdim=True)
    assert bool(((deq - original).abs() <= step + 1e-6).all())
    assert float((deq - original).abs().mean()) < float(step.mean()) / 3
    assert not torch.equal(deq, original)  # really quantized
