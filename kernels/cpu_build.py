"""The native CPU kernels' library (kernels/cpu/native.cpp): built with g++ on first use, loaded with
ctypes, its ABI declared and checked; the thread count; the tensor checks every wrapper makes.

The build is cached under ``$SPECFLEET_CACHE`` (default ``~/.cache/specfleet``)/native, keyed by the
source, the flags and the CPU's feature flags (it is compiled with ``-march=native``). When no compiler
is there, or ``SPECFLEET_NATIVE=0``, `library()` returns None and callers keep their torch paths."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("specfleet.kernels.cpu_native")  # the name the kernels have logged under

SOURCE = Path(__file__).with_name("cpu") / "native.cpp"
# Compiled together into one library: the dense, quantized and attention kernels, and LoRA's gathered deltas.
SOURCES = [SOURCE, SOURCE.with_name("lora.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]
PANEL = 32
ABI_VERSION = 12

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_threads = 0


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECFLEET_CACHE", Path.home() / ".cache" / "specfleet")) / "native"


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    key = hashlib.sha256(
        b"".join(source.read_bytes() for source in SOURCES)
        + " ".join([compiler, *FLAGS, _cpu_flags()]).encode()
    ).hexdigest()
    target = _cache_dir() / key[:16] / "libspecfleet_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several engines starting at once on a cold cache (`specfleet up`, a node's pods) build once: an
    # exclusive flock beside the library lets one compile while the others wait and then find it made (the
    # kernel drops the lock of a holder that dies). The build goes to a temporary name renamed onto the
    # target, so no process ever loads a half-written library.
    with open(target.parent / ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            log.info("event=native_build target=%s", target)
            proc = subprocess.run(
                [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.sf_abi_version.restype = i32
    lib.sf_linear_f32.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_i8.argtypes = [p, i64, i64, i64, p, p, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_q4.argtypes = [p, i64, i64, i64, p, p, i32, p, p, i32, i64, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_q8g.argtypes = [p, i64, i64, i64, p, p, p, i32, i64, i64, p, p, i64, p, i64, i32]
    lib.sf_linear_qdot.argtypes = [p, i64, i64, i64, i32, p, p, p, p, i32, i64, i64, p, p, i64, p, i64, i32]
    lib.sf_dot_backend.restype = ctypes.c_char_p
    lib.sf_rms_norm_f32.argtypes = [p, i64, i64, p, f32, p]
    lib.sf_silu_mul_f32.argtypes = [p, i64, i64, p]
    lib.sf_softcap_f32.argtypes = [p, i64, f32, i32]
    lib.sf_paged_attention_f32.argtypes = [
        p,
        i64,
        p,
        p,
        p,
        i64,
        p,
        i64,
        p,
        p,
        i64,
        i64,
        i64,
        i64,
        f32,
        p,
        i32,
    ]
    lib.sf_decode_layers.argtypes = [p, p, i64, p, i64, p, p, p, p, p, i64, p, i64, p, p, p, p, i64, i32, p]
    lib.sf_lora_add_f32.argtypes = [p, i64, p, i64, i64, p, p, p, i32]
    for fn in (
        "sf_decode_layers",
        "sf_linear_f32",
        "sf_linear_i8",
        "sf_linear_q4",
        "sf_linear_q8g",
        "sf_linear_qdot",
        "sf_rms_norm_f32",
        "sf_silu_mul_f32",
        "sf_softcap_f32",
        "sf_paged_attention_f32",
        "sf_lora_add_f32",
    ):
        getattr(lib, fn).restype = None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first call; None when disabled or the build failed."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("SPECFLEET_NATIVE", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(_build()))
            _declare(lib)
            if lib.sf_abi_version() != ABI_VERSION:
                raise RuntimeError(f"ABI version {lib.sf_abi_version()} != {ABI_VERSION}")
            _lib = lib
            num_threads()  # fix the default now, outside any single-threaded section of the engine
        except (OSError, RuntimeError) as exc:
            log.warning("native CPU kernels unavailable, using torch ops: %s", exc)
    return _lib


def available() -> bool:
    return library() is not None


def set_num_threads(n: int) -> None:
    """Threads the native kernels use (default: torch's thread count when first asked)."""
    global _threads
    if n < 1:
        raise ValueError(f"threads={n} must be >= 1")
    _threads = n


def num_threads() -> int:
    global _threads
    if _threads == 0:
        _threads = torch.get_num_threads()
    return _threads


def _lib_or_raise() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available (see the log for why)")
    return lib


def _check(name: str, t: torch.Tensor, dtype: torch.dtype = torch.float32, dim: int | None = None) -> None:
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.device.type} {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")


def _rows(name: str, t: torch.Tensor, cols: int) -> int:
    """Row stride of a 2-D float32 tensor whose rows are contiguous, each holding `cols` values."""
    _check(name, t, dim=2)
    if t.shape[1] != cols or (t.shape[0] > 1 and t.stride(1) != 1) or t.stride(0) < cols:
        raise ValueError(
            f"{name} must be [rows, {cols}] with contiguous rows, got shape {tuple(t.shape)} "
            f"strides {t.stride()}"
        )
    return t.stride(0)
