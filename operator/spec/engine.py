"""The engine's own settings (image, KV cache, parallelism, timeouts, extra flags) and its batch limits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field
from specfleet.engine.config import FCFS, SCHEDULING_POLICIES

from ..engine_flags import RESERVED_ARG_PATTERN, RESERVED_ARGS_MESSAGE, reserved_args
from .fields import _Spec, cel

# Multi-node (a LeaderWorkerSet): pipeline stages spread over the pods of a group, an equal run on each.
NODES_SPLIT = (
    "engine.nodes > 1 spreads pipeline stages over pods: it needs pipelineParallelSize > 1 and a "
    "multiple of nodes"
)


def _no_operator_flags(args: list[str]) -> list[str]:
    if reserved := reserved_args(args):
        raise ValueError(f"{reserved}: {RESERVED_ARGS_MESSAGE}")
    return args


class EngineSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.nodes == 1 || (self.pipelineParallelSize > 1 && self.pipelineParallelSize % self.nodes == 0)",
                    NODES_SPLIT,
                ),
            ]
        }
    )
    image: str | None = Field(
        None, max_length=512, description="Engine image; empty means the operator's default engine image."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    block_size: Literal[8, 16, 32, 64, 128] = Field(16, description="KV cache block size in tokens.")
    kv_cache_memory_fraction: float = Field(0.9, ge=0.05, le=0.99)
    prefix_caching: bool = True
    scheduling_policy: Literal[SCHEDULING_POLICIES] = Field(  # type: ignore[valid-type]
        FCFS,
        description="The engine's --scheduling-policy: fcfs, or priority (requests run by their priority "
        "field, lower first, as vLLM; a request outranking running ones preempts the lowest of them when "
        "the KV cache or maxNumSeqs is full). Under fcfs a request with a non-zero priority is a 400.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=8,
        description="Ranks one model copy is split over by tensor "
        "parallelism (one GPU each; processes sharing the CPU when gpus is 0).",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        le=8,
        description="Pipeline stages one model copy is split into "
        "(one GPU each; processes sharing the CPU when gpus is 0).",
    )
    nodes: int = Field(
        1,
        ge=1,
        le=8,
        description="Pods one model copy spans: >1 spreads the pipeline stages over "
        "that many pods (a LeaderWorkerSet: the leader runs stage 0 and the server, each worker "
        "an equal run of the next stages). Needs the LeaderWorkerSet controller in the cluster.",
    )
    drain_timeout_seconds: int = Field(
        30, ge=0, le=3600, description="How long SIGTERM waits for in-flight requests before exiting."
    )
    startup_timeout_seconds: int = Field(
        900, ge=30, le=7200, description="How long the model may take to load before the pod is restarted."
    )
    extra_args: Annotated[
        list[Annotated[str, Field(max_length=1024)]], AfterValidator(_no_operator_flags)
    ] = Field(
        default_factory=list,
        max_length=64,
        description="Appended to the engine command line as given; not the flags the operator sets itself.",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"self.all(a, !a.matches('{RESERVED_ARG_PATTERN}'))", RESERVED_ARGS_MESSAGE)
            ]
        },
    )


class BatchingSpec(_Spec):
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most sequences scheduled in one step.")
    max_num_batched_tokens: int = Field(2048, ge=16, le=1048576, description="Token budget of one step.")
