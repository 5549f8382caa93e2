"""Model architectures, by the name a Hugging Face config lists in `architectures`.

A new architecture is one entry here (a class with LlamaModel's constructor and forward/logits); the
loader refuses any name that is not a key, listing the keys.
"""

from __future__ import annotations

# architecture name -> "module:class", imported on first use (this module stays free of torch).
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "specfleet.engine.models.llama:LlamaModel",
    "MistralForCausalLM": "specfleet.engine.models.llama:LlamaModel",
    "Qwen2ForCausalLM": "specfleet.engine.models.llama:LlamaModel",  # q/k/v bias: LlamaModel reads model_type
    "Qwen3ForCausalLM": "specfleet.engine.models.qwen3:Qwen3Model",
    "Phi3ForCausalLM": "specfleet.engine.models.phi3:Phi3Model",
    "Gemma2ForCausalLM": "specfleet.engine.models.gemma:Gemma2Model",
    "Gemma3ForCausalLM": "specfleet.engine.models.gemma:Gemma3Model",
    "MixtralForCausalLM": "specfleet.engine.models.moe:MixtralModel",
    "Qwen3MoeForCausalLM": "specfleet.engine.models.moe:Qwen3MoeModel",
}


def model_class(architectures: list[str]) -> type:
    """The class for the first of a config's `architectures` that is registered."""
    import importlib

    for name in architectures:
        if name in ARCHITECTURES:
            module, _, cls = ARCHITECTURES[name].partition(":")
            return getattr(importlib.import_module(module), cls)
    from specfleet.engine.errors import UnsupportedModel

    raise UnsupportedModel(
        f"architecture {architectures!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )
