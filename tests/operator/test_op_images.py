"""The images: each Dockerfile's install steps replayed in a fresh venv (dockerfile_replay.py says how and
what it substitutes), then its entry point run far enough to prove the image works: the operator loads every
kopf handler without torch, the engines print their --help, the CPU engine builds its native kernels."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from dockerfile_replay import Replay, parse, replay, replayed_pip_args
from isvc_schema_tools import REPO
from specfleet.engine.python_child import python_command
from specfleet.operator import load_inference_service
from specfleet.operator.cli import OPERATOR_MODULES, OPTIONAL_MODULES
from specfleet.operator.render.deployment import RUN_AS_USER, render_deployment
from specfleet.operator.resources import ENGINE_PORT

DOCKERFILES = sorted(
    str(p.relative_to(REPO)) for p in REPO.glob("*/Dockerfile*") if p.suffix != ".dockerignore"
)
ENGINE_DOCKERFILES = [name for name in DOCKERFILES if name.startswith("engine/")]
CHART = REPO / "charts" / "specfleet"

# Prints the handler modules the operator loads and every handler kopf registered, as the image's entry
# point does before it starts kopf. kopf has no public listing: each registry attribute that can list its
# handlers is asked.
HANDLER_PROBE = """
import json, kopf
from specfleet.operator.cli import load_handlers
loaded = load_handlers()
registry = kopf.get_default_registry()
handlers = sorted({f"{kind}:{h.fn.__module__}.{h.fn.__qualname__}:{h.id}"
                   for kind, sub in vars(registry).items() if hasattr(sub, "get_all_handlers")
                   for h in sub.get_all_handlers()})
print(json.dumps({"modules": loaded, "handlers": handlers}))
"""


@pytest.fixture(scope="session")
def replays(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Replay]]]:
    """All images replayed side by side (pip is mostly waiting on disk and unpacking; CI has two cores)."""
    root = tmp_path_factory.mktemp("images")
    with ThreadPoolExecutor(max_workers=len(DOCKERFILES)) as pool:
        yield {
            name: pool.submit(replay, REPO / name, REPO, root / name.replace("/", "_"))
            for name in DOCKERFILES
        }


def test_the_replay_covers_every_dockerfile_in_the_repository() -> None:
    assert DOCKERFILES == ["engine/Dockerfile", "engine/Dockerfile.cuda", "operator/Dockerfile"]
    for name in DOCKERFILES:
        assert parse(REPO / name).pip_installs, (
            f"{name} installs nothing with pip: the replay would prove nothing"
        )


def test_the_replay_refuses_what_it_cannot_judge_and_drops_only_unreachable_indexes(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM python:3.11-slim\nRUN pip install . \\\n && curl -sSL https://x/install.sh | sh\n"
    )
    with pytest.raises(ValueError, match="does not know the RUN command 'curl"):
        parse(dockerfile)
    assert (
        replayed_pip_args(["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"])
        == replayed_pip_args(["--extra-index-url=https://example/simple", "torch==2.13.0"])
        == ["torch==2.13.0"]
    )


def test_operator_image_loads_every_handler_and_has_no_torch(replays: dict[str, Future[Replay]]) -> None:
    image = replays["operator/Dockerfile"].result()
    probe = image.run("-c", HANDLER_PROBE)
    assert probe.returncode == 0, f"the operator image cannot load its handlers:\n{probe.stderr[-3000:]}"
    in_image = json.loads(probe.stdout)
    # The same probe in the test venv, where every extra is installed: the image must load the same handlers.
    here = subprocess.run(
        python_command("-c", HANDLER_PROBE),
        capture_output=True,
        text=True,
        cwd=image.venv,
        check=True,
    )
    assert in_image == json.loads(here.stdout)
    assert in_image["modules"] == [*OPERATOR_MODULES, *OPTIONAL_MODULES]
    assert any(":specfleet.tuner." in h for h in in_image["handlers"]), in_image["handlers"]
    torch = image.run("-c", "import torch")
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    cli = image.run("-m", "specfleet.operator.cli", "--help")
    assert cli.returncode == 0 and "--liveness-port" in cli.stdout


def test_cpu_engine_image_serves_help_and_builds_its_native_kernels(
    replays: dict[str, Future[Replay]], tmp_path: Path
) -> None:
    image = replays["engine/Dockerfile"].result()
    assert image.dockerfile.entrypoint == '["python", "-m", "specfleet.engine"]'
    cli = image.run("-m", "specfleet.engine", "--help")
    assert cli.returncode == 0 and "--model" in cli.stdout, cli.stderr[-3000:]
    # The image brings its own g++ (the replay uses this machine's): without one the kernels fall back.
    assert "g++" in image.dockerfile.apt_packages
    build = image.run(
        "-c",
        "from specfleet.kernels import cpu_native; assert cpu_native.library() is not None",
        env={"SPECFLEET_CACHE": str(tmp_path)},
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert list(tmp_path.glob("native/*/libspecfleet_cpu.so"))
    # The default CMD serves the bundled model: the loader's own lookup finds its GGUF (not converted here).
    model = json.loads(image.dockerfile.cmd)[json.loads(image.dockerfile.cmd).index("--model") + 1]
    bundled = image.run(
        "-c",
        "from specfleet.engine.model_source import _bundled_gguf; "
        f"print(_bundled_gguf({model.removeprefix('bundled://')!r}))",
    )
    assert bundled.returncode == 0, bundled.stderr[-3000:]


def test_cuda_engine_image_serves_help_with_triton(replays: dict[str, Future[Replay]]) -> None:
    image = replays["engine/Dockerfile.cuda"].result()
    cli = image.run("-m", "specfleet.engine", "--help")
    assert cli.returncode == 0 and "--attention-backend" in cli.stdout, cli.stderr[-3000:]
    triton = image.run("-c", "import triton, torch; print(torch.__version__)")
    # torch is the CPU build in the replay (the CUDA wheel is several GB and needs a GPU to prove anything).
    assert triton.returncode == 0 and triton.stdout.strip() == "2.13.0+cpu", triton.stderr[-3000:]
    assert "gcc" in image.dockerfile.apt_packages  # triton compiles its launchers at run time


def package_folders() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["package-dir"].values())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_every_package_folder_and_runs_as_the_pods_uid(name: str) -> None:
    dockerfile = parse(REPO / name)
    assert package_folders() <= {source for source, _ in dockerfile.copies}, "pip install . would fail"
    assert dockerfile.user == f"{RUN_AS_USER}:{RUN_AS_USER}" and RUN_AS_USER >= 10000
    ignore = (REPO / f"{name}.dockerignore").read_text()
    assert "!pyproject.toml" in ignore and all(f"!{folder}/**" in ignore for folder in package_folders())


@pytest.mark.parametrize("name", ENGINE_DOCKERFILES)
def test_engine_images_keep_their_caches_on_the_pods_emptydir(name: str) -> None:
    dockerfile = parse(REPO / name)
    assert dockerfile.entrypoint == '["python", "-m", "specfleet.engine"]'
    assert dockerfile.expose == str(ENGINE_PORT) and f'"--port", "{ENGINE_PORT}"' in dockerfile.cmd
    isvc = load_inference_service(REPO / "examples" / "smollm2-cpu.yaml")
    pod = render_deployment(isvc)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    writable = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in empty_dirs]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for var in ("SPECFLEET_CACHE", "XDG_CACHE_HOME", "HF_HOME"):
        assert dockerfile.env[var] == env[var], f"{name} and the rendered pod disagree on {var}"
        assert any(env[var].startswith(path) for path in writable), (
            f"{var}={env[var]} is on the read-only root"
        )


def test_operator_image_entry_point_matches_the_chart() -> None:
    dockerfile = parse(REPO / "operator/Dockerfile")
    chart = yaml.safe_load(
        (CHART / "templates" / "deployment.yaml").read_text().split("command:")[1].split("\n")[0]
    )
    assert dockerfile.entrypoint == json.dumps(chart)
    # the locked dependencies (base and `operator` extra, tests/operator/test_op_lock.py), then the project alone
    assert dockerfile.pip_installs == [["--no-deps", "-r", "requirements.lock"], ["--no-deps", "."]]
    assert ("operator/requirements.lock", "./") in dockerfile.copies and dockerfile.pip_check
    chart_uid = re.search(r"runAsUser: (\d+)", (CHART / "templates" / "deployment.yaml").read_text())
    assert chart_uid and int(chart_uid.group(1)) == RUN_AS_USER


def test_an_optional_handler_module_is_skipped_only_when_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specfleet.operator import cli

    (tmp_path / "sf_broken_plugin").mkdir()
    (tmp_path / "sf_broken_plugin" / "__init__.py").write_text("import sf_dependency_not_in_the_image\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "OPERATOR_MODULES", ())
    monkeypatch.setattr(cli, "OPTIONAL_MODULES", ("sf_absent_plugin.handlers",))
    assert cli.load_handlers() == []
    monkeypatch.setattr(cli, "OPTIONAL_MODULES", ("sf_broken_plugin.handlers",))
    with pytest.raises(ModuleNotFoundError, match="sf_dependency_not_in_the_image"):
        cli.load_handlers()
