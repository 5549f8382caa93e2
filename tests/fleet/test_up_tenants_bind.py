"""`specfleet up --tenants`: the gateway is the only door. Each service's router listens on a port of its own
behind it; on `--host` (say 0.0.0.0) that port would take any call without a key, past every quota, so with
tenants the routers listen on loopback (as the engines do) and only the gateway on `--host`. Nothing is
started here: the fleets are built as `specfleet up` builds them and their addresses read."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml

TENANTS = {"tenants": [{"name": "team-a", "keys": ["sk-team-a-0123456789abcdef"]}]}


EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml").read_text())


def service(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(EXAMPLE)
    doc["metadata"] = {"name": name}
    doc["spec"]["replicas"] = 1
    return doc


def test_with_tenants_the_services_routers_listen_on_loopback_only(tmp_path: Path) -> None:
    from specfleet.fleet.local import build_fleets, build_parser, load_services

    files = [tmp_path / "a.yaml", tmp_path / "b.yaml"]
    for file, name in zip(files, ("llm-a", "llm-b"), strict=True):
        file.write_text(yaml.safe_dump(service(name)))
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    two = ["-f", str(files[0]), "-f", str(files[1]), "--host", "0.0.0.0", "--no-tune"]
    built = []
    for argv, host in [
        ([*two, "--tenants", str(tmp_path / "tenants.yaml")], "127.0.0.1"),
        (
            [
                "-f",
                str(files[0]),
                "--host",
                "0.0.0.0",
                "--no-tune",
                "--tenants",
                str(tmp_path / "tenants.yaml"),
            ],
            "127.0.0.1",
        ),
        (two, "0.0.0.0"),  # without tenants a service's own router is as open as the gateway
    ]:
        args = build_parser().parse_args(argv)
        fleets = build_fleets(args, load_services(args.file))
        built += fleets
        assert [f.host for f in fleets] == [host] * len(fleets)
    for fleet in built:  # each made its log folder; nothing started in them
        assert fleet.log_dir is not None
        shutil.rmtree(fleet.log_dir)
