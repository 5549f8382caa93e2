"""llama.cpp's own convert_hf_to_gguf.py, run as published: the Hugging Face checkpoint -> GGUF converter from
the anchor's pinned llama.cpp tree (bench/anchors/llama_server.sh `converter`: the llama-cpp-python sdist,
unpacked in the cache, plus the sentencepiece the converter imports, installed beside it; nothing compiled).

`converter_source(offline=True)` never fetches: it raises `ConverterMissing` with the reason when `.ci/setup`
(which runs `llama_server.sh converter`) has not put the tree in the cache, so tests can skip or fail by it.

    python -m specfleet.bench.llama_convert CHECKPOINT OUT.gguf --outtype q8_0
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from specfleet.engine.python_child import python_command

ANCHOR = Path(__file__).resolve().parent / "anchors" / "llama_server.sh"
_OFFLINE_EXIT = 3  # llama_server.sh's exit status when LLAMA_OFFLINE=1 and something must be fetched


class ConverterMissing(RuntimeError):
    """The converter's tree is not in the cache and fetching it was not allowed."""


def converter_source(offline: bool = False) -> Path:
    """The llama.cpp tree holding convert_hf_to_gguf.py and its gguf-py. offline: fetch nothing (raises
    ConverterMissing when the sdist or the converter's sentencepiece is absent)."""
    env = {**os.environ, "LLAMA_OFFLINE": "1" if offline else "0"}
    done = subprocess.run(["bash", str(ANCHOR), "converter"], capture_output=True, text=True, env=env)
    if done.returncode == _OFFLINE_EXIT:
        raise ConverterMissing(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        raise RuntimeError(f"{ANCHOR} converter failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def converter_env(src: Path) -> dict[str, str]:
    """The environment convert_hf_to_gguf.py runs in: its own gguf-py (ahead of the project's), the
    sentencepiece installed beside the source (llama_server.sh `converter`), never the project's venv, and
    the tree itself, where the script imports its `conversion` package from (a child started with -P, as
    `python_command` starts them, does not put the script's folder on sys.path)."""
    deps = src.parents[2] / "convert-deps"
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(deps), str(src)])}


def convert(checkpoint: Path, out: Path, outtype: str = "f32", src: Path | None = None) -> Path:
    """Writes `checkpoint` (a Hugging Face folder with its tokenizer) as the GGUF file `out`, of the
    converter's `outtype` (f32, f16, bf16, q8_0, ...). Returns `out`."""
    src = src or converter_source()
    command = python_command(
        str(src / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", outtype, "--outfile", str(out)
    )
    done = subprocess.run(command, capture_output=True, text=True, env=converter_env(src))
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}): {done.stderr.strip()[-3000:]}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", default="f32", help="the converter's --outtype (default f32)")
    args = p.parse_args(argv)
    print(convert(args.checkpoint, args.out, args.outtype))


if __name__ == "__main__":
    main()
