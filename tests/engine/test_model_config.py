"""A checkpoint's config as the engine reads it: transformers' normalized form, kept under the cache root so
that later loads (each engine start, each tensor-parallel worker) need not import transformers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from specfleet.engine.checkpoint import ModelConfig, load_hf_config
from specfleet.engine.models.llama import LlamaArgs, rope_tables
from specfleet.engine.python_child import python_command
from transformers import AutoConfig

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECFLEET_CACHE", str(cache))
    return cache


def _checkpoint(path: Path, kind: str, **overrides: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tiny_config(kind, **overrides).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_the_engine_reads_what_transformers_reads_first_and_cached(tmp_path: Path, kind: str) -> None:
    path = _checkpoint(tmp_path / kind, kind)
    oracle = AutoConfig.from_pretrained(path)
    first, again = load_hf_config(path), load_hf_config(path)
    assert list((tmp_path / "cache" / "configs").glob("*.json")), "the normalized config was not kept"
    assert first == again and isinstance(again, ModelConfig)
    assert again.to_dict() == json.loads(oracle.to_json_string(use_diff=False))
    assert LlamaArgs.from_hf(again) == LlamaArgs.from_hf(oracle)
    assert again.architectures == oracle.architectures and again.model_type == kind


def test_an_edited_config_is_read_again(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "m", "llama")
    assert load_hf_config(path).num_hidden_layers == 2
    _checkpoint(path, "llama", num_hidden_layers=3)
    assert load_hf_config(path).num_hidden_layers == 3


def test_a_non_default_rope_is_computed_by_transformers_from_the_plain_config(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "rope", "llama", rope_scaling=LLAMA3_ROPE)
    plain, oracle = load_hf_config(path), AutoConfig.from_pretrained(path)
    for ours, theirs in zip(rope_tables(plain, 16, 256), rope_tables(oracle, 16, 256), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    default = rope_tables(load_hf_config(_checkpoint(tmp_path / "plain", "llama")), 16, 256)
    assert not torch.equal(default[0], rope_tables(plain, 16, 256)[0])  # the scaling did change the tables


@pytest.mark.slow
def test_a_cached_config_loads_without_transformers(tmp_path: Path, own_cache: Path) -> None:
    """What a tensor-parallel worker does on start: its rank 0 has read the config already."""
    path = _checkpoint(tmp_path / "m", "qwen2")
    expected = load_hf_config(path).to_dict()
    probe = (
        "import json, sys; from pathlib import Path; "
        "import specfleet.engine.distributed.workers, specfleet.engine.loader; "
        "from specfleet.engine.checkpoint import load_hf_config; "
        f"c = load_hf_config(Path({str(path)!r})); "
        "print(json.dumps({'transformers': 'transformers' in sys.modules, 'config': c.to_dict()}))"
    )
    done = subprocess.run(
        python_command("-c", probe),
        capture_output=True,
        text=True,
        timeout=120,
        env={"SPECFLEET_CACHE": str(own_cache), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out == {"transformers": False, "config": expected}


def test_an_unwritable_cache_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("SPECFLEET_CACHE", str(blocker))  # configs/ cannot be made under a file
    assert load_hf_config(_checkpoint(tmp_path / "m", "llama")).hidden_size == 64
