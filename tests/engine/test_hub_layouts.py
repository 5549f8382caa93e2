"""Checkpoints in the layouts the Hub publishes them, against transformers as the oracle: a sharded folder whose
`model.safetensors.index.json` decides which files are weights (Mistral's repositories also ship
`consolidated.safetensors`), the same folder from a Hugging Face cache (`hf://`, served as `org/name`),
LongRoPE on a Llama-family model past its original window, YaRN's extended context (Qwen2.5's 128K recipe),
o_proj and MLP biases (`attention_bias`, `mlp_bias`); what is refused at start with the field named: an
`architectures` transformers cannot even read (a model type it does not know, a config that is the
repository's own code), a RoPE type no builder exists for, a max_model_len past the context, biases tensor
parallelism does not split; and the warning that names a layer tensor the model does not read.

Tiny random checkpoints (2 layers, hidden 64, the bundled tokenizer) built here; greedy tokens compared token
for token with transformers' `generate` on the same folder. What this does not model: the Hub's download
itself (folders are local, as `hf://` reads them from the cache) and real sizes (a doubled 7B load is
asserted here as the extra file's keys being read, not as memory).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import copy_tokenizer, tiny_config, tiny_model
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.checkpoint import SHARD_INDEX, load_hf_config, load_state_dict

STEPS = 16


def hf_greedy(path: Path, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of `prompt` from the saved folder (eos ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def engine_greedy(path: Path, prompt: list[int], **kwargs) -> list[int]:
    llm = LLM(model=f"file://{path}", block_size=4, **kwargs)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
        return list(out[0].outputs[0].token_ids)
    finally:
        llm.close()


def save(path: Path, kind: str, bundled_path: Path, **overrides) -> Path:
    tiny_model(tiny_config(kind, **overrides), std=0.2).save_pretrained(path, max_shard_size="2MB")
    copy_tokenizer(bundled_path, path)
    return path


@pytest.fixture(scope="module")
def mistral_hub_folder(bundled_path, tmp_path_factory) -> Path:
    """A Mistral checkpoint as its Hub repositories lay it out: safetensors shards with their index, and
    `consolidated.safetensors`, the same model under mistral-inference's names (`layers.0.attention.wq`,
    `tok_embeddings`, `norm`, `output`), here with other values, so reading it shows."""
    from safetensors.torch import save_file

    path = save(tmp_path_factory.mktemp("mistral-hub"), "mistral", bundled_path)
    assert len(json.loads((path / SHARD_INDEX).read_text())["weight_map"]) > 0
    assert len(list(path.glob("model-*.safetensors"))) > 1
    native = {
        "tok_embeddings.weight": torch.randn(49152, 64),
        "norm.weight": torch.full((64,), 3.0),  # the name the engine reads the final norm by, unprefixed
        "output.weight": torch.randn(49152, 64),
        "layers.0.attention.wq.weight": torch.randn(64, 64),
    }
    save_file(native, str(path / "consolidated.safetensors"))
    return path


def test_shard_index_decides_the_weight_files(mistral_hub_folder):
    index = json.loads((mistral_hub_folder / SHARD_INDEX).read_text())["weight_map"]
    assert set(load_state_dict(mistral_hub_folder)) == set(index)


def test_mistral_hub_folder_matches_transformers(mistral_hub_folder):
    prompt = [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 19, 23]
    assert engine_greedy(mistral_hub_folder, prompt) == hf_greedy(mistral_hub_folder, prompt)


def test_shard_index_naming_a_missing_shard_is_refused(tmp_path, bundled_path):
    path = save(tmp_path, "llama", bundled_path)
    next(path.glob("model-*.safetensors")).unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json maps weights to \['model-"):
        load_state_dict(path)


def test_llama_longrope_past_its_original_window_matches_transformers(tmp_path, bundled_path):
    """LongRoPE's long factors once a sequence is past original_max_position_embeddings (16 here): the
    engine's context (256) is, so its table takes them, as transformers does for this 20-token prompt."""
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [1.0 + 0.5 * i for i in range(8)],
        "original_max_position_embeddings": 16,
    }
    path = save(tmp_path, "llama", bundled_path, rope_scaling=rope)
    prompt = [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 19, 23, 88, 90, 91, 92, 93, 5000, 42, 43]
    assert engine_greedy(path, prompt) == hf_greedy(path, prompt)


def with_config(source: Path, folder: Path, **fields) -> Path:
    """A copy of `source` whose config.json also holds `fields`."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


@pytest.mark.parametrize(
    "fields",
    [
        # a model type transformers does not know (it would say to upgrade transformers)
        {"architectures": ["FooForCausalLM"], "model_type": "foo"},
        # a config that is the repository's own code (transformers would ask on a terminal to run it)
        {
            "architectures": ["InternLM2ForCausalLM"],
            "model_type": "internlm2",
            "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"},
        },
        # known to transformers, not run here
        {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"},
    ],
    ids=["unknown-model-type", "remote-code", "known-to-transformers"],
)
def test_unsupported_architecture_is_refused_naming_it(mistral_hub_folder, tmp_path, fields):
    folder = with_config(mistral_hub_folder, tmp_path / "m", **fields)
    name = fields["architectures"][0]
    with pytest.raises(
        ValueError, match=rf"architectures=\['{name}'\] is not supported; supported: .*LlamaForCausalLM"
    ):
        load_hf_config(folder)
    with pytest.raises(ValueError, match=rf"architectures=\['{name}'\] is not supported"):
        LLM(model=f"file://{folder}", block_size=4)


@pytest.mark.parametrize("rope_type", ["mrope", "ntk-by-parts"])
def test_unknown_rope_type_is_refused_naming_the_field(mistral_hub_folder, tmp_path, rope_type):
    folder = with_config(
        mistral_hub_folder, tmp_path / "m", rope_scaling={"rope_type": rope_type, "factor": 2.0}
    )
    with pytest.raises(
        ValueError,
        match=rf"rope_scaling rope_type='{rope_type}' is not supported; supported: default, linear",
    ):
        LLM(model=f"file://{folder}", block_size=4)


def test_yarn_extended_context_matches_transformers(tmp_path, bundled_path):
    """Qwen2.5's way to 128K: `rope_scaling` yarn, factor 4 over original_max_position_embeddings, with
    max_position_embeddings left at the original (32 here). The engine's context is 32 x 4 and a sequence
    past 32 runs as transformers runs it, token for token; past 128 it is refused naming the fields."""
    rope = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path = save(tmp_path, "qwen2", bundled_path, max_position_embeddings=32, rope_scaling=rope)
    prompt = [(7 * i + 3) % 5000 for i in range(40)]
    assert engine_greedy(path, prompt, max_model_len=128) == hf_greedy(path, prompt)
    with pytest.raises(
        ValueError,
        match=r"max_model_len=129 exceeds the model's context of 128 tokens \(rope_scaling yarn "
        r"original_max_position_embeddings=32 x factor=4.0\)",
    ):
        LLM(model=f"file://{path}", block_size=4, max_model_len=129)


@pytest.mark.parametrize(
    "kind, fields, source",
    [
        ("llama", {"max_position_embeddings": 64}, r"max_position_embeddings=64"),
        # Mistral 7B v0.1's window: attention here is full, so the context stops at the window
        ("mistral", {"sliding_window": 64}, r"sliding_window=64, attention here is full"),
    ],
    ids=["max_position_embeddings", "sliding_window"],
)
def test_max_model_len_past_the_context_is_refused_naming_the_field(
    tmp_path, bundled_path, kind, fields, source
):
    path = save(tmp_path, kind, bundled_path, **fields)
    with pytest.raises(
        ValueError, match=rf"max_model_len=65 exceeds the model's context of 64 tokens \({source}\)"
    ):
        LLM(model=f"file://{path}", block_size=4, max_model_len=65)


def hf_cache_snapshot(cache: Path, repo: str, folder: Path, revision: str = "ab" * 20) -> None:
    """`folder` laid out in `cache` as huggingface_hub's download leaves a repository: each file a blob named
    by its hash, the snapshot folder of `revision` symbolic links to them, refs/main naming the revision."""
    import hashlib

    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, root / "blobs" / blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))


def test_hf_cache_snapshot_serves_under_the_repository_name(mistral_hub_folder, tmp_path, monkeypatch):
    """hf://org/name from the local cache (the snapshot's shards and index are links into blobs/): served as
    `org/name`, as vLLM names it (it was the snapshot's commit hash), and token for token as transformers."""
    import huggingface_hub.constants
    from specfleet.engine.model_source import resolve_model

    hf_cache_snapshot(tmp_path / "hub", "mistralai/Tiny-Mistral", mistral_hub_folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    resolved = resolve_model("hf://mistralai/Tiny-Mistral")
    assert resolved.path.name == "ab" * 20 and (resolved.path / SHARD_INDEX).is_symlink()
    assert resolved.name == "mistralai/Tiny-Mistral"
    assert resolve_model(f"hf://mistralai/Tiny-Mistral@{'ab' * 20}").name == "mistralai/Tiny-Mistral"
    prompt = [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 19, 23]
    llm = LLM(model="hf://mistralai/Tiny-Mistral", block_size=4)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    finally:
        llm.close()
    assert list(out[0].outputs[0].token_ids) == hf_greedy(mistral_hub_folder, prompt)


@pytest.mark.parametrize(
    "kind, fields",
    [("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {"attention_bias": True})],
    ids=["llama-attention-and-mlp-bias", "qwen3-attention-bias"],
)
def test_projection_biases_match_transformers(tmp_path, bundled_path, kind, fields):
    """`attention_bias` gives o_proj a bias as well as q/k/v, `mlp_bias` gate/up/down theirs: read and added
    (prefill on the per-layer path, decode on the native fused layers), token for token as transformers."""
    path = save(tmp_path, kind, bundled_path, **fields)
    names = set(json.loads((path / SHARD_INDEX).read_text())["weight_map"])
    assert "model.layers.0.self_attn.o_proj.bias" in names
    assert ("model.layers.1.mlp.down_proj.bias" in names) == ("mlp_bias" in fields)
    prompt = [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 19, 23]
    assert engine_greedy(path, prompt) == hf_greedy(path, prompt)


def test_tensor_parallel_refuses_projection_biases_it_does_not_split():
    from specfleet.engine.distributed.sharding import plan, shard_state

    state = {"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: model.layers.0.self_attn.o_proj.bias"):
        shard_state(state, plan(4, 2, 128, 49152, size=2, rank=1), head_dim=16)


def test_a_layer_tensor_the_model_does_not_read_is_logged(tmp_path, bundled_path, caplog):
    """A checkpoint tensor inside a layer that the layer never reads (here a norm Gemma 2 has and Llama does
    not) is named in a warning at load: a computation transformers would do and this engine would not, as
    the o_proj and MLP biases were before they were read. Nothing is logged for a checkpoint read whole."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "llama"
    tiny_model(tiny_config("llama"), std=0.2).save_pretrained(path)
    copy_tokenizer(bundled_path, path)
    with caplog.at_level("WARNING", logger="specfleet.engine.loader"):
        LLM(model=f"file://{path}", block_size=4).close()
    assert "checkpoint_tensors_unread" not in caplog.text
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.1.post_feedforward_layernorm.weight"] = torch.ones(64)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level("WARNING", logger="specfleet.engine.loader"):
        LLM(model=f"file://{path}", block_size=4).close()
    assert "checkpoint_tensors_unread architecture=LlamaForCausalLM count=1" in caplog.text
    assert "'layers.1.post_feedforward_layernorm.weight'" in caplog.text
