"""Speculative decoding: the method (from the engine's declaration of methods), k, the batch guard and the
draft model a method may need."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator
from specfleet.engine.spec_decode.methods import SPECULATIVE_METHODS, methods_with_draft_model

from .fields import _Spec, cel
from .model import DraftModelSpec


def _draft_model_rules(methods: tuple[str, ...]) -> list[Any]:
    """draftModel set exactly with a method that needs one (spec_decode/methods.py), as CEL rules; their
    Python twin is SpeculativeSpec._draft_model_matches_method."""
    if not methods:
        return [cel("!has(self.draftModel)", "draftModel is not used by any speculative method")]
    names = " or ".join(methods)
    return [
        cel(
            " && ".join(f"self.method != '{m}'" for m in methods) + " || has(self.draftModel)",
            f"method: {names} needs draftModel.source (the small model that proposes tokens)",
        ),
        cel(
            " || ".join(f"self.method == '{m}'" for m in methods) + " || !has(self.draftModel)",
            f"draftModel is only used with method: {names}; set method: {methods[0]} or remove draftModel",
        ),
    ]


class SpeculativeSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": _draft_model_rules(methods_with_draft_model())}
    )
    method: Literal[SPECULATIVE_METHODS] = "none"  # type: ignore[valid-type]
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="k: tokens proposed per step (0 = off).")
    disable_by_batch_size: int = Field(
        0,
        ge=0,
        le=4096,
        description="A step whose batch is larger than this proposes nothing (0 = never). With autotune on, "
        "the tuner sets it to the batch at which it would turn speculation off itself (past the "
        "step cost's knee), so a load that rises between two intervals loses no time to drafts.",
    )
    draft_model: DraftModelSpec | None = None

    @model_validator(mode="after")
    def _draft_model_matches_method(self) -> SpeculativeSpec:
        needs = methods_with_draft_model()
        if self.method in needs and self.draft_model is None:
            raise ValueError(f"speculative.method={self.method!r} needs speculative.draftModel.source")
        if self.method not in needs and self.draft_model is not None:
            names = " or ".join(map(repr, needs)) or "no method"
            raise ValueError(
                f"speculative.draftModel is only used with method {names}, not {self.method!r}; "
                f"set method: {needs[0] if needs else '...'} or remove draftModel"
            )
        return self
