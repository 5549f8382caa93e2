"""Build what an engine runs from its config: the device and dtype, the model (whole, or split over worker
processes) from the folder's checkpoint (`checkpoint.py`, the folder from `model_source.py`), and the KV
cache size."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from specfleet.engine.block_manager import SlidingLayers
from specfleet.engine.checkpoint import (
    checkpoint_quantization,
    checkpoint_state,
    eos_ids,
    load_hf_config,
    load_tokenizer,
    read_generation_config,
    sampling_defaults,
)
from specfleet.engine.config import EngineConfig
from specfleet.engine.heap import release_free_memory
from specfleet.engine.models import model_class
from specfleet.engine.models.llama import LlamaArgs, LlamaModel, rope_context
from specfleet.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch.distributed and multiprocessing load only for a split model
    from specfleet.engine.distributed.workers import SplitModel

log = logging.getLogger("specfleet.engine.loader")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_GIB = 2.0


@dataclass
class LoadedModel:
    model: LlamaModel | SplitModel  # SplitModel: tensor or pipeline parallel, rank 0's side
    tokenizer: Tokenizer
    name: str
    max_model_len: int
    eos_token_ids: set[int]
    # request defaults from generation_config.json (--generation-config; checkpoint.sampling_defaults)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(config: EngineConfig, device: torch.device | None = None) -> LoadedModel:
    resolved = _resolve(config)
    device = device or pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    hf_config = load_hf_config(resolved.path)
    tokenizer = load_tokenizer(resolved.path)
    cls = model_class(hf_config.architectures)
    max_model_len = _max_model_len(config, hf_config, getattr(cls, "has_sliding_window", False))
    quantization = checkpoint_quantization(config.quantization, hf_config, resolved.path)
    on_cuda_ok = quantization in ("awq", "gptq") and device.type == "cuda"
    if quantization and not on_cuda_ok and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"quantization={quantization!r} runs on the native CPU kernels: it needs "
            f"device cpu and dtype float32, not {device.type} {dtype}"
        )
    if quantization == "gguf" and resolved.gguf is None:
        raise ValueError(
            f"quantization='gguf' needs a GGUF model (a .gguf file or bundled://), not {config.model!r}"
        )
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    split = ("tensor", tp) if tp > 1 else ("pipeline", pp) if pp > 1 else None
    if split is not None:
        _check_split_support(config, quantization, cls, hf_config.architectures, split)
        _check_split(hf_config, tp, pp)
        from specfleet.engine.distributed.workers import SplitModel

        model = SplitModel(
            str(resolved.path),
            tp,
            pp,
            dtype,
            device,
            quantization=quantization,
            gguf=str(resolved.gguf) if resolved.gguf else None,
            max_model_len=max_model_len,
        )
    else:
        model = cls(
            hf_config,
            _state(resolved, hf_config, quantization),
            dtype,
            device,
            quantize=quantization,
            activations=config.quantized_activations,
            max_model_len=max_model_len,
        )
    # The last layers' and the head's load temporaries are freed but, below live memory, stay resident
    # (12 MB after SmolLM2's Q4_K_M, 22 MB after its Q4_1; engine/heap.py): give them back before the KV
    # cache and serving.
    release_free_memory()
    generation = read_generation_config(resolved.path)  # read once: the eos ids and the request defaults
    return LoadedModel(
        model,
        tokenizer,
        resolved.name,
        max_model_len,
        eos_ids(resolved.path, hf_config, tokenizer, generation),
        sampling_defaults(resolved.path, config.generation_config, generation),
    )


def _max_model_len(config: EngineConfig, hf_config, sliding: bool = False) -> int:
    """--max-model-len, or the model's context; refused past that context. `sliding`: the model runs its
    sliding-window layers as such (Gemma), so its whole context is exact."""
    context, source = rope_context(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    if window and not sliding and getattr(hf_config, "use_sliding_window", True) and window < context:
        # attention here is full: stay where that is exact
        context, source = window, f"sliding_window={window}, attention here is full"
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's context of {context} tokens ({source})"
        )
    return max_model_len


def _check_split_support(
    config: EngineConfig,
    quantization: str | None,
    cls: type,
    architectures: list[str],
    split: tuple[str, int],
) -> None:
    """Refuse a tensor- or pipeline-parallel engine over what the split workers cannot run."""
    tp = config.tensor_parallel_size
    if tp > 1 and quantization not in (None, "int8"):  # an AWQ/GPTQ checkpoint's own is only known here
        raise ValueError(
            f"tensor_parallel_size={tp}: quantization={quantization!r} packs weights in blocks "
            "along the input dimension with per-block scales, which are not sliced by head or "
            "MLP row; split it with pipeline_parallel_size instead (whole layers per stage), "
            "or use quantization='int8'"
        )
    if quantization not in (None, "int8") and config.quantized_activations != "int8":
        # The stage workers build their layers with the default activation path.
        raise ValueError(
            f"quantized_activations={config.quantized_activations!r}: split engines run "
            f"{quantization} weights with int8 activations only; use tensor_parallel_size=1 "
            "and pipeline_parallel_size=1 for the exact float32 path"
        )
    why = getattr(cls, "split_refused", None)
    if why:
        raise ValueError(f"{split[0]}_parallel_size={split[1]}: architecture {architectures}: {why}")
    if not issubclass(cls, LlamaModel):
        raise ValueError(
            f"{split[0]}_parallel_size={split[1]}: architecture {architectures} cannot be split yet"
        )


def _resolve(config: EngineConfig):
    """The model's folder; for ``--quantization gguf`` over a GGUF file, a folder without weights (they are
    read from the file tensor by tensor, gguf_source.py), never the float32 conversion."""
    from specfleet.engine.quant.gguf_source import resolve_source

    return resolve_source(config.model, config.quantization)


def _check_split(hf_config, tp: int, pp: int) -> None:
    """Refuse sizes the model's shapes cannot be split by here, before any worker process starts (each rank
    would refuse them too, but only once all of them had been spawned)."""
    from specfleet.engine.distributed.pipeline import stage_layers
    from specfleet.engine.distributed.sharding import check_size

    a = LlamaArgs.from_hf(hf_config)
    check_size(a.num_heads, a.num_kv_heads, a.intermediate_size, tp)
    stage_layers(a.num_layers, pp, 0)


def _state(resolved, hf_config, quantization: str | None) -> Mapping:
    """The single model's weights. GGUF: read lazily, as the model takes each layer's tensors (GGUFState), so
    loading holds the packed model plus one layer's decoded tensors."""
    if quantization == "gguf":
        from specfleet.engine.quant.gguf_file import read_state

        assert resolved.gguf is not None, (
            "quantization='gguf' comes with the GGUF file it reads (resolve_gguf)"
        )
        return read_state(resolved.gguf, hf_config)
    return checkpoint_state(resolved.path, resolved.gguf, hf_config, quantization)


def bytes_per_block(model: LlamaModel | SplitModel, block_size: int) -> int:
    """K and V of every layer for one block of `block_size` tokens."""
    a = model.args
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * torch.finfo(model.dtype).bits // 8


def kv_cache_blocks(
    config: EngineConfig,
    models: list[LlamaModel | SplitModel],
    max_model_len: int,
    device: torch.device,
    mem_get_info=None,
    sliding: SlidingLayers | None = None,
) -> int:
    """Blocks for the KV caches of `models` (the target and, with a draft proposer, the draft: one block id
    addresses a block in each cache, so both are budgeted together from one memory fraction). With
    `sliding`, the target's sliding-window layers have a pool of their own (`sliding.num_blocks`, set here)
    and the blocks returned are the other layers'. A memory budget is split so that the sliding pool holds
    the windows of as many sequences as the full layers' blocks hold at max_model_len (at most the live
    max_num_seqs ceiling, beyond which the rest goes to the full layers): long contexts then run as many at
    once in both pools, while short ones (within a window, which need as many sliding blocks as full ones)
    are bounded by the sliding pool. `num_kv_blocks` fixes the full layers' blocks; the sliding pool then
    holds the windows of the live limits.

    Refuses to start, as vLLM does, when the cache cannot hold one sequence of `max_model_len` tokens: such
    a sequence would otherwise preempt itself forever and block everything queued behind it."""
    per_block = sum(bytes_per_block(m, config.block_size) for m in models)
    per_seq = -(-max_model_len // config.block_size)
    useful = config.seqs_limit * per_seq + 1  # more blocks than every sequence at full length is waste
    per_sliding, need = 0, 0
    if sliding is not None:
        per_sliding = (
            bytes_per_block(models[0], config.block_size) * len(sliding.layers) // models[0].args.num_layers
        )
        per_block -= per_sliding
        need = sliding_blocks_needed(config, sliding.window)
    if config.num_kv_blocks is not None:
        blocks, source = config.num_kv_blocks, f"num_kv_blocks={config.num_kv_blocks} (--num-kv-blocks)"
        budget = None
    elif device.type == "cuda":
        free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
        budget = max(0, free - (1 - config.kv_cache_memory_fraction) * total)
        source = (
            f"kv_cache_memory_fraction={config.kv_cache_memory_fraction} (--kv-cache-memory-fraction), "
            f"{budget / 2**30:.2f} GiB for {len(models)} cache(s)"
        )
    else:
        gib = config.kv_cache_gib if config.kv_cache_gib is not None else DEFAULT_CPU_KV_GIB
        budget = gib * 2**30
        source = f"kv_cache_gib={gib} (--kv-cache-gib), {len(models)} cache(s)"
    if budget is not None:
        if sliding is not None:
            need = _sliding_share(config, sliding.window, budget, per_seq * per_block, per_sliding)
        # the sliding pool first (its null block included), the rest for the full layers
        blocks = int(min(useful, (budget - (need + 1) * per_sliding) // per_block))
        if blocks < need:  # too little for one sequence in both pools: equal counts, as full retention has
            blocks = int(min(useful, (budget - per_sliding) // (per_block + per_sliding)))
        if device.type != "cuda":
            blocks = max(1, blocks)
    if blocks < per_seq:
        raise ValueError(
            f"the KV cache holds {blocks} blocks of {config.block_size} tokens ({blocks * config.block_size} tokens, "
            f"from {source}), fewer than one sequence of max_model_len={max_model_len} needs ({per_seq} blocks): "
            f"give the cache more memory or lower max_model_len (--max-model-len {blocks * config.block_size})"
        )
    if sliding is not None:
        sliding.num_blocks = min(blocks, need) + 1
    return blocks


def sliding_layers(model: LlamaModel | SplitModel, max_model_len: int) -> SlidingLayers | None:
    """The model's sliding-window layers (Gemma 2/3), or None: no such layers, a window that a sequence
    never outgrows (the pool would only duplicate the full one), or every layer sliding (a Gemma 3 of fewer
    than six layers: the full pool would hold no layer to size it by, so all keep the whole sequence)."""
    window = getattr(model, "window", None)
    layers = frozenset(getattr(model, "sliding_layer_indices", lambda: ())())
    if window is None or not layers or window >= max_model_len or len(layers) >= model.args.num_layers:
        return None
    return SlidingLayers(layers, window)


def _sliding_share(config: EngineConfig, window: int, budget: float, seq_bytes: int, per_sliding: int) -> int:
    """The sliding pool of a memory budget: the windows of as many sequences as the full layers then hold
    at max_model_len (`seq_bytes` each), within the live max_num_seqs ceiling."""
    fixed = sliding_blocks_needed(config, window, seqs=0) + 1  # one step's chunk, and the null block
    per_window = sliding_blocks_needed(config, window, seqs=1) - fixed + 1
    fit = int((budget - fixed * per_sliding) // (seq_bytes + per_window * per_sliding))
    return sliding_blocks_needed(config, window, seqs=min(config.seqs_limit, max(1, fit)))


def sliding_blocks_needed(config: EngineConfig, window: int, seqs: int | None = None) -> int:
    """Sliding blocks that `seqs` sequences (default: as many as the live limits allow) hold at once: each
    its window before its next query (blocks_for(window - 1) + 1 when the window starts inside a block) and
    one more for a decode or verification step, plus one step's whole token budget of new tokens (a
    prefill chunk)."""
    per_seq = -(-(window - 1) // config.block_size) + 2
    seqs = config.seqs_limit if seqs is None else seqs
    return seqs * per_seq + -(-config.batched_tokens_limit // config.block_size)
