"""The model cache on a cold start: processes that ask for one GGUF conversion at once convert it once, every
one of them gets the whole folder, and the folder, once whole, never vanishes or changes under a reader.

The conversion itself is stubbed (transformers replaced in the child processes by a module whose loaders
write a folder slowly, counting each conversion in a shared file): what is tested is who converts, when the
folder appears and what happens to it, in about the time of the processes' imports. Starting from the real
bundled GGUF with an empty cache is tests/fleet/test_cold_start.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from helpers import wait_for
from specfleet.engine import model_source
from specfleet.engine.cache_dir import CacheError, ensure_file, ensure_folder
from specfleet.engine.python_child import python_command

# Processes converting at once: the API server and the engine core of `specfleet serve`, plus the router's
# tokenizer and a second engine of `specfleet up`: four covers the real cold start with one to spare.
PROCESSES = 4
# How long a stub conversion takes: long enough that processes started together overlap in it (their
# imports end within ~1 s of each other on a loaded 2-core runner, and they start it on one signal).
CONVERT_S = 1.5

# The child: stub transformers, wait for the go file, resolve the GGUF, read back every file of the folder.
CHILD = r"""
import json, os, sys, time
from pathlib import Path
from types import ModuleType

gguf, go, count, convert_s = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
FILES = {"config.json": b"{}", "model.safetensors": b"w" * 4096, "tokenizer.json": b"{}"}


class Stub:
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer.json").write_bytes(FILES["tokenizer.json"])


fake = ModuleType("transformers")
fake.AutoTokenizer = fake.AutoModelForCausalLM = Stub
sys.modules["transformers"] = fake
from specfleet.engine import model_source
from specfleet.engine.cache_dir import CacheError, ensure_file, ensure_folder


def save_plain(model, folder):
    with open(count, "a") as out:  # one line per conversion, from whichever process makes it
        out.write(f"{os.getpid()}\n")
    (Path(folder) / "config.json").write_bytes(FILES["config.json"])
    time.sleep(convert_s)  # a partial folder, for as long as a reader could look at it
    (Path(folder) / "model.safetensors").write_bytes(FILES["model.safetensors"])


model_source._save_plain = save_plain
print("ready", flush=True)
while not go.exists():
    time.sleep(0.01)
path = model_source.resolve_model(f"file://{gguf}").path
time.sleep(convert_s)  # still reading the folder while the others finish
read = {name: (path / name).read_bytes() for name in FILES}
assert read == FILES, {name: len(data) for name, data in read.items()}
print(json.dumps({"path": str(path)}), flush=True)
"""


def _child(tmp_path: Path, gguf: Path, go: Path, count: Path, convert_s: float) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen(
        python_command(str(script), str(gguf), str(go), str(count), str(convert_s)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SPECFLEET_CACHE": str(tmp_path / "cache")},
    )


def _gguf(tmp_path: Path) -> Path:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stub: the converter is stubbed")
    return gguf


class FolderWatch:
    """Polls `models/` from a thread: once a folder there is whole, it must stay the same folder, whole."""

    def __init__(self, models: Path) -> None:
        self.models = models
        self.errors: list[str] = []
        self.seen: dict[Path, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            for folder, inode in list(self.seen.items()):
                try:
                    now = os.stat(folder).st_ino
                    whole = (folder / model_source.CONVERTED).is_file()
                except FileNotFoundError:
                    now, whole = None, False
                if now != inode or not whole:
                    self.errors.append(f"{folder.name}: inode {inode} -> {now}, whole={whole}")
            if self.models.is_dir():
                for folder in self.models.iterdir():
                    if folder.name.startswith("."):  # a maker's own folder, not yet the entry
                        continue
                    if folder not in self.seen and (folder / model_source.CONVERTED).is_file():
                        self.seen[folder] = os.stat(folder).st_ino
            time.sleep(0.005)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_processes_converting_one_gguf_at_once_convert_it_once(tmp_path: Path) -> None:
    gguf, go, count = _gguf(tmp_path), tmp_path / "go", tmp_path / "conversions"
    children = [_child(tmp_path, gguf, go, count, CONVERT_S) for _ in range(PROCESSES)]
    try:
        for child in children:  # every child imported and waiting: they start converting together
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line.strip() == "ready", (line, child.stderr.read() if child.stderr else "")
        watch = FolderWatch(tmp_path / "cache" / "models")
        go.touch()
        outs = [child.communicate(timeout=120) for child in children]
        watch.stop()
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    for child, (_, err) in zip(children, outs, strict=True):
        assert child.returncode == 0, err[-3000:]
    paths = {json.loads(out.splitlines()[-1])["path"] for out, _ in outs}
    assert len(paths) == 1, paths
    conversions = count.read_text().split()
    assert len(conversions) == 1, f"converted {len(conversions)} times (pids {conversions}), not once"
    assert not watch.errors, f"a whole folder changed under its readers: {watch.errors[:5]}"
    models = tmp_path / "cache" / "models"
    target = Path(paths.pop())
    assert sorted(p.name for p in models.iterdir()) == sorted([target.name, f".{target.name}.lock"])
    assert sorted(p.name for p in target.iterdir()) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", model_source.CONVERTED]
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_conversion_killed_midway_leaves_nothing_in_the_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed while it converts (an OOM kill, a Ctrl-C'd first start) holds the lock and a
    partial folder; the next start converts again and removes the partial."""
    gguf, go, count = _gguf(tmp_path), tmp_path / "go", tmp_path / "conversions"
    go.touch()
    child = _child(tmp_path, gguf, go, count, 60.0)
    try:
        wait_for("the child to start converting", lambda: count.exists() and count.read_text(), 90)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    models = tmp_path / "cache" / "models"
    assert any(p.name.startswith(".") for p in models.iterdir()), "the killed conversion left no partial"

    def save_plain(model: object, folder: Path) -> None:
        (folder / "config.json").write_text("{}")

    stub = type("Stub", (), {"from_pretrained": classmethod(lambda cls, *a, **k: cls())})
    stub.save_pretrained = lambda self, folder: (Path(folder) / "tokenizer.json").write_text("{}")
    fake = ModuleType("transformers")
    setattr(fake, "AutoTokenizer", stub)  # noqa: B010 (a module built at run time has no such attribute)
    setattr(fake, "AutoModelForCausalLM", stub)  # noqa: B010
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setattr(model_source, "_save_plain", save_plain)
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path / "cache"))
    path = model_source.resolve_model(f"file://{gguf}").path
    assert (path / model_source.CONVERTED).is_file() and (path / "tokenizer.json").is_file()
    assert sorted(p.name for p in models.iterdir()) == sorted([path.name, f".{path.name}.lock"])


def test_a_folder_without_its_marker_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder a crash left unmarked (an older version's partial rename or removal) is not whole: remade."""

    target = tmp_path / "entry"
    target.mkdir()
    (target / "half").write_text("")

    def fill(folder: Path) -> None:
        (folder / "data").write_text("whole")
        (folder / "done").write_text("")

    assert ensure_folder(target, fill, marker="done") == target
    assert sorted(p.name for p in target.iterdir()) == ["data", "done"]
    assert ensure_folder(target, lambda _: pytest.fail("a whole entry was made again"), marker="done")


def test_threads_asking_for_one_file_make_it_once(tmp_path: Path) -> None:
    """The config cache's entries: the lock is per open file, so threads of one process wait for each other."""
    target, made, results = tmp_path / "configs" / "k.json", [], []

    def write(path: Path) -> None:
        made.append(path)
        time.sleep(0.2)  # long enough that the other threads arrive while it is being made
        path.write_text('{"whole": true}')

    def ask() -> None:
        results.append(json.loads(ensure_file(target, write).read_text()))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(made) == 1 and results == [{"whole": True}] * 6
    assert sorted(p.name for p in target.parent.iterdir()) == [".k.json.lock", "k.json"]


def test_an_unwritable_cache_says_which_folder_and_what_to_set(tmp_path: Path) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    with pytest.raises(CacheError, match="SPECFLEET_CACHE"):
        ensure_file(blocker / "configs" / "k.json", lambda p: p.write_text("{}"))
