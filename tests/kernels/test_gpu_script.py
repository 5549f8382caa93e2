"""The GPU check script parses, and its CPU dry run (interpreter, tiny sizes) writes a complete gpu.json."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def test_scripts_parse() -> None:
    subprocess.run(["bash", "-n", str(GPU_DIR / "run.sh")], check=True)
    for script in GPU_DIR.glob("*.py"):
        py_compile.compile(str(script), doraise=True)


@pytest.mark.slow
def test_dry_run_writes_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(GPU_DIR / "run.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["errors"] == {}
    assert report["kernel_tests"]["passed"] == report["kernel_tests"]["cases"] > 0
    for key in ("copy_bandwidth_gbs", "paged_decode_bw_fraction", "decode_tok_s", "roofline_tok_s"):
        assert key in report, key
    assert set(report["decode_tok_s"]) == {"1", "2"}
    assert report["quant_matmul"]["passed"] == report["quant_matmul"]["cases"] > 0
    assert report["lora"]["passed"] == report["lora"]["cases"] > 0
    assert report["lora"]["t16_h32_r16_loras2"]["triton_us"] > 0  # the dry run's tiny timed shape
    assert set(report["tp2_decode"]["decode_tok_s"]) == {"1", "2"}  # two CPU ranks over gloo
