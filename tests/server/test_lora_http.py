"""LoRA through a real server (`specfleet serve --enable-lora --lora-modules ...`, the official openai client):
a request naming an adapter gets PEFT's merged model's tokens, /v1/models lists adapters with parent and
root, adapters load and unload over the admin port with the token, every bad adapter is a 400 naming what
is wrong, unloading with a stream in flight lets it finish, and the LoRA metrics are exported."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import free_port, start_server, stop_process
from lora_helpers import merged_greedy, save_random_adapter

pytestmark = pytest.mark.slow

TOKEN = "lora-admin-token"
PROMPT = [1, 450, 7483, 310, 3444, 338, 263, 4192, 310]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama.removeprefix("file://"), dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": save_random_adapter(
            base, root / "a", seed=1, r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]
        ),
        "b": save_random_adapter(
            base, root / "b", seed=2, r=16, lora_alpha=64, target_modules=["o_proj", "down_proj"]
        ),
        "big": save_random_adapter(
            base, root / "big", seed=3, r=32, lora_alpha=32, target_modules=["q_proj"]
        ),
    }


@pytest.fixture(scope="module")
def served(
    tiny_llama: str, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    admin_port = free_port()
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    proc, url = start_server(
        log,
        "--model",
        tiny_llama,
        "--max-model-len",
        "256",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--served-model-name",
        "tiny",
        "--lora-modules",
        f"a={adapters['a']}",
        "--admin-port",
        str(admin_port),
        env={"SPECFLEET_ADMIN_TOKEN": TOKEN},
    )
    try:
        yield {"url": url, "admin": f"http://127.0.0.1:{admin_port}", "log": log}
    finally:
        stop_process(proc)


def _client(served: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0)


def _complete(served: dict, model: str, max_tokens: int = NEW_TOKENS) -> str:
    out = _client(served).completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model  # the response names what the request asked for, as vLLM's
    return out.choices[0].text


def _merged_text(tiny_llama: str, adapter: Path | None) -> str:
    from transformers import AutoTokenizer

    path = tiny_llama.removeprefix("file://")
    tokens = merged_greedy(path, adapter, [PROMPT], NEW_TOKENS)[0]
    return AutoTokenizer.from_pretrained(path).decode(tokens)


def _admin(
    served: dict, path: str, body: dict, token: str | None = TOKEN, base: str = "admin"
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{served[base]}{path}", json=body, headers=headers, timeout=60)


def test_adapter_by_name_equals_peft_merged(served, tiny_llama, adapters):
    assert _complete(served, "a") == _merged_text(tiny_llama, adapters["a"])
    base = _complete(served, "tiny")
    assert base == _merged_text(tiny_llama, None)
    assert base != _complete(served, "a")
    chat = _client(served).chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "a" and chat.usage is not None and chat.usage.completion_tokens > 0


def test_models_lists_adapters_with_parent_and_root(served, adapters):
    models = {m.id: m for m in _client(served).models.list().data}
    assert set(models) >= {"tiny", "a"}
    a = models["a"].model_dump()
    assert a["parent"] == "tiny" and a["root"] == str(adapters["a"])
    assert _client(served).models.retrieve("a").model_dump() == a  # GET /v1/models/a: the same card


def test_load_and_unload_over_the_admin_port(served, tiny_llama, adapters):
    body = {"lora_name": "b", "lora_path": str(adapters["b"])}
    assert _admin(served, "/v1/load_lora_adapter", body, token=None).status_code == 401
    assert _admin(served, "/v1/load_lora_adapter", body, base="url").status_code == 404  # the API port
    with pytest.raises(openai.NotFoundError, match="model 'b' does not exist"):
        _complete(served, "b")
    loaded = _admin(served, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'b' added successfully."
    assert _complete(served, "b") == _merged_text(tiny_llama, adapters["b"])
    assert "b" in {m.id for m in _client(served).models.list().data}
    gone = _admin(served, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert gone.status_code == 200 and "'b' removed" in gone.text
    with pytest.raises(openai.NotFoundError):
        _complete(served, "b")
    again = _admin(served, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert again.status_code == 400 and "lora_name='b' is not loaded" in again.json()["error"]["message"]


def _broken(adapters: dict[str, Path], tmp_path: Path, name: str, **config) -> Path:
    folder = tmp_path / name
    shutil.copytree(adapters["a"], folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def test_bad_adapters_are_400s_naming_the_problem(served, adapters, tmp_path):
    corrupt = _broken(adapters, tmp_path, "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    cases = {
        "big": (str(adapters["big"]), "rank r=32 exceeds --max-lora-rank=16"),
        "missing": (str(tmp_path / "nowhere"), "is not a folder"),
        "corrupt": (str(corrupt), "is not a readable safetensors file"),
        "dora": (str(_broken(adapters, tmp_path, "dora", use_dora=True)), "DoRA"),
        "fc": (
            str(_broken(adapters, tmp_path, "fc", target_modules=["fc1"])),
            "target_modules ['fc1'] are modules the model does not have",
        ),
        "tiny": (str(adapters["b"]), "shadows the served model's name"),
    }
    for name, (path, message) in cases.items():
        r = _admin(served, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 400, (name, r.text)
        assert message in r.json()["error"]["message"], (name, r.text)
    assert not {"big", "missing", "corrupt", "dora", "fc"} & {
        m.id for m in _client(served).models.list().data
    }


def test_unload_lets_streams_in_flight_finish(served, adapters):
    assert (
        _admin(
            served, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["b"])}
        ).status_code
        == 200
    )
    started, tokens, finish = threading.Event(), [], []

    def stream() -> None:
        for chunk in _client(served).completions.create(
            model="c",
            prompt=PROMPT,
            max_tokens=120,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            started.set()
            assert chunk.model == "c"
            tokens.append(chunk.choices[0].text)
            if chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    # a load during the stream does not break it either
    assert (
        _admin(
            served, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(adapters["a"])}
        ).status_code
        == 200
    )
    assert _admin(served, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    thread.join(120)
    assert finish == ["length"]
    with pytest.raises(openai.NotFoundError):
        _complete(served, "c")


def _open_when_read(fifo: Path, timeout_s: float = 60):
    """The FIFO opened for writing once a reader has it open (the engine's read of the adapter's file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader has it open
        except OSError:
            assert time.monotonic() < deadline, "the engine never opened the adapter's file"
            time.sleep(0.01)
            continue
        os.set_blocking(fd, True)
        return os.fdopen(fd, "wb")


def test_a_load_never_stalls_streams_in_flight(served, adapters, tmp_path):
    """The adapter's weights come through a FIFO, as from a volume that answers slowly: its read waits on the
    writer (opening the FIFO returns once the engine opened it to read), and streams of the base model keep
    producing tokens all that time; then the load completes and serves the adapter."""
    folder = tmp_path / "slow"
    folder.mkdir()
    shutil.copy(adapters["a"] / "adapter_config.json", folder)
    fifo = folder / "adapter_model.safetensors"
    os.mkfifo(fifo)
    arrivals: list[float] = []
    stop = threading.Event()

    def streams() -> None:  # one stream after another until told to stop
        while not stop.is_set():
            for _ in _client(served).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
            ):
                arrivals.append(time.monotonic())

    streamer = threading.Thread(target=streams)
    streamer.start()
    loaded: list[httpx.Response] = []
    body = {"lora_name": "slow", "lora_path": str(folder)}
    loader = threading.Thread(target=lambda: loaded.append(_admin(served, "/v1/load_lora_adapter", body)))
    try:
        loader.start()
        with _open_when_read(fifo) as writer:
            opened = time.monotonic()
            deadline = opened + 30
            while sum(t > opened for t in arrivals) < 20 and time.monotonic() < deadline:
                time.sleep(0.02)
            produced = sum(t > opened for t in arrivals)
            assert loader.is_alive() and not loaded  # the load still waits on its file
            writer.write((adapters["a"] / "adapter_model.safetensors").read_bytes())
        assert produced >= 20, f"only {produced} tokens streamed while the adapter's file was being read"
        loader.join(60)
        assert loaded and loaded[0].status_code == 200, loaded
    finally:
        stop.set()
        streamer.join(120)
    assert _complete(served, "slow") == _complete(served, "a")  # the same weights, through the FIFO
    assert _admin(served, "/v1/unload_lora_adapter", {"lora_name": "slow"}).status_code == 200


def test_lora_metrics(served):
    _complete(served, "a")
    text = httpx.get(f"{served['url']}/metrics", timeout=30).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and "running_lora_adapters=" in info[0]
    loads = [line for line in text.splitlines() if line.startswith("specfleet_lora_adapter_loads_total")]
    assert loads and float(loads[0].split()[-1]) >= 1
    assert "specfleet_lora_adapter_load_seconds_count" in text
    # the request on adapter a, in its own series (the tuner's goodput per adapter reads them)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    labels = '{lora_name="a",model_name="tiny"}'
    assert float(lines[f"specfleet_lora_generation_tokens_total{labels}"]) >= NEW_TOKENS
    assert float(lines[f"specfleet_lora_time_to_first_token_seconds_count{labels}"]) >= 1
    assert float(lines[f"specfleet_lora_time_per_output_token_seconds_count{labels}"]) >= 1
    assert 'lora_name="b"' not in text  # b, unloaded by an earlier test (or never loaded): no series
