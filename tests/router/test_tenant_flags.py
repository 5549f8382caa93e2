"""The tenant flags of `specfleet router` and `specfleet up` refuse what cannot work, before anything starts,
with a message naming the flag or the file's field."""

from __future__ import annotations

from pathlib import Path

import pytest
from specfleet.fleet.local import main as up_main
from specfleet.router.cli import main as router_main

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml")


def test_router_refuses_tenants_without_the_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants: []\n")
    assert router_main(["--endpoint", "http://127.0.0.1:9", "--tenants", str(tenants)]) == 2
    assert "are the gateway's: add --gateway" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "extra", "says"),
    [
        ("tenants:\n  - {name: a, keys: [sk-0123456789abcdef], tpm: lots}\n", [], "tenants[0].tpm"),
        ("tenants: {a: 1}\n", [], "`tenants` must be a list"),
        ("tenants: []\n", ["--replicas", "0"], "--replicas=0 must be >= 1"),
        (None, ["--redis-url", "redis://127.0.0.1:9/0"], "--redis-url needs tenants"),
    ],
)
def test_up_refuses_a_bad_tenants_file_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, extra: list[str], says: str
) -> None:
    args = ["-f", EXAMPLE, *extra]
    if content is not None:
        (tmp_path / "tenants.yaml").write_text(content)
        args += ["--tenants", str(tmp_path / "tenants.yaml")]
    assert up_main(args) == 2
    assert says in capsys.readouterr().err
