"""Replay a Dockerfile's install steps in a fresh venv, exactly as written, without Docker.

There is no Docker daemon and no registry but PyPI here, so an image cannot be built; what breaks images in
practice is their Python install steps (a dependency the code imports but the image never installs). This
module reads the Dockerfile itself, so the replay cannot drift from it: every `COPY` is copied into a build
folder, every `pip install` in a `RUN` runs in a fresh venv with that folder as its working directory, and
every other command must be one the replay knows to skip (an unknown one fails, so a new install step is
never ignored in silence). Substitutions, each because the real thing cannot be reached here:

- the base image's Python is this machine's (3.11, as python:3.11-slim; the CUDA image's Ubuntu python3.12);
- `--index-url https://download.pytorch.org/...` is dropped: pip's configured index serves torch==2.13.0 as
  the CPU build from local disk, so images that bring their own torch get that CPU torch in the replay;
- `apt-get` packages are recorded, not installed (the tests assert on them);
- the pod's /cache emptyDir is a folder inside the venv when the entry point runs;
- pip's cache stays on and pip writes no .pyc files (`--no-compile`): the images set PIP_NO_CACHE_DIR=1 to
  keep layers small, here both keep CI fast (compiling torch's sources is most of its install time), and
  neither changes what gets installed;
- the commands run in a replay may write .pyc files, though the images set PYTHONDONTWRITEBYTECODE=1: an
  image's pip compiled its modules at install, which the replay skips, so the first command compiles what
  it imports and keeps it, and the later ones load it as the image's would (instead of compiling torch's
  sources again at each command).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

# Commands in RUN lines that shape the filesystem or the OS user, not the Python environment.
SKIPPED = {"rm", "useradd", "mkdir", "chown", "chmod", "ln"}
UNREACHABLE_PIP_OPTIONS = ("--index-url", "--extra-index-url")
# ENV the replay replaces with its own: the venv's location, pip's cache and the .pyc files (see the module
# docstring).
REPLACED_ENV = {"PATH", "VIRTUAL_ENV", "PIP_NO_CACHE_DIR", "PYTHONDONTWRITEBYTECODE"}


@dataclass
class Dockerfile:
    path: Path
    base: str = ""
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[str, str]] = field(default_factory=list)  # (source in the context, dest under WORKDIR)
    pip_installs: list[list[str]] = field(default_factory=list)  # argv after `pip install`, as written
    pip_check: bool = False  # a `pip check` follows the installs
    apt_packages: list[str] = field(default_factory=list)
    user: str = ""
    expose: str = ""
    entrypoint: str = ""
    cmd: str = ""


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped, as Docker does."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def _env_pairs(args: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(args))


def _run_commands(dockerfile: Dockerfile, args: str) -> None:
    for command in args.split("&&"):
        argv = shlex.split(command)
        if argv[:2] == ["pip", "install"]:
            dockerfile.pip_installs.append(argv[2:])
        elif argv[:2] == ["pip", "check"]:
            dockerfile.pip_check = True  # run after the installs: what the image's build would fail on
        elif argv[:1] == ["apt-get"]:
            if "install" in argv:
                dockerfile.apt_packages += [
                    a for a in argv[argv.index("install") + 1 :] if not a.startswith("-")
                ]
        elif argv[:3] == ["python3", "-m", "venv"]:
            continue  # the replay's own fresh venv stands for it
        elif argv[0] not in SKIPPED:
            raise ValueError(
                f"{dockerfile.path.name}: the replay does not know the RUN command {command.strip()!r};"
                " teach tests/operator/dockerfile_replay.py whether it installs anything"
            )


def parse(path: Path) -> Dockerfile:
    dockerfile = Dockerfile(path)
    for keyword, args in instructions(path.read_text()):
        if keyword == "FROM":
            dockerfile.base = args
        elif keyword == "ENV":
            dockerfile.env.update(_env_pairs(args))
        elif keyword == "COPY":
            *sources, dest = shlex.split(args)
            dockerfile.copies += [(source, dest) for source in sources]
        elif keyword == "RUN":
            _run_commands(dockerfile, args)
        elif keyword in ("USER", "EXPOSE", "ENTRYPOINT", "CMD"):
            setattr(dockerfile, keyword.lower(), args)
    return dockerfile


def replayed_pip_args(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in UNREACHABLE_PIP_OPTIONS:
            skip = True
        elif not arg.startswith(UNREACHABLE_PIP_OPTIONS):
            out.append(arg)
    return out


@dataclass
class Replay:
    dockerfile: Dockerfile
    venv: Path
    seconds: float

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def run(
        self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run the venv's python as the image would (its ENV, no repository on sys.path)."""
        # The pod mounts an emptyDir at /cache; here it is a folder of the venv's, never the host's /cache.
        image_env = {
            k: str(self.venv) + v if v.startswith("/cache") else v
            for k, v in self.dockerfile.env.items()
            if k not in REPLACED_ENV
        }
        full_env = {
            "PATH": f"{self.venv / 'bin'}:{os.environ['PATH']}",
            "HOME": str(self.venv),
            **image_env,
            **(env or {}),
        }
        return subprocess.run(
            [str(self.python), *args],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd or self.venv,
            timeout=timeout,
        )


def replay(path: Path, repo: Path, workdir: Path) -> Replay:
    """Replay `path`'s COPY and pip steps into workdir/venv; raise with pip's output if a step fails."""
    started = time.monotonic()
    dockerfile = parse(path)
    build = workdir / "src"
    build.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for source, dest in dockerfile.copies:
        target = build / dest
        if (repo / source).is_dir():
            shutil.copytree(repo / source, target, ignore=ignore)
        else:
            shutil.copy2(repo / source, target)  # into the folder when dest is one (`./`)
    env_dir = workdir / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    pip_env = {
        **os.environ,
        **{k: v for k, v in dockerfile.env.items() if k.startswith("PIP_") and k not in REPLACED_ENV},
    }
    pip_env.pop("PYTHONPATH", None)
    steps = []
    for argv in dockerfile.pip_installs:
        step_started = time.monotonic()
        # -P: the build folder holds an `operator/` folder that would shadow the standard library's.
        command = [
            str(env_dir / "bin" / "python"),
            "-P",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            *replayed_pip_args(argv),
        ]
        proc = subprocess.run(command, cwd=build, env=pip_env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{path.name}: `pip install {shlex.join(argv)}` failed:\n{proc.stdout}\n{proc.stderr}"
            )
        steps.append(f"`pip install {shlex.join(argv)}` {time.monotonic() - step_started:.0f}s")
    if dockerfile.pip_check:
        check = [str(env_dir / "bin" / "python"), "-P", "-m", "pip", "check"]
        proc = subprocess.run(check, cwd=build, env=pip_env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{path.name}: `pip check` failed:\n{proc.stdout}\n{proc.stderr}")
    seconds = time.monotonic() - started
    print(
        f"image replay: {path.parent.name}/{path.name} installed in {seconds:.0f}s: {'; '.join(steps)}",
        file=sys.stderr,
    )
    return Replay(dockerfile, env_dir, seconds)
