"""The model a service serves and the draft model a speculative method proposes with: where the weights
come from (bundled://, pvc://, file://, hf://), their dtype and quantization, and the download cache."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from ..kube_grammar import DNS1123_SUBDOMAIN
from .fields import PositiveQuantity, _default_obj, _Spec, cel

SOURCE_PATTERN = r"^(bundled://[a-z0-9][a-z0-9.-]*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|file:///.+|hf://[^/@\s]+/[^/@\s]+(@[^\s]+)?)$"

# An hf:// source becomes a path: with model.cache.claimName the engine mounts `ORG/NAME/REVISION` of the
# claim as a subPath, which may not climb out of it (the API server refuses a `..` segment).
HF_PARENT_SEGMENT = "^hf://(.*[/@])?[.][.]([/@].*)?$"
HF_PARENT_MESSAGE = (
    "source: an hf://ORG/NAME@REVISION source may not have a '..' segment: it becomes a path in "
    "model.cache.claimName (the engine's subPath), which may not leave the claim"
)


class ModelSource(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"!self.source.matches('{HF_PARENT_SEGMENT}')", HF_PARENT_MESSAGE)
            ]
        }
    )
    source: str = Field(
        pattern=SOURCE_PATTERN,
        max_length=512,
        description="Model URI: bundled://NAME, pvc://CLAIM/PATH, file:///ABS/PATH or hf://ORG/NAME[@REVISION].",
    )

    @model_validator(mode="after")
    def _no_parent_segment(self) -> ModelSource:
        if re.fullmatch(HF_PARENT_SEGMENT, self.source):
            raise ValueError(f"{self.source!r}: {HF_PARENT_MESSAGE}")
        return self


class DraftModelSpec(ModelSource):
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="int8: the draft's weights as int8 on the engine's native CPU kernels (CPU pods). With "
        "source set to the target's own, a cheap draft that agrees with it on most tokens.",
    )


class ModelCacheSpec(_Spec):
    size_limit: PositiveQuantity = Field(
        "40Gi",
        description="hf:// sources without claimName: the size of the pod's download volume, requested as "
        "ephemeral-storage so the scheduler places the pod where it fits (an 8B model in bf16 is ~16 GB).",
    )
    claim_name: str | None = Field(
        None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A PersistentVolumeClaim (ReadWriteMany for more than one pod) that hf:// downloads go to "
        "and are read from: each revision is downloaded once and shared by every pod and restart.",
    )


class ModelSpec(ModelSource):
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weight and activation dtype; auto is float32 on CPU and bfloat16 on GPU."
    )
    max_model_len: int = Field(4096, ge=16, le=1048576, description="Longest prompt + output, in tokens.")
    quantization: Literal["none", "int8", "gguf", "awq", "gptq"] = Field(
        "none",
        description="Weights run quantized (--quantization): int8 (the float weights, quantized at load), gguf "
        "(a GGUF source's Q4_0/Q4_1/Q4_K/Q8_0 tensors as stored), awq or gptq (4-bit checkpoints, also picked "
        "up from their own config). CPU pods run them on the native kernels; awq and gptq also on GPU. none: "
        "the float weights, exactly as transformers computes them.",
    )
    hf_token_secret: str | None = Field(
        None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="Secret (key HF_TOKEN) the hf:// download step reads, for gated models.",
    )
    cache: ModelCacheSpec = _default_obj(ModelCacheSpec)
