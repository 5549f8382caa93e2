"""Engine configuration: one frozen object validated at start, plus the live knobs the tuner turns and their
limits in one engine (`check_live`: the admin API's 400 and `--live-config-file`'s check at start).

Plain Python: the operator and the tuner import it without torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from specfleet.engine.errors import ParameterError
from specfleet.engine.knobs import LiveConfig, live_limits, live_refusal
from specfleet.engine.kv_events_config import KVEventsConfig
from specfleet.engine.spec_decode.methods import (
    METHODS,
    NONE,
    SPECULATIVE_METHODS,
    SpeculativeMethod,
    method,
    methods_with_draft_model,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "DRAFT_QUANTIZATIONS",
    "KV_ROLES",
    "QUANTIZATIONS",
    "QUANTIZED_ACTIVATIONS",
    "SCHEDULING_POLICIES",
    "SPECULATIVE_METHODS",
    "EngineConfig",
    "LiveConfig",
    "check_live",
    "start_on",
]

# Weight quantizations. int8: the float weights quantized at load (one scale per output column). gguf: a
# GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 tensors run as stored. awq, gptq: the checkpoint's 4-bit weights (also
# picked up from its quantization_config when the field is unset). All run on the native CPU kernels;
# awq and gptq also on CUDA through the Triton dequantize-matmul (kernels/quant_matmul.py).
QUANTIZATIONS = (None, "int8", "gguf", "awq", "gptq")
DRAFT_QUANTIZATIONS = (None, "int8")
# Activations of the grouped-quantized weights (gguf, awq, gptq) on the native CPU kernels: int8 quantizes
# each row per 32 values and runs integer dot products, as llama.cpp's CPU path does; float32 keeps them
# exact (dequantize in registers). Measured in docs/kernels.md.
QUANTIZED_ACTIVATIONS = ("int8", "float32")
ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")
# Prefill/decode disaggregation (engine/kv_transfer/): a prefill engine holds each prompt's KV blocks for
# a decode engine, which pulls them.
KV_ROLES = ("prefill", "decode")
# The order of the waiting queue and of preemption (request_queue.py holds each policy's queue).
FCFS, PRIORITY = "fcfs", "priority"
SCHEDULING_POLICIES = (FCFS, PRIORITY)


def _any_of(names: Iterable[str]) -> str:
    return " or ".join(map(repr, names))


def _opt(default: Any, help: str, **cli: Any) -> Any:
    """A field with its help text. The engine flags (`specfleet serve`, `specfleet generate`) are generated
    from EngineConfig's fields (engine/args.py): `--field-name`, the field's default and type, and these;
    `cli` may add `choices`, a `flag` spelled otherwise (a bool field then flips its default) and a
    `cli_default` the CLI resolves."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _opt("bundled://smollm2-135m-instruct", "model source URI")
    dtype: str = _opt("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 on CUDA)")
    device: str = _opt("auto", "auto | cpu | cuda")
    max_model_len: int | None = _opt(None, "longest prompt + output in tokens (default: the model's own)")
    block_size: int = _opt(16, "KV cache block size in tokens")
    num_kv_blocks: int | None = _opt(
        None, "KV cache blocks (default: from --kv-cache-memory-fraction or --kv-cache-gib)"
    )
    kv_cache_gib: float | None = _opt(None, "CPU: KV cache size in GiB (default 2)")
    kv_cache_memory_fraction: float = _opt(0.9, "CUDA: fraction of free device memory for weights + KV")
    enable_prefix_caching: bool = _opt(True, "turn the prefix cache off", flag="--no-prefix-caching")
    max_num_seqs: int = _opt(64, "most sequences in one step (live)")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step (live)")
    # Ceilings fixed at start: the live knobs may move anywhere below them.
    max_num_seqs_limit: int | None = _opt(
        None, "ceiling for the live max_num_seqs (default: max(max_num_seqs, 256))"
    )
    max_num_batched_tokens_limit: int | None = _opt(
        None, "ceiling for the live max_num_batched_tokens (default: max(max_num_batched_tokens, 8192))"
    )
    # vLLM's default, fcfs: no request can hold others back. priority lets a caller's class (the router
    # sets it from the tenant's) jump the queue and preempt lower classes when the cache is full.
    scheduling_policy: str = _opt(
        FCFS,
        "fcfs (first come, first served) or priority: waiting requests by their priority field (lower "
        "first, ties by arrival), and a request outranking running ones preempts the lowest of them when "
        "the KV cache or max_num_seqs is full",
        choices=SCHEDULING_POLICIES,
    )
    attention_backend: str = _opt(
        "auto", "attention kernels (auto: triton on CUDA, native on CPU)", choices=ATTENTION_BACKENDS
    )
    speculative_method: str = _opt("none", "speculative decoding proposer", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = _opt(
        0, "k (default: 4 with a speculative method, else 0)", cli_default=None
    )
    max_num_speculative_tokens: int = _opt(8, "ceiling for the live k")
    # Propose nothing in a step whose batch (running sequences plus the waiting ones max_num_seqs leaves
    # room for) is larger than this: past the step cost's knee every draft token costs compute. 0: never.
    speculative_disable_by_batch_size: int = _opt(
        0, "propose nothing in a step whose batch is larger than this (0: never)"
    )
    draft_model: str | None = _opt(None, "draft model source URI (--speculative-method draft)")
    # Weight-only int8 (one scale per output column) on the native CPU kernels: a quarter of the bytes.
    # For the draft it makes a quantized copy of the target a cheap, well-aligned proposer.
    quantization: str | None = _opt(
        None,
        "weight quantization: int8 (the float weights, quantized at load), "
        "gguf (a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 tensors as stored), awq, gptq "
        "(4-bit checkpoints; also read from their quantization_config)",
        choices=[q for q in QUANTIZATIONS if q],
    )
    quantized_activations: str = _opt(
        "int8",
        "gguf/awq/gptq weights on CPU: int8 (activations quantized per "
        "32 values, integer dot products as llama.cpp) or float32 (exact, slower "
        "at small batches)",
        choices=QUANTIZED_ACTIVATIONS,
    )
    draft_quantization: str | None = _opt(
        None,
        "quantize the draft's weights to int8: with --draft-model set to the target itself, a cheap "
        "proposer that agrees with it on most tokens",
        choices=[q for q in DRAFT_QUANTIZATIONS if q],
    )
    prompt_lookup_min: int = _opt(1, "n-gram proposer: shortest suffix to look up in the prompt")
    prompt_lookup_max: int = _opt(4, "n-gram proposer: longest suffix to look up in the prompt")
    generation_config: str = _opt(
        "auto",
        "request defaults for temperature, top_p, top_k, min_p and repetition_penalty: auto (the model's "
        "generation_config.json, as vLLM), vllm (SamplingParams' own), or a folder holding a "
        "generation_config.json",
    )
    seed: int = _opt(
        0, "seed of the engine's generator, which requests without a seed of their own draw from"
    )
    tensor_parallel_size: int = _opt(
        1,
        "ranks one model copy is split over (Megatron-style tensor parallelism): GPUs on CUDA, processes "
        "sharing the cores on CPU; must divide the attention heads",
    )
    pipeline_parallel_size: int = _opt(
        1,
        "pipeline stages one model copy is split into (runs of layers, one process each, or "
        "tensor_parallel_size each; GPUs on CUDA)",
    )
    # vLLM's virtual engines: with P stages, P micro-batches in flight keep every stage busy in the steady
    # state; one turns that off (a step then runs through every stage before the next starts).
    pipeline_overlap: bool = _opt(
        True,
        "pipeline parallelism: run one micro-batch through the stages at a time "
        "instead of one per stage in flight",
        flag="--no-pipeline-overlap",
    )
    kv_role: str | None = _opt(
        None,
        "prefill/decode disaggregation: prefill computes prompts and holds their KV "
        "for a decode engine, which pulls it and continues the stream",
        choices=KV_ROLES,
    )
    kv_transfer_host: str = _opt("127.0.0.1", "prefill role: address the KV blocks are served on")
    kv_transfer_port: int = _opt(0, "prefill role: port the KV blocks are served on (0: a free one)")
    # A hold outlives its decoder's pull only when the decoder died or never came; vLLM's NIXL connector
    # waits 480 s (PR #25897) for slow RDMA fabrics, a loopback pull takes milliseconds.
    kv_transfer_timeout_s: float = _opt(
        60.0, "seconds a prefill engine holds KV blocks for a decoder, and a decoder waits for them"
    )

    kv_events_config: str | None = _opt(
        None,
        "KV cache events as vLLM's --kv-events-config JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
    )

    # LoRA (engine/lora/). vLLM's flags; its --max-lora-rank default is 16, ours 64 so that the common
    # fine-tunes (ranks 8 to 64) load without a flag; the adapters' memory is their own size, not the limit.
    enable_lora: bool = _opt(False, "serve LoRA adapters (requests name one in `model`)")
    # vLLM's default: 1. Each adapter in a step costs two small matmuls per projection and layer, so the
    # distinct adapters of one batch are capped; a request for another waits until one of them drains.
    max_loras: int = _opt(1, "LoRA adapters one step may mix (a request for another waits)")
    max_lora_rank: int = _opt(64, "highest LoRA rank an adapter may have")
    max_cpu_loras: int | None = _opt(
        None, "LoRA adapters kept in host memory, least recently used evicted (default: max_loras)"
    )

    def __post_init__(self) -> None:
        self._check_sizes()
        spec = self._check_speculation()
        self._check_parallel()
        self._check_kv_transfer()
        if self.kv_events_config is not None:
            KVEventsConfig.parse(self.kv_events_config)  # a ValueError naming the field
        self._check_lora()
        if self.draft_quantization and not (spec is not None and spec.needs_draft_model):
            raise ValueError(
                f"draft_quantization needs speculative_method={_any_of(methods_with_draft_model())}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
            )

    def _check_sizes(self) -> None:
        """Block, batch and context sizes against their ranges and limits."""
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                f"generation_config={self.generation_config!r} must be 'auto', 'vllm' or a folder holding "
                "generation_config.json"
            )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size={self.block_size} must be a power of two between 1 and 256")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction={self.kv_cache_memory_fraction} must be in (0, 1]")
        if self.max_num_seqs > self.seqs_limit:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} exceeds max_num_seqs_limit={self.seqs_limit}")
        if self.max_num_batched_tokens > self.batched_tokens_limit:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} exceeds "
                f"max_num_batched_tokens_limit={self.batched_tokens_limit}"
            )

    def _check_speculation(self) -> SpeculativeMethod | None:
        """The speculative method and its token counts; returns the method (None: no speculation)."""
        spec = method(self.speculative_method)  # refuses an unknown name, listing the known ones
        if spec is not None and spec.needs_draft_model and not self.draft_model:
            raise ValueError(f"speculative_method={spec.name!r} needs draft_model (a model source URI)")
        if not 0 <= self.num_speculative_tokens <= self.max_num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be between 0 and "
                f"max_num_speculative_tokens={self.max_num_speculative_tokens}"
            )
        if (
            not isinstance(self.speculative_disable_by_batch_size, int)
            or self.speculative_disable_by_batch_size < 0
        ):
            raise ValueError(
                f"speculative_disable_by_batch_size={self.speculative_disable_by_batch_size!r} must be "
                "an integer >= 0 (0: never disable)"
            )
        if spec is None and self.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens > 0 needs speculative_method {_any_of(METHODS)}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max={self.prompt_lookup_max} "
                "must satisfy 1 <= min <= max"
            )
        return spec

    def _check_parallel(self) -> None:
        """Tensor and pipeline sizes, and the quantizations they and the engine can run."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if size < 1:
                raise ValueError(f"{name}={size} must be >= 1")
        if tp > 1 and self.quantization not in (None, "int8"):
            raise ValueError(
                f"quantization={self.quantization!r} with tensor_parallel_size={tp}: its packed "
                "blocks (scales per block along the input dimension) are not sliced by head or MLP "
                "row; split it with pipeline_parallel_size instead, or use quantization='int8'"
            )
        for name, allowed in (
            ("quantization", QUANTIZATIONS),
            ("draft_quantization", DRAFT_QUANTIZATIONS),
            ("quantized_activations", QUANTIZED_ACTIVATIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")

    def _check_kv_transfer(self) -> None:
        """The KV connector's role, port and timeout of a disaggregated engine."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.kv_role not in (None, *KV_ROLES):
            raise ValueError(f"kv_role={self.kv_role!r} is not one of {KV_ROLES}")
        if self.kv_role is not None and (tp > 1 or pp > 1):
            raise ValueError(
                f"kv_role={self.kv_role!r} with tensor_parallel_size={tp} pipeline_parallel_size={pp}: "
                "the KV connector moves one process's cache; use 1 and 1 with it for now"
            )
        if not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError(f"kv_transfer_port={self.kv_transfer_port} must be between 0 and 65535")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s} must be > 0")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if self.enable_lora and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ValueError(
                "enable_lora with tensor_parallel_size or pipeline_parallel_size > 1: adapters are applied "
                "in one process's layers only; serve LoRA on an unsplit engine"
            )

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @property
    def seqs_limit(self) -> int:
        return self.max_num_seqs_limit or max(self.max_num_seqs, 256)

    @property
    def batched_tokens_limit(self) -> int:
        return self.max_num_batched_tokens_limit or max(self.max_num_batched_tokens, 8192)

    @property
    def speculative_tokens_limit(self) -> int:
        """Ceiling for the live k: none without a speculative method (there is no proposer)."""
        return self.max_num_speculative_tokens if self.speculative_method != NONE else 0


def check_live(config: EngineConfig, changes: Mapping[str, int]) -> None:
    """Refuse live knob values outside [the knob's minimum, its ceiling fixed at start by `config`],
    naming the field and the limit."""
    limits = live_limits(lambda knob: getattr(config, knob.ceiling))
    for name, value in changes.items():
        why = live_refusal(limits, name, value)
        if why is not None:
            raise ParameterError(name, why)


def start_on(config: EngineConfig, changes: Mapping[str, int]) -> EngineConfig:
    """`config` starting on other live values (checked as `check_live` does). The ceilings stay the ones
    `config` fixes: a lower start value must not lower a default ceiling with it."""
    check_live(config, changes)
    values: dict[str, Any] = dict(changes)
    return replace(
        config,
        max_num_seqs_limit=config.seqs_limit,
        max_num_batched_tokens_limit=config.batched_tokens_limit,
        **values,
    )
