"""LoRA adapters served on the base model: `adapters` (name, source, rank) and `lora` (the engine's
--max-loras and --max-lora-rank). A request picks an adapter by putting its name in `model`."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from .fields import _Spec, cel
from .model import HF_PARENT_MESSAGE, HF_PARENT_SEGMENT

# The engine takes a PEFT folder; bundled:// names whole models, not adapters.
ADAPTER_SOURCE_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|file:///.+|hf://[^/@\s]+/[^/@\s]+(@[^\s]+)?)$"
)
# The name is a request's `model` and a label value in the engine's metrics (comma-joined there, so no
# comma); KubeAI's rule (^[a-z0-9-]+$, at most 63) with dots and underscores allowed, as vLLM's names have.
ADAPTER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$"
ADAPTERS_UNIQUE = "adapters: each name at most once (a request names one adapter)"
# The engine applies an adapter on one process's weights: it refuses --enable-lora on a split model.
ADAPTERS_SPLIT = (
    "adapters need engine.tensorParallelSize and pipelineParallelSize 1 (the engine applies LoRA on "
    "one process's weights)"
)
RANK_WITHIN = "adapters[].rank must be at most lora.maxLoraRank (the engine refuses a higher rank)"
# A pod carries the adapters' volumes and the engine holds each in host memory (--max-cpu-loras is left
# at its default, max_loras, plus what is listed); 64 keeps the pod spec and the status small.
MAX_ADAPTERS = 64


class AdapterSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"!self.source.matches('{HF_PARENT_SEGMENT}')", HF_PARENT_MESSAGE)
            ]
        }
    )
    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=ADAPTER_NAME_PATTERN,
        description="What a request puts in `model` to use this adapter.",
    )
    source: str = Field(
        pattern=ADAPTER_SOURCE_PATTERN,
        max_length=512,
        description="A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors): pvc://CLAIM/PATH, "
        "file:///ABS/PATH or hf://ORG/NAME[@REVISION] (downloaded like the model, into model.cache).",
    )
    rank: int | None = Field(
        None, ge=1, le=512, description="The adapter's rank r, if known: checked against lora.maxLoraRank."
    )

    @model_validator(mode="after")
    def _no_parent_segment(self) -> AdapterSpec:
        if re.fullmatch(HF_PARENT_SEGMENT, self.source):
            raise ValueError(f"adapters[{self.name}].source={self.source!r}: {HF_PARENT_MESSAGE}")
        return self


class LoraSpec(_Spec):
    max_loras: int = Field(
        1,
        ge=1,
        le=MAX_ADAPTERS,
        description="Adapters one engine step may mix (--max-loras; vLLM's default 1): a request for another "
        "adapter waits until a slot frees. The router prefers engines where the adapter is active.",
    )
    max_lora_rank: int = Field(
        64, ge=1, le=512, description="Highest adapter rank the engine accepts (--max-lora-rank)."
    )


def adapter_rules() -> list[Any]:
    """The CEL twins of `check_adapters`, on the whole spec."""
    return [
        cel(
            "!has(self.adapters) || self.adapters.all(a, self.adapters.filter(b, b.name == a.name).size() == 1)",
            ADAPTERS_UNIQUE,
        ),
        cel(
            "!has(self.adapters) || self.adapters.all(a, !has(a.rank) || a.rank <= self.lora.maxLoraRank)",
            RANK_WITHIN,
        ),
        cel(
            "!has(self.adapters) || size(self.adapters) == 0 || "
            "(self.engine.tensorParallelSize == 1 && self.engine.pipelineParallelSize == 1)",
            ADAPTERS_SPLIT,
        ),
    ]


def check_adapters(adapters: list[AdapterSpec], lora: LoraSpec, tp: int, pp: int) -> None:
    """The Python twins of `adapter_rules`: unique names, ranks within lora.maxLoraRank, one process."""
    if adapters and tp * pp > 1:
        raise ValueError(f"engine.tensorParallelSize={tp}, pipelineParallelSize={pp}: {ADAPTERS_SPLIT}")
    seen: set[str] = set()
    for adapter in adapters:
        if adapter.name in seen:
            raise ValueError(f"adapters: {adapter.name!r} is listed twice; {ADAPTERS_UNIQUE}")
        seen.add(adapter.name)
        if adapter.rank is not None and adapter.rank > lora.max_lora_rank:
            raise ValueError(
                f"adapters[{adapter.name}].rank={adapter.rank} exceeds lora.maxLoraRank={lora.max_lora_rank}; "
                "raise maxLoraRank or use a smaller adapter"
            )
