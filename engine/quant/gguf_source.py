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
    keyed by the file's identity; readers see all or none (cache_dir.py)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
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
    values = config.to_dict()
    values.pop("quantization_config", None)
    values["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    values["torch_dtype"] = values["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(values, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
