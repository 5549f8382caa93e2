"""What a local model folder holds, read for the engine: config.json (as transformers normalizes it, kept
as a plain `ModelConfig`), the tokenizer, the weights (float tensors, or `QuantTensor`s for GGUF, AWQ and
GPTQ), the quantization they run as, and the end-of-sequence ids.

The folder comes from `model_source.resolve_model`; `loader.load_model` builds the model from what this
module reads, and each rank of a split model (`distributed/workers.py`) reads its own copy through it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from specfleet.engine.cache_dir import CacheError, cache_root, ensure_file
from specfleet.engine.errors import UnsupportedModel
from specfleet.engine.heap import release_free_memory
from specfleet.engine.models import ARCHITECTURES
from specfleet.engine.sampling_params import GENERATION_DEFAULT_FIELDS, ParameterError, SamplingParams
from specfleet.engine.tokenizer import Tokenizer

log = logging.getLogger("specfleet.engine.loader")


class ModelConfig(SimpleNamespace):
    """A checkpoint's configuration as transformers reads it (defaults filled in, RoPE parameters
    standardized), held as plain attributes: what the model classes read, loaded without transformers."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def to_transformers(self) -> Any:
        """The transformers config object, for transformers' own functions (a non-default RoPE's tables)."""
        from transformers import AutoConfig

        values = self.to_dict()
        return AutoConfig.for_model(values.pop("model_type"), **values)


def load_hf_config(path: Path) -> ModelConfig:
    """config.json as transformers normalizes it. The normalized form is kept under the cache root, keyed by
    the file's bytes and transformers' version, so later loads (each engine start, each tensor- or
    pipeline-parallel worker) skip transformers' config classes, whose import took 2-6 s on one core.

    An unsupported `architectures` is refused from the file itself, before transformers reads it: a model
    type transformers does not know, or one whose config is the repository's own code (`auto_map`:
    InternLM2, ChatGLM), would otherwise fail inside transformers (or ask on a terminal whether to run
    that code) without naming what this engine runs."""
    _check_architectures(path, _raw_config(path).get("architectures"))
    config = ModelConfig(**_normalized_config(path))
    _check_architectures(path, getattr(config, "architectures", None) or config.model_type)
    return config


def _raw_config(path: Path) -> dict[str, Any]:
    """config.json as the file holds it ({} when there is none or it is not a JSON object: transformers'
    own reading then says what is wrong)."""
    try:
        values = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def _check_architectures(path: Path, archs: Any) -> None:
    """Refuse a config none of whose `architectures` is registered (None: the file names none, so leave it
    to the normalized config, which transformers may fill in)."""
    if archs is None:
        return
    names = archs if isinstance(archs, list) else [archs]
    if not any(a in ARCHITECTURES for a in names):
        raise UnsupportedModel(
            f"model at {path}: config.json architectures={archs!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )


def _normalized_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():  # transformers' own error names what is missing
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path)
    raw = file.read_bytes()
    key = hashlib.sha256(raw + importlib.metadata.version("transformers").encode()).hexdigest()[:16]
    cached = cache_root() / "configs" / f"{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())

    def normalize() -> dict[str, Any]:
        from transformers import AutoConfig

        return json.loads(AutoConfig.from_pretrained(path).to_json_string(use_diff=False))

    try:
        ensure_file(cached, lambda out: out.write_text(json.dumps(normalize())))
    except CacheError as exc:  # a read-only cache costs the import on every start, nothing else
        log.warning("event=config_cache_unwritable path=%s error=%s", cached, exc)
        return normalize()
    return json.loads(cached.read_text())


def load_tokenizer(path: Path) -> Tokenizer:
    """The folder's tokenizer. AutoTokenizer is handed the normalized config (`load_hf_config`'s cache):
    without it, it loads the config with transformers' own classes, whose import (torch.distributed,
    accelerate, sympy) adds about 100 MB to every engine process's memory for nothing it keeps. An
    unsupported `architectures` is refused here too, before transformers reads the config: the server loads
    the tokenizer while its engine core loads the model, and transformers would ask a remote-code config's
    question on the server's terminal."""
    from transformers import AutoTokenizer

    config = load_hf_config(path) if (path / "config.json").is_file() else None
    tokenizer = AutoTokenizer.from_pretrained(path, config=config)
    # Parsing tokenizer.json frees more than the tokenizer keeps (SmolLM2's 49k-token BPE: 56 MB resident
    # after the load, 24 MB once the freed heap is returned); what glibc would keep stays with the system.
    release_free_memory()
    return tokenizer


SHARD_INDEX = "model.safetensors.index.json"  # transformers' name for a sharded checkpoint's weight map


def weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold the model's weights: those `model.safetensors.index.json` maps
    weights to when the folder has one, else every *.safetensors. The index decides because Hub folders
    can hold other weights beside the shards: Mistral's repositories also ship `consolidated.safetensors`,
    the whole model again under mistral-inference's names, which read too would double load time and
    memory."""
    index = path / SHARD_INDEX
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index}: not a shard index with a weight_map object ({exc!r})") from exc
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ValueError(f"{index} maps weights to {missing}, which the folder does not hold")
    return [path / n for n in names]


def load_state_dict(path: Path) -> dict:
    from safetensors.torch import load_file

    files = weight_files(path)
    if not files:
        raise ValueError(f"model at {path}: no *.safetensors weights found (convert .bin weights first)")
    state: dict = {}
    for f in files:
        state.update(load_file(f))
    return state


def read_generation_config(folder: Path) -> dict[str, Any]:
    """A folder's generation_config.json as a dict ({} when it has none)."""
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        values = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(values).__name__}")
    return values


def eos_ids(path, hf_config, tokenizer, generation_config: dict[str, Any] | None = None) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    gen = read_generation_config(path) if generation_config is None else generation_config
    sources.append(gen.get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder holding generation_config.json


def sampling_defaults(model_folder: Path, mode: str, generation_config: dict[str, Any]) -> dict[str, Any]:
    """The request defaults `--generation-config` asks for: `vllm`, none (SamplingParams' own); `auto`,
    those the model folder's generation_config.json (`generation_config`, read once by the loader) sets;
    a folder, those of the generation_config.json in it. Checked here as SamplingParams checks a request,
    so a file a request could not say is an error at start, naming the file and the field."""
    if mode == "vllm":
        return {}
    source = Path(model_folder) / "generation_config.json"
    if mode != "auto":
        source = Path(mode) / "generation_config.json"
        if not source.is_file():
            raise ValueError(
                f"generation_config={mode!r}: no generation_config.json in that folder; give a folder "
                f"that holds one, or {' or '.join(map(repr, GENERATION_CONFIG_MODES))}"
            )
        generation_config = read_generation_config(Path(mode))
    defaults = {
        name: generation_config[name]
        for name, hf_default in GENERATION_DEFAULT_FIELDS.items()
        if generation_config.get(name) is not None and generation_config[name] != hf_default
    }
    try:
        SamplingParams(**defaults)
    except (ParameterError, TypeError) as exc:
        raise ValueError(
            f"{source}: {exc}; fix the file or start with generation_config='vllm' to ignore it"
        ) from exc
    return defaults


def checkpoint_state(path: Path, gguf: Path | None, hf_config, quantization: str | None) -> dict:
    """The weights by name: float tensors, with the quantized ones as `QuantTensor`s (GGUF, AWQ, GPTQ).
    Each rank of a split model reads its own copy through this. GGUF: every tensor from the file (the
    folder may hold no weights), decoded at once: a rank takes its stage's layers from the whole."""
    if quantization == "gguf":
        from specfleet.engine.quant.gguf_file import read_state

        assert gguf is not None, "quantization='gguf' comes with the GGUF file it reads (resolve_gguf)"
        return dict(read_state(gguf, hf_config))
    state = load_state_dict(path)
    if quantization in ("awq", "gptq"):
        from specfleet.engine.quant.awq_gptq import quantized_state

        state = quantized_state(state, hf_config.quantization_config)
    return state


def checkpoint_quantization(requested: str | None, hf_config, path) -> str | None:
    """The quantization to run: the requested one, or an AWQ/GPTQ checkpoint's own (its weights exist only
    quantized, as in vLLM). A request that contradicts the checkpoint is refused."""
    qconfig = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict()
    method = qconfig.get("quant_method")
    if method in ("awq", "gptq"):
        if requested not in (None, method):
            raise ValueError(
                f"quantization={requested!r} but the model at {path} is a {method} checkpoint; "
                f"use quantization={method!r} or leave it unset"
            )
        return method
    if requested in ("awq", "gptq"):
        raise ValueError(
            f"quantization={requested!r} needs a {requested} checkpoint (config.json "
            f"quantization_config.quant_method={requested!r}); the model at {path} has {method!r}"
        )
    return requested
