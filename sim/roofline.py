"""A roofline profile: an ESTIMATE of an engine's step cost on hardware that is not at hand.

A decode step reads every weight once (memory-bound) or computes 2 FLOPs per parameter per token
(compute-bound), whichever is slower; prefill tokens add their FLOPs; attention reads each context
token's K and V. Sustained shares of the datasheet figures (`bandwidth_efficiency`, `flops_efficiency`)
and a per-step overhead stand in for kernels that are not perfect; they are assumptions, not
measurements, and the profile says so (`estimate: true`). Tensor parallelism divides weights, FLOPs and
KV over `tp` devices (KV heads are replicated where `tp` exceeds them, as the engine's sharding does) and
adds two all-reduces of the activations per layer over the interconnect. A roofline profile keeps its
inputs, so `at_tp` derives the same estimate at another degree: the planner searches TP with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profile import DEFAULT_KNOTS, Profile, RooflineInputs


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_bytes_s: float  # HBM, datasheet
    flops: float  # dense bf16/fp16 FLOP/s, datasheet (no sparsity)
    memory_bytes: float
    interconnect_bytes_s: float = 450e9  # per direction, NVLink-class

    def __post_init__(self) -> None:
        if min(self.bandwidth_bytes_s, self.flops, self.memory_bytes, self.interconnect_bytes_s) <= 0:
            raise ValueError(
                f"hardware {self.name!r}: bandwidth, FLOP/s, memory and interconnect must be > 0"
            )


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # a mixture of experts': each expert's
    bytes_per_param: float = 2.0
    # A mixture of experts: `experts` in each MoE layer, `experts_per_token` routed to, `active_params` the
    # parameters one token runs (0: a dense model, every parameter active).
    experts: int = 0
    experts_per_token: int = 0
    active_params: float = 0.0

    def weight_bytes_read(self, tokens: float) -> float:
        """What a decode step of `tokens` reads: every dense weight, and of the experts' weights the share
        routing reaches, assuming uniform routing: 1 - (1 - k/E)^tokens of the experts."""
        if not self.experts:
            return self.params * self.bytes_per_param
        k, e = self.experts_per_token, self.experts
        expert_params = (self.params - self.active_params) * e / (e - k)  # all experts, all layers
        reached = 1.0 - (1.0 - k / e) ** tokens
        return (self.params - expert_params + expert_params * reached) * self.bytes_per_param

    @property
    def flop_params(self) -> float:  # parameters each token multiplies: 2 FLOPs apiece
        return self.active_params or self.params

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    def split_problem(self, tp: int) -> str | None:
        """Why `tp` ranks cannot split this model, or None: the engine's sharding rule
        (engine/distributed/sharding.py: heads and MLP width divisible, KV heads a multiple or a divisor)."""
        problems = []
        if self.heads % tp:
            problems.append(f"{self.heads} attention heads")
        if self.kv_heads % tp and tp % self.kv_heads:
            problems.append(f"{self.kv_heads} KV heads (neither a multiple nor a divisor of tp)")
        if self.intermediate % tp:
            problems.append(f"an MLP width of {self.intermediate}")
        return f"tp={tp} does not divide {self.name}'s {' and '.join(problems)}" if problems else None


# Datasheet figures (NVIDIA product pages: H100 SXM 3.35 TB/s and 989 TFLOP/s dense BF16; H200 4.8 TB/s;
# A100 80GB SXM 2.04 TB/s and 312 TFLOP/s; L4 300 GB/s and 121 TFLOP/s).
HARDWARE = {
    h.name: h
    for h in (
        Hardware("h100-sxm", 3.35e12, 989e12, 80e9),
        Hardware("h200", 4.8e12, 989e12, 141e9),
        Hardware("a100-80g", 2.04e12, 312e12, 80e9, 300e9),
        Hardware("l4", 300e9, 121e12, 24e9, 32e9),
    )
}
# Model cards (config.json): parameters, layers, hidden size, attention heads, KV heads, head dim, MLP width.
MODELS = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 8.03e9, 32, 4096, 32, 8, 128, 14336),
        ModelShape("llama3-70b", 70.6e9, 80, 8192, 64, 8, 128, 28672),
        ModelShape("qwen2.5-7b", 7.6e9, 28, 3584, 28, 4, 128, 18944),
        ModelShape("smollm2-135m", 135e6, 30, 576, 9, 3, 64, 1536),
        # 48 layers of 128 experts of width 768, 8 routed per token: 30.5B parameters, 3.3B active
        ModelShape("qwen3-30b-a3b", 30.5e9, 48, 2048, 32, 4, 128, 768, 2.0, 128, 8, 3.3e9),
    )
}
# The degrees the planner tries by default: engine.tensorParallelSize allows 1-8 (one 8-GPU node), and
# powers of two are the ones the listed models' heads divide.
TP_DEGREES = (1, 2, 4, 8)

# Assumed sustained shares of the datasheet: decode GEMVs reach ~80% of HBM bandwidth and large GEMMs
# ~60% of peak FLOP/s in published vLLM/SGLang kernel benchmarks; 4 ms of per-step overhead (scheduling,
# sampling, launch) is vLLM V1's order of magnitude without CUDA graphs. Assumptions, hence "estimate".
BANDWIDTH_EFFICIENCY = 0.8
FLOPS_EFFICIENCY = 0.6
STEP_OVERHEAD_S = 0.004
KV_MEMORY_FRACTION = 0.9  # the engine's default kv_cache_memory_fraction
# A new replica's start-up (the autoscaler's delay), image already on the node: ~30 s for the container,
# Python and CUDA initialisation, then the weights read from a network volume at ~1 GB/s (the PVC and
# object-store reads KServe and llm-d document as the usual cold-start bottleneck). Also an estimate.
POD_START_S = 30.0
WEIGHT_LOAD_BYTES_S = 1e9


def roofline_profile(
    hardware: str | Hardware,
    model: str | ModelShape,
    tp: int = 1,
    block_size: int = 16,
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY,
    flops_efficiency: float = FLOPS_EFFICIENCY,
    step_overhead_s: float = STEP_OVERHEAD_S,
    accepted_per_pos: tuple[float, ...] = (),
    proposal_share: float = 1.0,
) -> Profile:
    hw = _lookup(HARDWARE, hardware, "hardware")
    m = _lookup(MODELS, model, "model")
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    problem = m.split_problem(tp)
    if problem:
        raise ValueError(problem)
    bw = hw.bandwidth_bytes_s * bandwidth_efficiency * tp
    fl = hw.flops * flops_efficiency * tp
    weights = m.params * m.bytes_per_param
    free = hw.memory_bytes * tp * KV_MEMORY_FRACTION - weights
    if free <= 0:
        raise ValueError(
            f"{m.name} ({weights / 1e9:.0f} GB of weights) does not fit {tp} x {hw.name} "
            f"({hw.memory_bytes / 1e9:.0f} GB): raise tp"
        )
    # past the KV heads each rank holds whole heads, replicated: each token's KV is stored and read that
    # many times over
    kv_bytes = m.kv_bytes_per_token * max(1, tp // m.kv_heads)
    blocks = int(free // (kv_bytes * block_size))

    def allreduce(tokens: float) -> float:  # two per layer, ring: 2 (tp-1)/tp of the activations each way
        if tp == 1:
            return 0.0
        return (
            2 * m.layers * 2 * (tp - 1) / tp * tokens * m.hidden * m.bytes_per_param / hw.interconnect_bytes_s
        )

    knots = tuple(
        (
            float(d),
            max(m.weight_bytes_read(d) / bw, 2 * m.flop_params * d / fl) + allreduce(d) + step_overhead_s,
        )
        for d in DEFAULT_KNOTS
    )
    return Profile(
        name=f"roofline-{m.name}-{hw.name}-tp{tp}",
        kind="roofline",
        estimate=True,
        knots=knots,
        prefill_s_per_token=2 * m.flop_params / fl + allreduce(1),
        context_s_per_token=kv_bytes / bw,
        num_kv_blocks=blocks,
        block_size=block_size,
        accepted_per_pos=accepted_per_pos,
        proposal_share=proposal_share,
        startup_s=POD_START_S + weights / WEIGHT_LOAD_BYTES_S,
        hardware=f"{tp} x {hw.name}",
        model=m.name,
        tp=tp,
        roofline=RooflineInputs(hw.name, m.name, bandwidth_efficiency, flops_efficiency, step_overhead_s),
        notes=(
            f"ESTIMATE from datasheet figures ({hw.bandwidth_bytes_s / 1e12:.2f} TB/s, {hw.flops / 1e12:.0f} "
            f"TFLOP/s) at assumed efficiencies {bandwidth_efficiency:.0%} / {flops_efficiency:.0%} and "
            f"{step_overhead_s * 1e3:.0f} ms per step; not measured"
        ),
    )


def covers_tp(profile: Profile, tp: int) -> str | None:
    """Why `profile` cannot give step costs at `tp`, or None. A measured profile covers the degree it was
    timed at; a roofline one (with its inputs) any degree that splits the model and holds its weights."""
    if tp == profile.tp:
        return None
    if profile.roofline is None:
        return (
            f"profile {profile.name} ({profile.kind}) covers tp={profile.tp} only: measure one at tp={tp} "
            "or use a roofline estimate (roofline:HARDWARE[:MODEL])"
        )
    try:
        at_tp(profile, tp)
    except ValueError as error:
        return str(error)
    return None


def tp_degrees(profile: Profile) -> tuple[int, ...]:
    """The degrees a profile covers among TP_DEGREES (a measured profile: its own)."""
    if profile.roofline is None:
        return (profile.tp,)
    return tuple(tp for tp in TP_DEGREES if covers_tp(profile, tp) is None)


def at_tp(profile: Profile, tp: int) -> Profile:
    """The same roofline estimate for an engine of `tp` ranks; what the profile carries beyond the
    roofline (speculative acceptance, serving overheads, start-up) is kept."""
    if tp == profile.tp:
        return profile
    inputs = profile.roofline
    if inputs is None:
        raise ValueError(covers_tp(profile, tp))
    derived = roofline_profile(
        inputs.hardware,
        inputs.model,
        tp,
        block_size=profile.block_size,
        bandwidth_efficiency=inputs.bandwidth_efficiency,
        flops_efficiency=inputs.flops_efficiency,
        step_overhead_s=inputs.step_overhead_s,
    )
    return derived.with_(
        accepted_per_pos=profile.accepted_per_pos,
        proposal_share=profile.proposal_share,
        request_overhead_s=profile.request_overhead_s,
        step_overhead_s=profile.step_overhead_s,
        stream_overhead_s=profile.stream_overhead_s,
        startup_s=profile.startup_s,
    )


def _lookup(table: dict, key, what: str):
    if not isinstance(key, str):
        return key
    try:
        return table[key]
    except KeyError:
        raise ValueError(f"unknown {what} {key!r}; use one of {sorted(table)}") from None
