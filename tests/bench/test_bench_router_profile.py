"""`specfleet bench router-profile`: profiled functions are put in their package, and the whole run (the
router as a child process, cProfile switched on by signal for the load only) ends with the router's CPU per
request and its profile, with the raw front's own functions in it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from specfleet.bench.router_profile import main, package, router_folder
from specfleet.engine.python_child import python_command


def test_functions_are_put_in_their_package() -> None:
    venv = "/work/.venv/lib/python3.11/site-packages"
    installed = router_folder(None)
    assert Path(installed, "front.py").is_file()  # this checkout's router
    assert package(f"{installed}/front.py", "data_received", installed) == "router/front.py"
    assert package("/tmp/old/router/proxy.py", "forward", "/tmp/old/router") == "router/proxy.py"
    assert package("/tmp/old/router/proxy.py", "forward", installed) == "proxy.py"  # not the profiled one
    assert package(f"{venv}/aiohttp/web_protocol.py", "data_received", installed) == "aiohttp"
    assert package("/usr/lib/python3.11/logging/__init__.py", "info", installed) == "logging"
    assert package("/usr/lib/python3.11/json/decoder.py", "decode", installed) == "json"
    assert package("~", "<method 'write' of 'uvloop.loop.TCPTransport' objects>", installed) == "uvloop (C)"
    parse = "<method 'feed_data' of 'httptools.parser.parser.HttpParser' objects>"
    assert package("~", parse, installed) == "httptools (C)"
    assert package("~", "<built-in method builtins.len>", installed) == "builtins (C)"


@pytest.mark.slow
def test_the_profile_runs_end_to_end_on_the_router(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = ["--concurrency", "2", "--requests", "200", "--out", str(out)]
    proc = subprocess.run(
        python_command("-m", "specfleet.cli.main", "bench", "router-profile", *argv),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["cpu_us_per_request"] > 0 and summary["rps"] > 0 and summary["requests"] == 200
    assert summary["user_us_per_request"] + summary["system_us_per_request"] == pytest.approx(
        summary["cpu_us_per_request"], abs=0.2
    )
    profiled = json.loads(out.read_text())["profiled"]
    assert profiled["by_package_us_per_request"]["router/front.py"] > 0
    assert any("front.py" in row["function"] for row in profiled["top_functions"])
    # the load only: nothing of the router's startup (imports, argument parsing) is in the profile
    assert not any(
        "importlib" in row["function"] or "argparse" in row["function"] for row in profiled["top_functions"]
    )


def test_bad_arguments_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--concurrency", "0"]) == 2 and "--concurrency=0 must be >= 1" in capsys.readouterr().err
    assert main(["--max-resumes", "-1"]) == 2 and "--max-resumes=-1 must be >= 0" in capsys.readouterr().err
    assert main(["--router-src", "/nonexistent"]) == 2
    assert "--router-src=/nonexistent holds no router" in capsys.readouterr().err
