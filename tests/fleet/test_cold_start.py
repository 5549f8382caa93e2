"""The first start on a new machine: the README's first command, and two engines started at once, each with
an empty model cache (`SPECFLEET_CACHE` and `HOME` in a fresh folder), as a new user runs them. Every
process that needs the bundled model (API servers, engine cores, the router's tokenizer) asks for its
conversion at once; it must happen once and no process may see the folder half-made or vanishing
(engine/cache_dir.py). The engine cores build the native kernels at once too: one compiles, the others wait
for it (kernels/cpu_build.py). Everything else in the suite starts from a warm cache."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, stop_process, wait_http_ready

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SPECFLEET = Path(sys.executable).parent / "specfleet"  # .venv/bin/specfleet, the README's command
# A cold start converts the GGUF (~30 s on a loaded 2-core runner), builds the native kernels and loads the
# model (here four processes at once): minutes, not seconds, where the runner is shared.
READY_S = 400.0


def _fresh_machine(tmp_path: Path) -> dict[str, str]:
    """This environment with an empty model cache and home, as on a machine that never ran specfleet."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE")}
    (tmp_path / "home").mkdir()
    env.update(
        SPECFLEET_CACHE=str(tmp_path / "cache"),
        HOME=str(tmp_path / "home"),
        HF_HUB_OFFLINE="1",  # the bundled model needs no network; the tests never reach it
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _chat(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, max_tokens=8, messages=[{"role": "user", "content": "Say hello"}]
    )
    content = chat.choices[0].message.content
    assert content, chat
    return content


def _events(event: str, *logs: Path) -> int:
    return sum(log.read_text(errors="replace").count(f"event={event}") for log in logs)


def _assert_one_whole_model(cache: Path) -> None:
    entries = sorted(p.name for p in (cache / "models").iterdir())
    whole = [name for name in entries if not name.startswith(".")]
    assert len(whole) == 1 and entries == sorted([*whole, f".{whole[0]}.lock"]), entries  # nothing partial
    assert (cache / "models" / whole[0] / "specfleet-converted.json").is_file()


def _serve(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`specfleet serve` of the bundled model with a small KV cache (a faster start), output to `log`."""
    port = free_port()
    cmd = [str(SPECFLEET), "serve", "--model", "bundled://smollm2-135m-instruct", "--port", str(port)]
    cmd += ["--max-model-len", "512", "--kv-cache-gib", "0.1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.timeout(900)
def test_the_readme_first_command_and_two_engines_started_at_once_on_one_empty_cache(tmp_path: Path) -> None:
    """One cold start for both cases (a conversion is most of a cold start's minute): the README's
    `specfleet up` (its engine and its router) and two `specfleet serve` engines, all started at once on the
    same empty cache, all ask for the conversion together."""
    env, port, log = _fresh_machine(tmp_path), free_port(), tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(SPECFLEET), "up", "-f", "examples/smollm2-cpu.yaml", "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    engines: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    try:
        for i in range(2):
            engine_log = tmp_path / f"engine-{i}.log"
            engines.append((*_serve(env, engine_log), engine_log))
        wait_http_ready(f"{url}/ready", proc, log, timeout=READY_S)
        for engine, engine_url, engine_log in engines:
            wait_http_ready(f"{engine_url}/ready", engine, engine_log, timeout=READY_S)
        for served in (url, *(engine_url for _, engine_url, _ in engines)):
            _chat(served)
        # the two engines' logs: the conversion was theirs, or `up`'s (whose router does not log it)
        served_logs = [engine_log for _, _, engine_log in engines]
        by_serve = {event: _events(event, *served_logs) for event in ("gguf_convert", "native_build")}
        proc.send_signal(signal.SIGINT)
        code = proc.wait(90)
        assert code == 0, log.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for engine, _, _ in engines:
            stop_process(engine)
    printed = log.read_text(errors="replace")
    assert "stopped; engine exit codes [0]" in printed, printed[-3000:]
    logs_at = re.search(r"logs in (\S+)", printed)
    assert logs_at, printed[-3000:]
    up_logs = list(Path(logs_at[1]).glob("engine-*.log"))
    by_up = {event: _events(event, *up_logs) for event in ("gguf_convert", "native_build")}
    assert by_serve["gguf_convert"] + by_up["gguf_convert"] <= 1, (by_serve, by_up)
    # three engine cores on one empty cache: the native kernels compiled once (where a compiler is), the
    # others waited for that build
    from specfleet.kernels import cpu_build

    assert by_serve["native_build"] + by_up["native_build"] == int(cpu_build.available()), (by_serve, by_up)
    _assert_one_whole_model(tmp_path / "cache")
