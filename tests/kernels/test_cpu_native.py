"""Native CPU kernels against torch: the packed linear, RMSNorm, SiLU-and-multiply, soft-capping, paged
attention."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from specfleet.bench.gpu.paged_cases import TOLERANCE, make_case
from specfleet.engine.attention.native_backend import NativeAttentionBackend
from specfleet.engine.attention.registry import get_attention_backend
from specfleet.engine.attention.torch_backend import TorchAttentionBackend
from specfleet.engine.python_child import python_command
from specfleet.kernels import cpu_native

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="native CPU kernels did not build (no g++)"
)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 70])
@pytest.mark.parametrize("in_out", [(64, 96), (96, 50), (40, 33)], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_addmm(rows: int, in_out: tuple[int, int], threads: int) -> None:
    k, n = in_out
    gen = torch.Generator().manual_seed(rows * 100 + k)
    weight = torch.randn(k, n, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    residual = torch.randn(rows, n, generator=gen)
    cpu_native.set_num_threads(threads)
    try:
        plain = cpu_native.PackedLinear(weight)
        biased = cpu_native.PackedLinear(weight, bias)
        torch.testing.assert_close(plain(x), x @ weight, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(
            plain(x, residual=residual), torch.addmm(residual, x, weight), atol=1e-4, rtol=1e-5
        )
        torch.testing.assert_close(
            biased(x, residual=residual), residual + torch.addmm(bias, x, weight), atol=1e-4, rtol=1e-5
        )
    finally:
        cpu_native.set_num_threads(torch.get_num_threads())


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_int8_linear_matches_its_dequantized_weight(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 70, generator=gen), torch.randn(70, generator=gen)
    x, residual = torch.randn(rows, 96, generator=gen), torch.randn(rows, 70, generator=gen)
    scale = weight.abs().amax(dim=0) / 127
    dequantized = torch.round(weight / scale).clamp(-127, 127) * scale
    layer = cpu_native.PackedLinear(weight, bias, quantize="int8")
    assert layer.panels.dtype == torch.int8
    torch.testing.assert_close(
        layer(x, residual=residual), residual + torch.addmm(bias, x, dequantized), atol=1e-4, rtol=1e-5
    )
    # and it is close to the float weight: max-abs per column keeps the error near 1%
    exact = residual + torch.addmm(bias, x, weight)
    assert (layer(x, residual=residual) - exact).norm() / exact.norm() < 0.02
    with pytest.raises(ValueError, match="quantize='int4' is not one of"):
        cpu_native.PackedLinear(weight, quantize="int4")


def test_linear_reads_strided_rows() -> None:
    """q/k/v slices and the rows of a wider tensor are passed with their row stride, not copied."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 40, generator=gen)
    wide = torch.randn(6, 100, generator=gen)
    x = wide[:, 10:74]
    torch.testing.assert_close(cpu_native.PackedLinear(weight)(x), x @ weight, atol=1e-4, rtol=1e-5)


def test_linear_rejects_wrong_inputs() -> None:
    layer = cpu_native.PackedLinear(torch.randn(16, 32))
    with pytest.raises(ValueError, match=r"x must be \[rows, 16\]"):
        layer(torch.randn(3, 17))
    with pytest.raises(ValueError, match="x must be a CPU torch.float32"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(16, 3).t())  # columns not contiguous
    with pytest.raises(ValueError, match="residual has 2 rows"):
        layer(torch.randn(3, 16), residual=torch.randn(2, 32))


def test_rms_norm_and_silu_mul_match_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 72, generator=gen) * 3
    w = torch.randn(72, generator=gen)
    torch.testing.assert_close(
        cpu_native.rms_norm(x, w, 1e-5), F.rms_norm(x, (72,), w, 1e-5), atol=1e-5, rtol=1e-5
    )
    gate_up = torch.randn(5, 2 * 40, generator=gen) * 8  # wide range: exercises exp's clamping
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_native.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        cpu_native.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("threads", [1, 2])
def test_softcap_matches_torch_in_place(threads: int) -> None:
    """cap * tanh(x / cap) over every regime of its tanh: the polynomial near 0 (values of 1e-6 keep their
    relative precision), 1 - 2 / (exp(2z) + 1) beyond |z| = 0.625, saturation to +-cap, and a length that
    is no multiple of 16 nor of the threads' chunks."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 49152 + 7, generator=gen) * 30
    x[0, :100] *= 1e-7
    x[1, :4] = torch.tensor([float("inf"), -float("inf"), 1e6, -1e6])
    want = (torch.tanh(x.double() / 30.0) * 30.0).float()
    cpu_native.set_num_threads(threads)
    try:
        got = cpu_native.softcap_(x, 30.0)
    finally:
        cpu_native.set_num_threads(torch.get_num_threads())
    assert got.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(got, want, atol=1e-12, rtol=4e-7)  # a few float32 ulps, near 0 too
    with pytest.raises(ValueError, match="contiguous"):
        cpu_native.softcap_(torch.randn(4, 6).t(), 30.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        cpu_native.softcap_(torch.randn(4), 0.0)


STEPS = {
    "decode": ([1, 1, 1, 1], [1, 7, 33, 129]),
    "verify": ([5, 3, 9, 16], [40, 3, 129, 16]),
    "mixed": ([33, 1, 5, 7, 200], [129, 40, 33, 7, 300]),
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 1, 128)], ids=str)
def test_native_backend_matches_torch_backend(step: str, heads: tuple[int, int, int]) -> None:
    """A whole step (write the step's K/V, then attend) against the torch reference, with prefix-shared
    blocks, a padding row, GQA, MQA and plain multi-head attention."""
    num_heads, num_kv_heads, head_dim = heads
    query_lens, seq_lens = STEPS[step]
    case = make_case(
        query_lens,
        seq_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        16,
        torch.float32,
        share_prefix=True,
        seed=len(step) + num_heads,
    )
    gen = torch.Generator().manual_seed(2)
    num_tokens = sum(query_lens)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    # The model hands attention a view of the fused q/k projection: rows strided past the kv heads.
    fused = torch.cat([case.query, torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)], dim=1)
    query = fused[:, :num_heads]
    outputs, caches = [], []
    for backend in (TorchAttentionBackend(), NativeAttentionBackend()):
        meta = case.metadata()
        if step == "mixed":
            meta.slot_mapping[3] = -1  # a padding row: its K/V is not written
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.prepare(meta)
        backend.write_kv(key, value, k_cache, v_cache, meta)
        outputs.append(backend.forward(query, k_cache, v_cache, meta, case.scale))
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outputs[1], outputs[0], **TOLERANCE[torch.float32])


def test_paged_attention_checks_shapes() -> None:
    case = make_case([1], [7], 4, 4, 24, 16, torch.float32)  # head_dim 24: not a multiple of 16
    seqs = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        cpu_native.paged_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            seqs,
            case.query_start_loc,
            case.seq_lens,
            case.scale,
            torch.empty_like(case.query),
        )
    case = make_case([1], [7], 4, 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="block_tables must be a CPU torch.int32"):
        cpu_native.paged_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables.long(),
            seqs,
            case.query_start_loc,
            case.seq_lens,
            case.scale,
            torch.empty_like(case.query),
        )


def test_auto_picks_native_on_cpu_float32_only() -> None:
    assert get_attention_backend("auto", torch.device("cpu"), torch.float32).name == "native"
    assert get_attention_backend("auto", torch.device("cpu"), torch.bfloat16).name == "torch"
    with pytest.raises(ValueError, match="CPU float32 only"):
        get_attention_backend("native", torch.device("cpu"), torch.bfloat16)


@pytest.mark.slow
def test_disabled_by_environment_falls_back_to_torch() -> None:
    code = (
        "from specfleet.kernels import cpu_native; import torch\n"
        "from specfleet.engine.attention.registry import get_attention_backend\n"
        "assert not cpu_native.available()\n"
        "print(get_attention_backend('auto', torch.device('cpu')).name)"
    )
    out = subprocess.run(
        python_command("-c", code),
        env={**os.environ, "SPECFLEET_NATIVE": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "torch"


def test_build_is_cached_and_shares_torch_openmp() -> None:
    first = cpu_native._build()
    assert cpu_native._build() == first and first.exists()
    maps = open("/proc/self/maps").read().splitlines()
    assert len({line.split()[-1] for line in maps if "libgomp" in line}) == 1
