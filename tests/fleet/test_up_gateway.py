"""`specfleet up -f a.yaml -f b.yaml`: two InferenceServices as local fleets of real engines (the tiny llama)
behind one endpoint, driven by the official openai client: routing by model and alias, /v1/models as the
union, an unknown model's 404 listing the known ones, the shared name split by weight, and an edit of one
file's routing.weight followed within one --discovery-interval; SIGINT stops everything cleanly."""

from __future__ import annotations

import asyncio
import copy
import errno
import shutil
import signal
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import OutputWatch, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml").read_text())
INTERVAL_S = 0.5


def service(name: str, source: str, weight: int, aliases: list[str]) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(EXAMPLE)
    doc["metadata"] = {"name": name}
    doc["spec"]["model"] = {"source": source, "dtype": "float32", "maxModelLen": 256}
    doc["spec"]["routing"] = {"weight": weight, "aliases": aliases, "policy": "round-robin"}
    return doc


def test_up_with_two_files_serves_both_models_behind_one_endpoint(tiny_llama: str, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    files = {
        "llm-v1": tmp_path / "v1.yaml",
        "llm-v2": tmp_path / "v2.yaml",
    }
    files["llm-v1"].write_text(yaml.safe_dump(service("llm-v1", tiny_llama, 100, ["llm", "stable"])))
    files["llm-v2"].write_text(yaml.safe_dump(service("llm-v2", tiny_llama, 100, ["llm"])))
    port = free_port()
    out = OutputWatch.start(
        "-m",
        "specfleet.fleet.local",
        "-f",
        str(files["llm-v1"]),
        "-f",
        str(files["llm-v2"]),
        "--port",
        str(port),
        "--no-tune",
        "--discovery-interval",
        str(INTERVAL_S),
        "--engine-arg=--kv-cache-gib=0.05",
    )
    proc = out.proc
    try:
        out.wait_for(f"at http://127.0.0.1:{port}/v1 (gateway over 2 services", 240)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )

        def service_of(model: str) -> str:
            raw = client.completions.with_raw_response.create(model=model, prompt="up", max_tokens=1)
            return raw.headers["x-specfleet-service"]

        assert [m.id for m in client.models.list().data] == ["llm", "llm-v1", "llm-v2", "stable"]
        assert service_of("stable") == "default/llm-v1" and service_of("llm-v2") == "default/llm-v2"
        chat = client.chat.completions.create(
            model="llm-v1", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert chat.choices
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="llm-v3", prompt="x", max_tokens=1)
        assert "llm, llm-v1, llm-v2, stable" in str(missing.value)
        assert Counter(service_of("llm") for _ in range(4)) == {"default/llm-v1": 2, "default/llm-v2": 2}

        # the canary's file now says weight 0: within one interval nothing new reaches it
        files["llm-v2"].write_text(yaml.safe_dump(service("llm-v2", tiny_llama, 0, ["llm"])))
        edited = time.monotonic()
        out.wait_for("[gateway] default/llm-v2: names llm-v2, llm, weight 0", 10)
        assert time.monotonic() - edited <= INTERVAL_S + 1.0
        assert {service_of("llm") for _ in range(4)} == {"default/llm-v1"}

        proc.send_signal(signal.SIGINT)
        out.wait_for("stopped; engine exit codes", 60)
        assert proc.wait(30) == 0, out.tail()
    finally:
        out.kill()


def test_up_refuses_two_files_naming_one_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specfleet.fleet.local import main

    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text(
            yaml.safe_dump(service("llm", "bundled://smollm2-135m-instruct", 100, []))
        )
    assert main(["-f", str(tmp_path / "a.yaml"), "-f", str(tmp_path / "b.yaml")]) == 2
    assert "default/llm is already given by another -f file" in capsys.readouterr().err


def test_up_whose_gateway_port_is_taken_stops_the_engines_it_started(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specfleet.fleet.local import run_gateway
    from specfleet.fleet.supervisor import LocalFleet
    from specfleet.operator import load_inference_service

    files = [tmp_path / "v1.yaml", tmp_path / "v2.yaml"]
    for file, name in zip(files, ("llm-v1", "llm-v2"), strict=True):
        file.write_text(yaml.safe_dump(service(name, tiny_llama, 100, [])))
    fleets = [
        LocalFleet(
            load_inference_service(str(file)),
            tune=False,
            engine_extra_args=["--kv-cache-gib=0.05"],
        )
        for file in files
    ]
    with socket.socket() as taken:  # the gateway's port, held by someone else
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            code = asyncio.run(run_gateway(fleets, [str(f) for f in files], "127.0.0.1", port, INTERVAL_S))
            left = [e.url for fleet in fleets for e in fleet.engines if e.running]
        finally:
            for engine in (e for fleet in fleets for e in fleet.engines):
                engine.kill()  # whatever the code under test left running
    assert code == 1
    assert f"specfleet up: [Errno {errno.EADDRINUSE}]" in capsys.readouterr().err
    assert sum(len(fleet.engines) for fleet in fleets) == 2 and left == []


def test_with_several_files_each_service_s_lines_carry_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two services' tuner, autoscaler and engine lines interleave on one terminal: each says whose it is.
    One service's lines stay as they were."""
    from specfleet.fleet.local import build_fleets, build_parser, load_services
    from specfleet.tuner.loop import Tick
    from specfleet.tuner.types import Decision, Observation

    files = [tmp_path / "v1.yaml", tmp_path / "v2.yaml"]
    for file, name in zip(files, ("llm-v1", "llm-v2"), strict=True):
        file.write_text(yaml.safe_dump(service(name, "bundled://smollm2-135m-instruct", 100, [])))
    hold = Tick(Decision(0.0, None, "within the SLO", "hold"), Observation(time=0.0, config=None), None)

    args = build_parser().parse_args(["-f", str(files[0]), "-f", str(files[1]), "--tune"])
    v1, v2 = build_fleets(args, load_services(args.file))
    v1.say("[fleet] engine 0 exited with code 1")
    assert v2.on_tick is not None
    v2.on_tick(hold)
    assert capsys.readouterr().out.splitlines() == [
        "default/llm-v1 [fleet] engine 0 exited with code 1",
        "default/llm-v2 [tuner] hold: within the SLO",
    ]

    args = build_parser().parse_args(["-f", str(files[0]), "--tune"])
    (alone,) = build_fleets(args, load_services(args.file))
    alone.say("[fleet] engine 0 exited with code 1")
    assert alone.on_tick is not None
    alone.on_tick(hold)
    assert capsys.readouterr().out.splitlines() == [
        "[fleet] engine 0 exited with code 1",
        "[tuner] hold: within the SLO",
    ]
    for fleet in (v1, v2, alone):  # each made its log folder; nothing started in them
        assert fleet.log_dir is not None
        shutil.rmtree(fleet.log_dir)
