"""The GPU check: kernel correctness on CUDA, copy and paged-decode bandwidth, the LoRA shrink/expand kernels,
whole-engine decode speed.

Writes ``$OUT/gpu.json`` after every section, so a run cut short still leaves what it measured. Each
section fails soft: its error is recorded under ``errors`` and the next section runs. ``DRY_RUN=1`` runs
everything on CPU through the Triton interpreter with tiny sizes (checks the script, measures nothing).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from specfleet.bench import kernels_bench
from specfleet.bench.gpu import engine_decode, kernel_checks, lora_check, quant_check

DRY_RUN = os.environ.get("DRY_RUN", "0") == "1"
OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="specfleet-gpu-"))
DECODE_BW_TARGET = 0.7


def _device() -> torch.device:
    if DRY_RUN:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with DRY_RUN=1 for the CPU dry run")
    return torch.device("cuda")


def _kernels(report: dict, device: torch.device) -> None:

    report["kernel_tests"] = kernel_checks.run_checks(device, quick=DRY_RUN, budget_s=150.0)
    print(f"kernel tests: {report['kernel_tests']['passed']}/{report['kernel_tests']['cases']} passed")


def _bandwidth(report: dict, device: torch.device) -> None:
    shape = kernels_bench.DRY_SHAPE if DRY_RUN else kernels_bench.Shape()  # batch 64 x 2048, 32/8 heads, 128
    iters = 2 if DRY_RUN else 30
    copy = kernels_bench.copy_bandwidth_gbs(device, nbytes=1 << 20 if DRY_RUN else 4 << 30, iters=iters)
    decode = kernels_bench.bench_decode(shape, device, query_len=1, iters=iters)
    verify = kernels_bench.bench_decode(shape, device, query_len=5, iters=iters)
    report["copy_bandwidth_gbs"] = copy
    report["paged_decode"] = {**decode, "shape": {k: str(v) for k, v in vars(shape).items()}}
    report["paged_verify_q5"] = verify
    report["paged_decode_bw_fraction"] = decode["gbs"] / copy
    report["paged_decode_bw_target_met"] = decode["gbs"] / copy >= DECODE_BW_TARGET
    kv_write, prefill = (
        kernels_bench.bench_kv_write(shape, device, iters),
        kernels_bench.bench_prefill(shape, device, max(1, iters // 3)),
    )
    report["kv_write"], report["paged_prefill"] = kv_write, prefill
    print(f"copy {copy:.0f} GB/s; decode {decode['gbs']:.0f} GB/s = {report['paged_decode_bw_fraction']:.2f}")


def _engine(report: dict, device: torch.device) -> None:

    sizes = engine_decode.TINY if DRY_RUN else engine_decode.FULL
    dtype = "float32" if DRY_RUN else "bfloat16"
    copy = report.get("copy_bandwidth_gbs") or kernels_bench.copy_bandwidth_gbs(
        device, 1 << 20 if DRY_RUN else 4 << 30
    )
    folder = Path(tempfile.gettempdir()) / ("specfleet-llama-tiny" if DRY_RUN else "specfleet-llama-1b")
    num_params = engine_decode.write_random_llama(folder, sizes, getattr(torch, dtype), device)
    report["engine_model"] = {"params": num_params, **sizes, "dtype": dtype}
    steps = (2, 4) if DRY_RUN else (16, 80)
    batches = [1, 2] if DRY_RUN else [1, 64]
    result = engine_decode.measure_decode(folder, batches, device.type, dtype, steps, copy, num_params, sizes)
    report.update(result)
    report["batch1_half_roofline_met"] = result["fraction_of_roofline"]["1"] >= 0.5


def _quant_matmul(report: dict, device: torch.device) -> None:
    report["quant_matmul"] = quant_check.run(device, DRY_RUN, report.get("copy_bandwidth_gbs"))
    print(f"quant matmul: {report['quant_matmul']['passed']}/{report['quant_matmul']['cases']} passed")


def _lora(report: dict, device: torch.device) -> None:
    report["lora"] = lora_check.run(device, DRY_RUN)
    print(f"lora shrink/expand: {report['lora']['passed']}/{report['lora']['cases']} passed")


def _tp2(report: dict, device: torch.device) -> None:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus < 2:
        report["tp2_decode"] = {"skipped": f"tensor parallelism needs 2 GPUs; this machine has {gpus}"}
        return
    # DRY_RUN: two CPU ranks over gloo, which checks this section itself
    sizes = engine_decode.TINY if DRY_RUN else engine_decode.FULL
    dtype = "float32" if DRY_RUN else "bfloat16"
    folder = Path(tempfile.gettempdir()) / ("specfleet-llama-tiny" if DRY_RUN else "specfleet-llama-1b")
    num_params = engine_decode.write_random_llama(folder, sizes, getattr(torch, dtype), device)
    copy = report.get("copy_bandwidth_gbs") or 1.0
    report["tp2_decode"] = engine_decode.measure_decode(
        folder,
        [1, 2] if DRY_RUN else [1, 64],
        device.type,
        dtype,
        (2, 4) if DRY_RUN else (16, 80),
        copy,
        num_params,
        sizes,
        tensor_parallel_size=2,
    )


def main() -> int:
    device = _device()
    report: dict = {
        "dry_run": DRY_RUN,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "errors": {},
        "seconds": {},
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError as e:
        report["errors"]["triton"] = str(e)
    if device.type == "cuda":
        report["device"] = torch.cuda.get_device_name(device)
    OUT.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (OUT / "gpu.json").write_text(json.dumps(report, indent=2, default=str))

    def section(name: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            fn(report, device)
        except Exception as e:  # fail soft, keep measuring
            report["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        report["seconds"][name] = round(time.perf_counter() - t0, 2)
        save()

    section("kernel_tests", _kernels)
    section("bandwidth", _bandwidth)
    section("quant_matmul", _quant_matmul)
    section("lora", _lora)
    section("engine_decode", _engine)
    section("tp2_decode", _tp2)
    print(f"wrote {OUT / 'gpu.json'}; errors: {list(report['errors']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
