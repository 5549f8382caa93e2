"""A GGUF model source for ``--quantization gguf``: the file itself, and a small folder beside it in the
cache with only what is not a weight (config.json, generation_config.json, the tokenizer).

model_source's conversion writes the whole model in float32 (transformers dequantizes every tensor first),
which is what the float32 engine reads. The quantized engine reads its weights from the GGUF tensor by
tensor (`gguf_file.read_state`), so it resolves the source here instead and never makes that folder: its
peak memory during load stays near the file's size, and the cache holds kilobytes, not an fp32 copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from specfleet.engine import model_source
from specfleet.engine.cache_dir import ensure_folder
from specfleet.engine.model_source import ResolvedModel

log = logging.getLogger("specfleet.engine.loader")

MARKER = "specfleet-gguf-metadata.json"  # written last: the folder is whole
# Part of a metadata folder's key: raised when what is written changes (2: completed_config), so that a folder
# written before is not read as this one.
METADATA_VERSION = 2


def gguf_file(source: str) -> tuple[Path, str] | None:
    """The GGUF file a model source names and the name it serves under, or None when it names a folder
    (the same rules as model_source.resolve_model, without converting anything)."""
    scheme, sep, rest = source.partition("://")
    if not sep:
        scheme, rest = "file", os.path.abspath(source)
    if scheme == "bundled":
        return model_source._bundled_gguf(rest), rest
    if scheme not in model_source.SOURCES:
        return None  # resolve_model gives the error
    path = model_source.SOURCES[scheme](rest, source)
    if path.is_file() and path.suffix == ".gguf":
        return path, path.stem
    return None


def resolve_gguf(source: str) -> ResolvedModel | None:
    """The source as a metadata-only folder plus its GGUF file; None when it is not a GGUF file."""
    found = gguf_file(source)
    if found is None:
        return None
    gguf, name = found
    return ResolvedModel(source, metadata_folder(gguf), name, gguf)


def resolve_source(source: str, quantization: str | None) -> ResolvedModel:
    """What a process that serves `source` reads: with ``--quantization gguf`` and a GGUF file, the
    metadata-only folder (the engine's loader, the API server's tokenizer); otherwise resolve_model's
    folder (a GGUF file converted to float32 once)."""
    if quantization == "gguf":
        resolved = resolve_gguf(source)
        if resolved is not None:
            return resolved
    return model_source.resolve_model(source)


def metadata_folder(gguf: Path) -> Path:
    """config.json, generation_config.json and the tokenizer of a GGUF file, made once across processes,
    keyed by the file's identity and how the folder is written; readers see all or none (cache_dir.py)."""
    stat = gguf.stat()
    identity = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}:{METADATA_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = model_source.cache_root() / "models" / f"{gguf.stem}-{key}-metadata"

    def write(folder: Path) -> None:
        log.info("event=gguf_metadata file=%s target=%s", gguf, target)
        _write_metadata(gguf, folder)
        (folder / MARKER).write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size}))

    return ensure_folder(target, write, marker=MARKER)


def _write_metadata(gguf: Path, folder: Path) -> None:
    """What model_source's conversion writes besides the weights, read from the GGUF's metadata alone."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    values = completed_config(gguf, config.to_dict())
    values.pop("quantization_config", None)
    values["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[values["model_type"]]]
    values["torch_dtype"] = values["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(values, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def completed_config(gguf: Path, values: dict) -> dict:
    """transformers' config of a GGUF file with what its GGUF loader leaves out, from the file's own metadata
    as llama.cpp's converter writes it:
    - head_dim from ``attention.key_length`` (Qwen3's GGUF config keeps its class default, 128) and
      Qwen3-MoE's expert width from ``expert_feed_forward_length`` (its class default is 768);
    - Phi-3's partial rotary from ``rope.dimension_count`` and LongRoPE from the ``rope_factors_long`` and
      ``rope_factors_short`` tensors with ``rope.scaling.original_context_length`` and ``attn_factor``;
    - Gemma's soft-caps (``attn_logit_softcapping``, ``final_logit_softcapping``) and Gemma 3's sliding
      layers' RoPE base (``rope.freq_base_swa``);
    - Mixtral, which the converter writes as a ``llama`` file with ``expert_count``: a Mixtral config.
    What the file does not carry stays transformers' default, as in transformers' own GGUF loader: Gemma's
    ``query_pre_attn_scalar`` (256) and layer pattern (Gemma 2 alternating, Gemma 3 five sliding to one
    full), Gemma 3's RoPE scaling, Qwen3-MoE's ``norm_topk_prob`` (llama.cpp always renormalises it)."""
    from specfleet.engine.quant.gguf_file import read_float_tensor, scalar_metadata

    meta = scalar_metadata(gguf)
    arch = str(meta.get("general.architecture", ""))

    def key(name: str):
        return meta.get(f"{arch}.{name}")

    out = dict(values)
    key_length = key("attention.key_length")
    if key_length is not None and "head_dim" in out:
        out["head_dim"] = int(key_length)
    expert_length = key("expert_feed_forward_length")
    if expert_length is not None and "moe_intermediate_size" in out:
        out["moe_intermediate_size"] = int(expert_length)
    if arch == "phi3":
        head_dim = out["hidden_size"] // out["num_attention_heads"]
        rope_dims = key("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) < head_dim:
            out["partial_rotary_factor"] = int(rope_dims) / head_dim
        long, short = (read_float_tensor(gguf, f"rope_factors_{w}.weight") for w in ("long", "short"))
        if long is not None and short is not None:
            original = int(key("rope.scaling.original_context_length") or out["max_position_embeddings"])
            rope = {
                "rope_type": "longrope",
                "rope_theta": float(key("rope.freq_base") or 10000.0),
                "long_factor": long.tolist(),
                "short_factor": short.tolist(),
                "original_max_position_embeddings": original,
            }
            if key("rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = float(key("rope.scaling.attn_factor"))
            if "partial_rotary_factor" in out:
                rope["partial_rotary_factor"] = out["partial_rotary_factor"]
            out["original_max_position_embeddings"] = original
            out["rope_parameters"] = out["rope_scaling"] = rope
    if arch in ("gemma2", "gemma3"):
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key(name) is not None:
                out[name] = float(key(name))
        local = key("rope.freq_base_swa")
        layered = out.get("rope_parameters")
        if (
            local is not None
            and isinstance(layered, dict)
            and isinstance(layered.get("sliding_attention"), dict)
        ):
            out["rope_parameters"] = {
                **layered,
                "sliding_attention": {**layered["sliding_attention"], "rope_theta": float(local)},
            }
    if arch == "llama" and int(key("expert_count") or 0) > 0:
        from transformers import MixtralConfig

        fields = set(MixtralConfig().to_dict())
        mixtral = {k: v for k, v in out.items() if k in fields and k not in ("model_type", "architectures")}
        mixtral.update(
            num_local_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count"))
        )
        mixtral["sliding_window"] = None
        out = MixtralConfig(**mixtral).to_dict()
    return out
