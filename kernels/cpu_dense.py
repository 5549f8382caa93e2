"""Float32 and int8 weights in the native kernels' panel layout: `PackedLinear`, and the fused decode
layers (`DecodeLayers`) that run a whole small-batch decode step in one call."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from specfleet.kernels.cpu_build import PANEL, _check, _lib_or_raise, _rows, num_threads
from specfleet.kernels.huge_pages import huge_page_zeros


def pack_panels(weight_t: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [ceil(N / 32), K, 32] contiguous, the last panel zero-padded: each panel is one
    sequential stream for the kernel, on transparent huge pages where the OS allows (kernels/huge_pages.py:
    a step streams every weight once, and 4 KiB pages cost a TLB miss each 4 KiB)."""
    k, n = weight_t.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(k, panels * PANEL, dtype=weight_t.dtype)
    padded[:, :n] = weight_t
    out = huge_page_zeros((panels, k, PANEL), weight_t.dtype)
    out.copy_(padded.view(k, panels, PANEL).transpose(0, 1))
    return out


def _pad(v: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(-(-n // PANEL) * PANEL)
    out[: v.shape[0]] = v
    return out


def int8_column_scale(weight_t: torch.Tensor) -> torch.Tensor:
    """Symmetric max-abs int8 scale of each output column of an [in, out] weight."""
    return weight_t.abs().amax(dim=0).clamp_min(1e-12) / 127.0


class LinearDesc(ctypes.Structure):
    """sf_linear_desc (kernels/cpu/native.cpp): one linear's kernel and packed tensors."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("scale_kind", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("codes", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("high", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("K", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("G", ctypes.c_int64),
    ]


class _LayerDesc(ctypes.Structure):
    _fields_ = [
        ("qkv", LinearDesc),
        ("o", LinearDesc),
        ("gate_up", LinearDesc),
        ("down", LinearDesc),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("pre_ff_norm", ctypes.c_void_p),
        ("post_ff_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("gelu", ctypes.c_int32),
        ("sliding", ctypes.c_int32),
        ("window", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        ("reserved", ctypes.c_float),
        ("experts", ctypes.c_void_p),
        ("router", LinearDesc),
        ("num_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("renormalize", ctypes.c_int32),
        ("reserved2", ctypes.c_int32),
    ]


class _ModelDesc(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@dataclass(frozen=True)
class DecodeLayerWeights:
    """What sf_decode_layers needs of one decoder layer: its four linears' descriptors and its norms."""

    qkv: LinearDesc
    o: LinearDesc
    gate_up: LinearDesc
    down: LinearDesc
    input_norm: torch.Tensor  # [hidden] float32, contiguous
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None = None  # [head_dim]: per-head RMSNorm of q before rotary (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim]: the same for k; given with q_norm
    # Gemma's layer (engine/models/gemma.py). With the feed-forward norms given, post_norm normalizes the
    # attention's output before its residual add, pre_ff_norm the MLP's input, post_ff_norm its output.
    pre_ff_norm: torch.Tensor | None = None  # [hidden]
    post_ff_norm: torch.Tensor | None = None  # [hidden]; given with pre_ff_norm
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's own cos/sin, else the step's
    gelu: bool = False  # GeGLU (tanh GELU of the gate times up) instead of SiLU
    window: int | None = None  # a query sees its last `window` keys, in the step's sliding view if it has one
    softcap: float | None = None  # attention scores become softcap * tanh(score / softcap)
    # A mixture-of-experts layer (engine/models/moe.py): each expert's (gate_up, down) and the float32 router
    # [hidden -> experts]; gate_up and down above are then unused.
    experts: tuple[tuple[LinearDesc, LinearDesc], ...] | None = None
    router: LinearDesc | None = None
    top_k: int = 0
    renormalize: bool = False  # divide the top-k weights by their sum


class DecodeLayers:
    """Every decoder layer of a decode step in one native call (sf_decode_layers): the per-op path's
    kernels and arithmetic without a Python call per op. For steps whose queries are all short; built once
    per model and set of KV caches (their pointers are baked in)."""

    def __init__(
        self,
        layers: list[DecodeLayerWeights],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        heads: int,
        eps: float,
        scale: float,
    ):
        if len(layers) != len(kv_caches):
            raise ValueError(f"{len(layers)} layers but {len(kv_caches)} KV caches")
        self._lib = _lib_or_raise()
        blocks, block_size, kv_heads, head_dim = kv_caches[0][0].shape
        for name, t in (("k_cache", kv_caches[0][0]), ("v_cache", kv_caches[0][1])):
            _check(name, t, dim=4)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if head_dim % 16 or heads % kv_heads:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 16 and heads={heads} of {kv_heads}")
        first = layers[0]
        self.hidden, self.heads, self.kv_heads, self.head_dim = first.qkv.K, heads, kv_heads, head_dim
        if first.qkv.N != (heads + 2 * kv_heads) * head_dim:
            raise ValueError(f"q/k/v has {first.qkv.N} outputs, not (heads + 2 kv_heads) * head_dim")
        for i, w in enumerate(layers):
            norms = (w.q_norm, w.k_norm)
            if any(n is not None for n in norms) and not all(
                n is not None and n.shape == (head_dim,) and n.dtype == torch.float32 and n.is_contiguous()
                for n in norms
            ):
                raise ValueError(f"layer {i}: q_norm and k_norm must both be contiguous float32 [{head_dim}]")
            _check_gemma(i, w, self.hidden, head_dim)
        # the fewest positions any layer's rotary table holds (the step's own is checked per call)
        self._rope_rows = min((w.rope[0].shape[0] for w in layers if w.rope is not None), default=None)
        self._model = _ModelDesc(self.hidden, heads, kv_heads, head_dim, first.down.K, block_size, eps, scale)
        experts = [_experts(i, w, self.hidden) for i, w in enumerate(layers)]
        self._layers = (_LayerDesc * len(layers))(
            *(
                _LayerDesc(
                    w.qkv,
                    w.o,
                    w.gate_up,
                    w.down,
                    w.input_norm.data_ptr(),
                    w.post_norm.data_ptr(),
                    k.data_ptr(),
                    v.data_ptr(),
                    None if w.q_norm is None else w.q_norm.data_ptr(),
                    None if w.k_norm is None else w.k_norm.data_ptr(),
                    None if w.pre_ff_norm is None else w.pre_ff_norm.data_ptr(),
                    None if w.post_ff_norm is None else w.post_ff_norm.data_ptr(),
                    None if w.rope is None else w.rope[0].data_ptr(),
                    None if w.rope is None else w.rope[1].data_ptr(),
                    int(w.gelu),
                    int(w.window is not None),
                    w.window or 0,
                    w.softcap or 0.0,
                    0.0,
                    None if e is None else ctypes.addressof(e),
                    w.router if w.router is not None else LinearDesc(),
                    0 if w.experts is None else len(w.experts),
                    w.top_k,
                    int(w.renormalize),
                    0,
                )
                for w, e, (k, v) in zip(layers, experts, kv_caches, strict=True)
            )
        )
        self._keep = (layers, kv_caches, experts)  # the tensors and arrays behind the pointers

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] float32, contiguous, updated in place
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [max_position, head_dim] float32
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, < 0 for padding rows
        block_tables: torch.Tensor,  # [seqs, width] int32
        seqs: torch.Tensor,  # [n] int32
        query_start_loc: torch.Tensor,  # [seqs + 1] int32
        seq_lens: torch.Tensor,  # [seqs] int32
        lora: ctypes.Structure | None = None,  # the step's adapters (cpu_lora.lora_step), rows < tokens
        sliding: tuple[torch.Tensor, torch.Tensor] | None = None,  # the windowed layers' slots and tables
    ) -> torch.Tensor:
        tokens = x.shape[0]
        _check("x", x, dim=2)
        if x.shape[1] != self.hidden or not x.is_contiguous():
            raise ValueError(f"x must be contiguous [tokens, {self.hidden}], got {tuple(x.shape)}")
        for name, t, dtype in (
            ("positions", positions, torch.int64),
            ("slot_mapping", slot_mapping, torch.int64),
            ("cos", cos, torch.float32),
            ("sin", sin, torch.float32),
            ("block_tables", block_tables, torch.int32),
            ("seqs", seqs, torch.int32),
            ("query_start_loc", query_start_loc, torch.int32),
            ("seq_lens", seq_lens, torch.int32),
        ):
            _check(name, t, dtype)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if positions.numel() != tokens or slot_mapping.numel() != tokens:
            raise ValueError(f"positions and slot_mapping need {tokens} entries (one per row of x)")
        if cos.shape != sin.shape or cos.shape[-1] != self.head_dim:
            raise ValueError(f"cos/sin must be [positions, {self.head_dim}], got {tuple(cos.shape)}")
        rows = cos.shape[0] if self._rope_rows is None else min(cos.shape[0], self._rope_rows)
        if tokens and int(positions.max()) >= rows:
            raise ValueError(f"a position is past the rotary table's {rows} entries")
        sliding_slots = sliding_tables = None
        if sliding is not None:
            sliding_slots, sliding_tables = sliding
            _check("sliding slot_mapping", sliding_slots, torch.int64)
            _check("sliding block_tables", sliding_tables, torch.int32, dim=2)
            if sliding_slots.numel() != tokens or not sliding_slots.is_contiguous():
                raise ValueError(f"sliding slot_mapping must be contiguous with {tokens} entries")
            if sliding_tables.shape[0] != block_tables.shape[0] or sliding_tables.stride(1) != 1:
                raise ValueError(
                    f"sliding block_tables must have {block_tables.shape[0]} rows of contiguous entries"
                )
        self._lib.sf_decode_layers(
            ctypes.byref(self._model),
            self._layers,
            len(self._layers),
            x.data_ptr(),
            tokens,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seqs.data_ptr(),
            seqs.numel(),
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            None if sliding_slots is None else sliding_slots.data_ptr(),
            None if sliding_tables is None else sliding_tables.data_ptr(),
            0 if sliding_tables is None else sliding_tables.stride(0),
            num_threads(),
            ctypes.byref(lora) if lora is not None else None,
        )
        return x


def _experts(i: int, w: DecodeLayerWeights, hidden: int) -> ctypes.Array[LinearDesc] | None:
    """A mixture-of-experts layer's experts as sf_layer_desc.experts ([experts][gate_up, down]), checked."""
    if w.experts is None:
        return None
    n = len(w.experts)
    if w.router is None or w.router.K != hidden or w.router.N != n or w.router.kind != 0:
        raise ValueError(f"layer {i}: the router must be a float32 [{hidden} -> {n}] linear")
    if not 0 < w.top_k <= n:
        raise ValueError(f"layer {i}: top_k={w.top_k} must be in 1..{n}")
    for e, (gate_up, down) in enumerate(w.experts):
        if gate_up.K != hidden or down.N != hidden or gate_up.N != 2 * down.K:
            raise ValueError(
                f"layer {i} expert {e}: gate_up must be [{hidden} -> 2I] and down [I -> {hidden}]"
            )
    return (LinearDesc * (2 * n))(*(d for pair in w.experts for d in pair))


def _check_gemma(i: int, w: DecodeLayerWeights, hidden: int, head_dim: int) -> None:
    """Gemma's per-layer tensors (DecodeLayerWeights) before their pointers are taken."""
    ff = (w.pre_ff_norm, w.post_ff_norm)
    if any(n is not None for n in ff) and not all(
        n is not None and n.shape == (hidden,) and n.dtype == torch.float32 and n.is_contiguous() for n in ff
    ):
        raise ValueError(
            f"layer {i}: pre_ff_norm and post_ff_norm must both be contiguous float32 [{hidden}]"
        )
    if w.rope is not None:
        cos, sin = w.rope
        for name, t in (("cos", cos), ("sin", sin)):
            _check(f"layer {i} {name}", t, torch.float32, dim=2)
            if not t.is_contiguous() or t.shape != cos.shape or t.shape[1] != head_dim:
                raise ValueError(f"layer {i}: rope tables must be contiguous [positions, {head_dim}]")
    if w.window is not None and w.window < 1:
        raise ValueError(f"layer {i}: window must be >= 1, got {w.window}")
    if w.softcap is not None and not w.softcap > 0:
        raise ValueError(f"layer {i}: softcap must be > 0, got {w.softcap}")


class PackedLinear:
    """``x @ weight_t (+ bias) (+ residual)`` for a fixed [in, out] weight, packed for the native kernel.

    ``quantize="int8"`` stores the weight as int8 with one scale per output column (symmetric,
    max-abs): a quarter of the bytes, for a quantized draft model. Activations stay float32.
    """

    def __init__(
        self,
        weight_t: torch.Tensor,
        bias: torch.Tensor | None = None,
        quantize: str | None = None,
        int8_scale: torch.Tensor | None = None,
    ):
        """`int8_scale`: the column scales to quantize with instead of this weight's own max-abs (a
        tensor-parallel slice of a row-parallel weight keeps the whole weight's scales, so its codes are the
        unsplit model's)."""
        _check("weight_t", weight_t, dim=2)
        self._lib = _lib_or_raise()
        self.in_features, self.out_features = weight_t.shape
        self.scale = None
        if quantize == "int8":
            scale = int8_column_scale(weight_t) if int8_scale is None else int8_scale
            q = torch.round(weight_t / scale).clamp_(-127, 127).to(torch.int8)
            self.panels, self.scale = pack_panels(q), _pad(scale, self.out_features)
        elif quantize is None:
            self.panels = pack_panels(weight_t)
        else:
            raise ValueError(f"quantize={quantize!r} is not one of None, 'int8'")
        self.bias = None
        if bias is not None:
            _check("bias", bias, dim=1)
            self.bias = _pad(bias, self.out_features)

    def descriptor(self) -> LinearDesc:
        """This linear for sf_decode_layers (the tensors stay owned by this object)."""
        return LinearDesc(
            kind=0 if self.scale is None else 1,
            codes=self.panels.data_ptr(),
            scale=None if self.scale is None else self.scale.data_ptr(),
            bias=None if self.bias is None else self.bias.data_ptr(),
            K=self.in_features,
            N=self.out_features,
        )

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        ldx = _rows("x", x, self.in_features)
        ldr = 0
        if residual is not None:
            ldr = _rows("residual", residual, self.out_features)
            if residual.shape[0] != rows:
                raise ValueError(f"residual has {residual.shape[0]} rows, x has {rows}")
        y = torch.empty(rows, self.out_features)
        bias = self.bias.data_ptr() if self.bias is not None else None
        res = residual.data_ptr() if residual is not None else None
        if self.scale is None:
            self._lib.sf_linear_f32(
                x.data_ptr(),
                rows,
                self.in_features,
                ldx,
                self.panels.data_ptr(),
                self.out_features,
                bias,
                res,
                ldr,
                y.data_ptr(),
                self.out_features,
                num_threads(),
            )
        else:
            self._lib.sf_linear_i8(
                x.data_ptr(),
                rows,
                self.in_features,
                ldx,
                self.panels.data_ptr(),
                self.scale.data_ptr(),
                self.out_features,
                bias,
                res,
                ldr,
                y.data_ptr(),
                self.out_features,
                num_threads(),
            )
        return y
