"""The speculative methods, declared once: each method's facts, read by every part that names a method.

Plain Python with no torch, so that the operator (its CRD enum and CEL rules), the tuner, the simulator and
the benchmarks import it as the engine does. Who reads what:

- `name`: `EngineConfig.speculative_method`, `specfleet serve --speculative-method`, the CRD's
  `speculative.method` enum (`SPECULATIVE_METHODS`, with "none" first);
- `builder`: `spec_decode/factory.py` imports it on first use and builds the proposer;
- `vllm_names`: `LLM(speculative_config={"method": ...})` accepts these spellings (`VLLM_NAMES`);
- `needs_draft_model`: `EngineConfig`'s checks (draft_model set exactly when needed, draft_quantization
  only then), the CRD's CEL rules and their pydantic twin on `speculative.draftModel`, the loader of the
  draft model, the benchmarks' specs;
- `shadow_drafts`: whether the engine scores n-gram lookups on steps that verify no drafts
  (`spec_decode/shadow.py`), the tuner's reading of acceptance while k = 0.

Adding a method is one entry in `METHODS` plus its builder (docs/architecture.md, "How to add a
proposer"); tests/engine/test_speculative_methods.py walks every entry through the engine's config, the
operator's admission and the renderer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "METHODS",
    "NONE",
    "SPECULATIVE_METHODS",
    "VLLM_DRAFT_MODEL",
    "VLLM_NAMES",
    "SpeculativeMethod",
    "method",
    "methods_with_draft_model",
]

NONE = "none"  # no proposer: k stays 0


@dataclass(frozen=True)
class SpeculativeMethod:
    name: str
    builder: str  # "module:function" building the Proposer, imported on first use (it needs torch)
    vllm_names: tuple[str, ...]  # speculative_config["method"] spellings that select it
    needs_draft_model: bool  # a draft model (draft_model / speculative.draftModel) is required, else refused
    shadow_drafts: bool  # score n-gram lookups on steps without drafts (spec_decode/shadow.py)
    description: str


METHODS: dict[str, SpeculativeMethod] = {
    m.name: m
    for m in (
        SpeculativeMethod(
            name="ngram",
            builder="specfleet.engine.spec_decode.factory:build_ngram",
            vllm_names=("ngram",),
            needs_draft_model=False,
            # The shadow lookups are the proposer's own: their acceptance is what k > 0 would get.
            shadow_drafts=True,
            description="prompt lookup: propose what followed the latest earlier match of the last tokens",
        ),
        SpeculativeMethod(
            name="draft",
            builder="specfleet.engine.spec_decode.factory:build_draft",
            vllm_names=("draft_model", "draft"),
            needs_draft_model=True,
            # n-gram lookups would measure another proposer's acceptance, not the draft model's.
            shadow_drafts=False,
            description="a small model with the target's tokenizer proposes k tokens",
        ),
    )
}

# The one list of names: EngineConfig's check, the CLI's choices and the CRD's enum read it.
SPECULATIVE_METHODS: tuple[str, ...] = (NONE, *METHODS)
# vLLM's speculative_config["method"] spellings -> our method names.
VLLM_NAMES: dict[str, str] = {alias: m.name for m in METHODS.values() for alias in m.vllm_names}
# The method vLLM infers when speculative_config names a `model` and no method.
VLLM_DRAFT_MODEL = "draft_model"


def method(name: str) -> SpeculativeMethod | None:
    """The declared method called `name`; None for "none". Unknown names raise, listing the known ones."""
    if name == NONE:
        return None
    if name not in METHODS:
        raise ValueError(f"speculative_method={name!r} is not one of {SPECULATIVE_METHODS}")
    return METHODS[name]


def methods_with_draft_model() -> tuple[str, ...]:
    """The methods that require a draft model (and refuse one otherwise)."""
    return tuple(m.name for m in METHODS.values() if m.needs_draft_model)
