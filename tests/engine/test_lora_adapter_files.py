"""Reading PEFT adapter folders: the fused layout against PEFT's own delta, and each adapter the engine
cannot serve refused with a message that names what is wrong (the server's 400 repeats it). No engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_model, write_tiny_checkpoint
from lora_helpers import save_random_adapter
from safetensors.torch import load_file, save_file
from specfleet.engine.lora.adapter import LoraError, ModelShape, read_adapter
from specfleet.engine.lora.batch import LoraBatch
from specfleet.engine.lora.manager import LoraManager
from specfleet.engine.models.llama import LlamaArgs

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def config():
    return tiny_config("llama", vocab_size=128)


@pytest.fixture(scope="module")
def shape(config) -> ModelShape:
    return ModelShape.of(LlamaArgs.from_hf(config))


@pytest.fixture(scope="module")
def good(config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tiny_model(config)
    return save_random_adapter(
        base, tmp_path_factory.mktemp("good"), seed=3, r=8, lora_alpha=16, target_modules=ALL
    )


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config_changes}))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_fused_deltas_equal_peft_per_projection(config, shape, good):
    """Each fused projection's delta (qkv, gate_up stacked block-diagonally) equals PEFT's delta of its
    pieces, in the pieces' columns; rows of other adapters or none are untouched."""
    from peft import PeftModel

    peft = PeftModel.from_pretrained(tiny_model(config), good)
    adapter = read_adapter("good", good, shape, max_rank=64)
    attn = peft.base_model.model.model.layers[1].self_attn
    x = torch.randn(5, shape.hidden_size)
    want = torch.cat(
        [
            m.lora_B["default"](m.lora_A["default"](x)) * m.scaling["default"]
            for m in (attn.q_proj, attn.k_proj, attn.v_proj)
        ],
        dim=1,
    )
    batch = LoraBatch.build([(None, 0, 2), (adapter, 2, 3)], 5, torch.device("cpu"))
    assert batch is not None
    y = batch.add(torch.zeros(5, want.shape[1]), x, 1, "qkv")
    assert torch.equal(y[:2], torch.zeros(2, want.shape[1]))
    torch.testing.assert_close(y[2:], want[2:], rtol=1e-5, atol=1e-6)
    assert adapter.target_modules == tuple(ALL) and adapter.rank == 8 and adapter.scale == 2.0


def test_rslora_scale(shape, good, tmp_path):
    adapter = read_adapter("rs", _copy(good, tmp_path / "rs", use_rslora=True), shape, max_rank=64)
    assert adapter.scale == pytest.approx(16 / 8**0.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": 8}, None),  # the unchanged adapter loads (the cases below differ from it in one field)
        ({"use_dora": True}, "use_dora=true \\(DoRA\\) is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=\\['lm_head'\\] is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        (
            {"target_modules": ["q_proj", "fc1"]},
            "target_modules \\['fc1'\\] are modules the model does not have",
        ),
        ({"peft_type": "IA3"}, "peft_type='IA3', only 'LORA'"),
    ],
)
def test_config_refusals(shape, good, tmp_path, changes, message):
    folder = _copy(good, tmp_path / "a", **changes)
    if message is None:
        read_adapter("a", folder, shape, max_rank=64)
        return
    with pytest.raises(LoraError, match=message):
        read_adapter("a", folder, shape, max_rank=64)


def test_rank_above_the_limit(shape, good):
    with pytest.raises(LoraError, match="rank r=8 exceeds --max-lora-rank=4"):
        read_adapter("a", good, shape, max_rank=4)


def test_adapter_for_another_base(shape, tmp_path):
    other = tiny_model(tiny_config("llama", vocab_size=128, hidden_size=32, num_attention_heads=2))
    folder = save_random_adapter(other, tmp_path / "other", seed=1, r=4, target_modules=["q_proj"])
    with pytest.raises(LoraError, match=r"lora_A \(4, 32\).*the model needs \(4, 64\).*another base model"):
        read_adapter("other", folder, shape, max_rank=64)
    deeper = tiny_model(tiny_config("llama", vocab_size=128, num_hidden_layers=3))
    folder = save_random_adapter(deeper, tmp_path / "deeper", seed=1, r=4, target_modules=["o_proj"])
    with pytest.raises(LoraError, match="is for layer 2, the model has 2 layers"):
        read_adapter("deeper", folder, shape, max_rank=64)


def test_missing_and_corrupt_files(shape, good, tmp_path):
    with pytest.raises(LoraError, match="is not a folder"):
        read_adapter("a", tmp_path / "absent", shape, max_rank=64)
    folder = _copy(good, tmp_path / "nocfg")
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoraError, match="adapter_config.json is missing"):
        read_adapter("a", folder, shape, max_rank=64)
    folder = _copy(good, tmp_path / "badjson")
    (folder / "adapter_config.json").write_text("{r: 8")
    with pytest.raises(LoraError, match="adapter_config.json is not valid JSON"):
        read_adapter("a", folder, shape, max_rank=64)
    folder = _copy(good, tmp_path / "noweights")
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="adapter_model.safetensors is missing"):
        read_adapter("a", folder, shape, max_rank=64)
    folder = _copy(good, tmp_path / "corrupt")
    raw = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(LoraError, match="is not a readable safetensors file"):
        read_adapter("a", folder, shape, max_rank=64)


def test_embedding_weights_are_refused(shape, good, tmp_path):
    folder = _copy(good, tmp_path / "embed")
    save_file(
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 128)},
        folder / "adapter_model.safetensors",
    )
    with pytest.raises(
        LoraError, match="'base_model.model.model.embed_tokens.lora_embedding_A' is not a LoRA A/B weight"
    ):
        read_adapter("a", folder, shape, max_rank=64)


def test_manager_names_lru_and_digest(shape, good, tmp_path):
    lora = LoraManager(shape, base_name="tiny", max_rank=64, max_cpu_loras=1)
    with pytest.raises(LoraError, match="lora_name='tiny' shadows the served model's name"):
        lora.load("tiny", str(good))
    a = lora.load("a", str(good))
    b = lora.load("b", str(_copy(good, tmp_path / "b", lora_alpha=32)))
    assert a.digest != b.digest  # another config is another adapter, for the prefix cache too
    assert list(lora.resident) == ["b"] and lora.stats.evictions == 1
    again = lora.get("a")  # evicted from host memory: read again from its folder
    assert again.digest == a.digest and again is not a and lora.stats.loads == 3
    lora.unload("a")
    with pytest.raises(LoraError, match="'a' is neither the served model nor a loaded LoRA adapter"):
        lora.get("a")
    with pytest.raises(LoraError, match="lora_name='a' is not loaded \\(loaded: b\\)"):
        lora.unload("a")


PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # PEFT's module names on Phi3ForCausalLM


def _peft_delta(module, x: torch.Tensor) -> torch.Tensor:
    return module.lora_B["default"](module.lora_A["default"](x)) * module.scaling["default"]


def test_phi3_fused_modules_equal_peft_in_the_engines_column_order(tmp_path):
    """Phi-3's adapters name its checkpoint's fused qkv_proj and gate_up_proj: each is one piece spanning the
    engine's fused projection, and with partial rotary the engine's q/k columns are the checkpoint's permuted
    within each head (as the loader permutes the base's rows), so B's columns are permuted alike."""
    from peft import PeftModel
    from specfleet.engine.models.phi3 import Phi3Model

    config = tiny_config(
        "phi3", vocab_size=128, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    state = {k: v.detach().clone() for k, v in tiny_model(config).state_dict().items()}
    model = Phi3Model(config, state, torch.float32, torch.device("cpu"), native=False)
    shape = model.lora_shape()
    assert shape.qkv_columns is not None
    relaid = Phi3Model.llama_state(config, state)  # the base's rows as the engine fuses them again
    fused = torch.cat([relaid[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(fused, state["model.layers.1.self_attn.qkv_proj.weight"][shape.qkv_columns])
    assert not torch.equal(shape.qkv_columns, torch.arange(shape.qkv_columns.numel()))  # a real permutation

    folder = save_random_adapter(tiny_model(config), tmp_path / "phi3", seed=5, r=8, target_modules=PHI3)
    adapter = read_adapter("phi3", folder, shape, max_rank=64)
    assert adapter.target_modules == tuple(PHI3)
    layer = PeftModel.from_pretrained(tiny_model(config), folder).base_model.model.model.layers[1]
    x = torch.randn(3, shape.hidden_size)
    batch = LoraBatch.build([(adapter, 0, 3)], 3, torch.device("cpu"))
    assert batch is not None
    want = {
        "qkv": _peft_delta(layer.self_attn.qkv_proj, x)[:, shape.qkv_columns],
        "gate_up": _peft_delta(layer.mlp.gate_up_proj, x),
    }
    for proj, delta in want.items():
        got = batch.add(torch.zeros_like(delta), x, 1, proj)
        torch.testing.assert_close(got, delta, rtol=1e-5, atol=1e-6)
    with pytest.raises(LoraError, match=r"target_modules \['q_proj'\] are modules the model does not have "):
        read_adapter("q", _copy(folder, tmp_path / "q", target_modules=["q_proj"]), shape, max_rank=64)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe"])
def test_moe_adapters_on_the_mlp_are_refused_naming_the_module(kind, tmp_path):
    """Attention-only on the MoE models: an older checkpoint's per-expert linears, the router and (Qwen3-MoE)
    a dense layer's MLP are refused by their tensor's module, whatever the config lists; the attention loads."""
    from specfleet.engine.models.moe import MixtralModel, Qwen3MoeModel

    overrides = {"mlp_only_layers": [1]} if kind == "qwen3moe" else {}
    config = tiny_config(kind, vocab_size=128, **overrides)
    # the checkpoint's tensors (transformers saves the experts one by one; in memory they are fused 3-D)
    state = load_file(write_tiny_checkpoint(tmp_path / "base", config) / "model.safetensors")
    cls = MixtralModel if kind == "mixtral" else Qwen3MoeModel
    shape = cls(config, state, torch.float32, torch.device("cpu"), native=False).lora_shape()
    expert = "block_sparse_moe.experts.0.w1" if kind == "mixtral" else "mlp.experts.0.gate_proj"
    for module, layer in [(expert, 0), ("mlp.gate", 0), ("mlp.down_proj", 1), ("self_attn.q_proj", 1)]:
        folder = tmp_path / f"{module}-{layer}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        inside = shape.hidden_size if module != "mlp.down_proj" else shape.intermediate_size
        prefix = f"base_model.model.model.layers.{layer}.{module}"
        save_file(
            {
                f"{prefix}.lora_A.weight": torch.zeros(4, inside),
                f"{prefix}.lora_B.weight": torch.zeros(64, 4),
            },
            folder / "adapter_model.safetensors",
        )
        if module == "self_attn.q_proj":
            assert read_adapter("a", folder, shape, max_rank=8).target_modules == ("q_proj",)
            continue
        with pytest.raises(
            LoraError,
            match=rf"adapter 'a' targets {module} in layer {layer}: {cls.architecture} takes adapters on its "
            r"attention only \(q_proj, k_proj, v_proj, o_proj\), not on its MLP",
        ):
            read_adapter("a", folder, shape, max_rank=8)
