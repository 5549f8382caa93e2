"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), checked against the
base model and laid out on the engine's fused projections.

Each targeted projection contributes `scale * (x @ A^T) @ B^T`, scale = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora). The engine fuses q/k/v into one `qkv` matmul and gate/up into `gate_up`, so an adapter's
pieces on those are stacked: A's rows concatenated ([sum of ranks, in]) and B laid block-diagonally into the
fused output columns ([sum of ranks, fused out], zeros where a piece has no columns), with the scale folded
into B. One shrink and one expand per fused projection then give every piece's delta in its own slice.

Which PEFT modules an architecture has is its model's `lora_shape()` (ModelShape.targets): Llama's seven
names by default; Phi-3's checkpoint fuses q/k/v and gate/up itself, so its adapters name `qkv_proj` and
`gate_up_proj`, whose B already has the fused width (one piece covering all of the fused columns, reordered
as the loader reorders the base's rows: ModelShape.qkv_columns). Mixture-of-experts models take adapters on
their attention only: an adapter on their MLP (PEFT's `target_parameters` on transformers' fused 3-D expert
weights, an older checkpoint's per-expert linears, the router) is refused naming the module.

Plain checks with messages that name the file, the key and the limit: the server's 400 repeats them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from specfleet.kernels.cpu_lora import LoraDesc, describe

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (the engine's fused projection, which piece of it). The order of the pieces is the
# order of the fused weight's rows (llama.py: cat_rows q, k, v and gate, up).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# An architecture's targets: PEFT module name -> (fused projection, its first piece, how many pieces it spans).
Targets = Mapping[str, tuple[str, int, int]]
LLAMA_TARGETS: Targets = {module: (fused, index, 1) for module, (fused, index) in TARGETS.items()}
ATTENTION_TARGETS: Targets = {m: t for m, t in LLAMA_TARGETS.items() if t[0] in ("qkv", "o")}
# Module names in a mixture-of-experts MLP: transformers' fused `experts` (PEFT's target_parameters), the
# router `gate`, Mixtral's per-expert w1/w2/w3 in older checkpoints, and Llama's names (Qwen3-MoE's experts
# in older checkpoints, its dense layers).
_MOE_MLP = ("experts", "gate", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.([\w.]+?)"
    r"\.lora_([AB])\.weight$"
)


class LoraError(ValueError):
    """An adapter that cannot be served, with what is wrong (the server's 400)."""


@dataclass(frozen=True)
class ModelShape:
    """What an adapter is checked against: the base's projection sizes and layer count, and the PEFT modules
    its architecture has."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    architecture: str = "LlamaForCausalLM"  # the name refusals give
    targets: Targets = field(default_factory=lambda: dict(LLAMA_TARGETS))
    mlp_refused: bool = False  # a mixture-of-experts model: adapters on its MLP are refused (attention only)
    # The engine's fused q/k/v column j is the checkpoint's column qkv_columns[j] (Phi-3 permutes q and k
    # within each head at load for partial rotary); None: the same order.
    qkv_columns: torch.Tensor | None = field(default=None, compare=False)

    @classmethod
    def of(cls, args: Any, architecture: str = "LlamaForCausalLM", **layout: Any) -> ModelShape:
        """The shape of a model of LlamaArgs `args`; `layout`: targets, mlp_refused, qkv_columns."""
        return cls(
            args.num_layers,
            args.hidden_size,
            args.intermediate_size,
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
            architecture,
            **layout,
        )

    def mlp_refusal(self, subject: str, layer: int | None = None) -> LoraError:
        """The error for an adapter on a mixture-of-experts model's MLP; `subject` names what targets it."""
        where = "" if layer is None else f" in layer {layer}"
        return LoraError(
            f"{subject}{where}: {self.architecture} takes adapters on its attention only "
            f"({', '.join(self.targets)}), not on its MLP yet (the routed experts, the router, a dense "
            "layer's MLP)"
        )

    def pieces(self, fused: str) -> list[tuple[int, int]]:
        """(in_features, out_features) of each piece of a fused projection, in row order."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {
            "qkv": [(h, q), (h, kv), (h, kv)],
            "o": [(q, h)],
            "gate_up": [(h, i), (h, i)],
            "down": [(i, h)],
        }[fused]


@dataclass(frozen=True)
class LoraWeights:
    """One fused projection's delta in one layer: y += (x @ a_t) @ b_t."""

    a_t: torch.Tensor  # [in, sum of ranks]
    b_t: torch.Tensor  # [sum of ranks, fused out], scale folded in
    cols: torch.Tensor  # [pieces, 2] int64: each piece's output columns (b_t's other columns are zero)
    desc: LoraDesc | None = None  # the native kernel's descriptor (float32 weights), made once at load


@dataclass(eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float
    digest: str  # sha256 over the config and the weights: a reload of changed files is another adapter
    target_modules: tuple[str, ...]
    layers: list[dict[str, LoraWeights]] = field(repr=False)  # [num_layers] fused projection -> weights
    nbytes: int = 0

    @property
    def cache_key(self) -> tuple[str, str]:
        """What prefix-cache blocks are keyed by: the name and the files' digest, so that an in-place reload
        with other weights never reuses the old adapter's KV."""
        return self.name, self.digest


def read_adapter(
    name: str, path: str | Path, shape: ModelShape, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoraAdapter:
    """Load and check the adapter in folder `path` for a base of `shape`; raises LoraError naming the problem."""
    folder = Path(str(path).removeprefix("file://"))
    config, raw_config = _read_config(folder)
    rank = _check_config(config, folder, max_rank, shape)
    tensors, raw_weights = _read_weights(folder)
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraError(
                f"{folder / WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight of a layer's projection"
            )
        layer, part, module, ab = int(match[1]), match[2], match[3], match[4]
        if shape.mlp_refused and part != "self_attn":
            raise shape.mlp_refusal(f"adapter {name!r} targets {part}.{module}", layer)
        if module not in shape.targets:
            raise LoraError(
                f"adapter {name!r} targets {module!r}, which the model does not have "
                f"({shape.architecture}; LoRA targets: {', '.join(shape.targets)})"
            )
        if layer >= shape.num_layers:
            raise LoraError(
                f"adapter {name!r}: tensor {key!r} is for layer {layer}, the model has {shape.num_layers} layers "
                "(an adapter for another base model?)"
            )
        pieces.setdefault((layer, module), {})[ab] = tensor
    if not pieces:
        raise LoraError(f"{folder / WEIGHTS_FILE}: holds no LoRA weights")
    layers: list[dict[str, LoraWeights]] = [{} for _ in range(shape.num_layers)]
    # On one thread: the ops are a few hundred KB each, where OpenMP's fork and join cost more than the
    # copy, and on a busy host every parallel region waits for its threads to be scheduled (measured on 2
    # loaded cores: 2.2 s for a rank-16 SmolLM2 adapter on the default threads, see the log line's ms).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for layer in range(shape.num_layers):
            for fused in ("qkv", "o", "gate_up", "down"):
                w = _fuse(name, shape, layer, fused, pieces, rank, scale, dtype)
                if w is not None:
                    layers[layer][fused] = w
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256(raw_config + raw_weights).hexdigest()[:16]
    modules = tuple(sorted({m for _, m in pieces}, key=list(shape.targets).index))
    nbytes = sum(w.a_t.nbytes + w.b_t.nbytes for ws in layers for w in ws.values())
    return LoraAdapter(name, str(path), rank, scale, digest, modules, layers, nbytes)


def _read_config(folder: Path) -> tuple[dict[str, Any], bytes]:
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraError(
            f"lora_path {str(folder)!r} is not a folder (expected PEFT's {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise LoraError(
            f"{file} is missing (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})"
        ) from None
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoraError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{file} must hold a JSON object")
    return config, raw


def _check_config(config: dict[str, Any], folder: Path, max_rank: int, shape: ModelShape) -> int:
    """The adapter's rank, after refusing what the engine does not run."""
    file = folder / CONFIG_FILE
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{file}: peft_type={config['peft_type']!r}, only 'LORA' is supported")
    params = config.get("target_parameters")
    if params:
        # PEFT's LoRA on raw parameters: what it makes of MLP targets on transformers' fused 3-D expert weights
        # (checked first: PEFT also writes a rank_pattern for them, which is not the reason to give)
        if shape.mlp_refused:
            raise shape.mlp_refusal(f"{file}: target_parameters {params!r} are the routed experts' weights")
        raise LoraError(
            f"{file}: target_parameters={params!r} is not supported: LoRA on parameters rather than on the "
            f"modules {', '.join(shape.targets)}"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"{file}: r={rank!r} must be an integer >= 1")
    if rank > max_rank:
        raise LoraError(f"{file}: rank r={rank} exceeds --max-lora-rank={max_rank}")
    if config.get("use_dora"):
        raise LoraError(f"{file}: use_dora=true (DoRA) is not supported")
    if config.get("modules_to_save"):
        raise LoraError(
            f"{file}: modules_to_save={config['modules_to_save']!r} is not supported (only LoRA A/B weights)"
        )
    if config.get("bias", "none") != "none":
        raise LoraError(f"{file}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(f"{file}: rank_pattern/alpha_pattern (per-module ranks) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in shape.targets]
        mlp = [t for t in unknown if t.rsplit(".", 1)[-1] in _MOE_MLP]
        if shape.mlp_refused and mlp:
            raise shape.mlp_refusal(f"{file}: target_modules {mlp!r} are MLP modules")
        if unknown:
            raise LoraError(
                f"{file}: target_modules {unknown!r} are modules the model does not have "
                f"({shape.architecture}; LoRA targets: {', '.join(shape.targets)})"
            )
    return rank


def _read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    file = folder / WEIGHTS_FILE
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise LoraError(
            f"{file} is missing (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})"
        ) from None
    try:
        return load(raw), raw
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise LoraError(f"{file} is not a readable safetensors file: {exc}") from None


def _fuse(
    name: str,
    shape: ModelShape,
    layer: int,
    fused: str,
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]],
    rank: int,
    scale: float,
    dtype: torch.dtype,
) -> LoraWeights | None:
    """A fused projection's stacked A and block-diagonal B, or None when the adapter leaves it alone."""
    dims = shape.pieces(fused)
    found = [(m, i, n) for m, (f, i, n) in shape.targets.items() if f == fused and (layer, m) in pieces]
    if not found:
        return None
    # One allocation each for the stacked A and the block-diagonal B, filled in place: loading is a few
    # hundred of these per adapter, and each torch op costs more than its few KB of copying.
    out_total = sum(out for _, out in dims)
    a_t = torch.empty(dims[0][0], len(found) * rank, dtype=dtype)
    b_t = torch.zeros(len(found) * rank, out_total, dtype=dtype)
    cols = torch.empty(len(found), 2, dtype=torch.int64)
    for j, (module, index, count) in enumerate(found):
        ab = pieces[(layer, module)]
        if "A" not in ab or "B" not in ab:
            raise LoraError(
                f"adapter {name!r}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing"
            )
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = dims[index][0], sum(out for _, out in dims[index : index + count])
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraError(
                f"adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, the model needs ({rank}, {fan_in}) and ({fan_out}, {rank}) "
                "(an adapter for another base model?)"
            )
        start = sum(out for _, out in dims[:index])
        cols[j, 0], cols[j, 1] = start, start + fan_out
        a_t[:, j * rank : (j + 1) * rank].copy_(a.t())
        b_t[j * rank : (j + 1) * rank, start : start + fan_out].copy_(b.t())
    if fused == "qkv" and shape.qkv_columns is not None:
        # the base's rows reordered at load: B's columns alike (within each piece, so `cols` still hold)
        b_t = b_t[:, shape.qkv_columns].contiguous()
    b_t.mul_(scale)
    return LoraWeights(a_t, b_t, cols, describe(a_t, b_t, rank, cols) if dtype == torch.float32 else None)
