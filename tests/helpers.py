"""Test helpers shared by every test folder (tests/ is on sys.path through the rootdir conftest): free
ports, waiting until something holds or a server answers ready, serving an ASGI app from a thread, starting
an engine server process and stopping a child process, and tiny random-weight checkpoints (torch and
transformers are imported inside those functions: tests that never load a model import this module too)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from specfleet.engine.python_child import python_command
from specfleet.fleet.supervisor import free_port

if TYPE_CHECKING:
    from specfleet.sim.profile import Profile

__all__ = [
    "copy_tokenizer",
    "cpu_like_profile",
    "free_port",
    "OutputWatch",
    "serve_in_thread",
    "start_server",
    "stop_process",
    "tiny_config",
    "tiny_model",
    "tiny_state",
    "wait_for",
    "wait_http_ready",
    "write_tiny_checkpoint",
]

# The bundled model with a small cache: what a test server needs unless it says otherwise.
SERVER_ARGS = (
    "--model",
    "bundled://smollm2-135m-instruct",
    "--max-model-len",
    "512",
    "--kv-cache-gib",
    "0.1",
)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.2) -> Any:
    """Polls `check` until it returns something truthy (returned), or fails naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def stream_completion(
    url: str, body: dict[str, Any], timeout: float = 60.0, on_chunk: Callable[[], object] | None = None
) -> tuple[int, int, str | None]:
    """A streamed /v1/completions to its end: (status, completion tokens, finish_reason); `on_chunk` is called
    at each chunk. Tokens are read from the closing usage chunk, not counted as chunks: a reader that falls
    behind gets the steps it missed as one merged chunk (docs/engine_core.md, Streams)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    tokens, finish = 0, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if on_chunk is not None:
                on_chunk()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return response.status_code, tokens, finish


def wait_http_ready(
    url: str,
    proc: subprocess.Popen[Any] | None = None,
    log: Path | None = None,
    timeout: float = 180.0,
    interval: float = 0.3,
) -> None:
    """Polls GET `url` until it answers 200; fails at once with the log's tail if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log is not None else ""
            raise AssertionError(
                f"{proc.args!r} exited with {proc.returncode} before {url} was ready:\n{tail}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not ready after {timeout}s")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)


def serve_in_thread(app: Any) -> tuple[Any, threading.Thread, str]:
    """A real uvicorn server for `app` on a free loopback port, run in a daemon thread, once it has started:
    (server, thread, base URL). Stop it with `server.should_exit = True`, then `thread.join(...)`."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def stop_process(proc: subprocess.Popen[Any], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(
    log_path: Path, *args: str, env: dict[str, str] | None = None, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m specfleet.engine` (the engine server: `SERVER_ARGS` unless `args` give a `--model`, then
    `args`) on `port` or a free one, once /ready answers 200: (process, base URL). Its output goes to
    `log_path`; `env` is added to this process's environment. Killed if it never gets ready."""
    port = port or free_port()
    defaults = () if "--model" in args else SERVER_ARGS
    cmd = python_command("-m", "specfleet.engine", *defaults, *args, "--port", str(port))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(f"{url}/ready", proc, log_path)
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    return proc, url


# The tokenizer files a served checkpoint folder needs (the bundled model's: a vocab of 49152, tiny_config's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_TINY_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def tiny_config(kind: str = "llama", **overrides: Any) -> Any:
    """The transformers config of a tiny `kind` model (llama, mistral without a sliding window, qwen2 with
    q/k/v bias, qwen3 with q/k norms and head_dim 32, phi3 with fused projections, gemma2/gemma3 (give
    head_dim), mixtral and qwen3moe with 4 experts, top 2, of MLP 64): 2 layers, hidden 64, MLP 128, 4
    attention heads over 2 KV heads (head dim 16, qwen3's 32), the bundled tokenizer's vocab of 49152, 256
    positions, untied embeddings; `overrides` replace or add fields."""
    import transformers

    config_class, architecture = _TINY_ARCHITECTURES[kind]
    fields: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if kind in ("mistral", "mixtral"):
        fields["sliding_window"] = None
    if kind == "mixtral":  # 4 experts of MLP 64, top 2 (Mixtral's intermediate_size is each expert's)
        fields.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
    if kind == "qwen3moe":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16)
    if kind == "qwen3":
        fields["head_dim"] = 32  # Qwen3's head_dim is its own field, here not hidden / heads
    fields["architectures"] = [architecture]
    return getattr(transformers, config_class)(**{**fields, **overrides})


def tiny_model(config: Any, *, seed: int = 0, std: float | None = None) -> Any:
    """A float32 transformers model of `config` in eval mode, its weights drawn after
    `torch.manual_seed(seed)`: transformers' init, or every parameter drawn again from N(0, std) (std 0.2
    gives logits spread enough that greedy and sampled tokens vary)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, std)
    return model


def tiny_state(config: Any, *, seed: int = 0, std: float | None = None) -> dict[str, Any]:
    """The weights of `tiny_model(config, seed=seed, std=std)` by name, as tensors of their own."""
    model = tiny_model(config, seed=seed, std=std)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def copy_tokenizer(source: Path, path: Path, names: tuple[str, ...] = TOKENIZER_FILES) -> None:
    """Copies the tokenizer files `names` from the model folder `source` into `path`."""
    for name in names:
        shutil.copy(source / name, path / name)


def write_tiny_checkpoint(
    path: Path,
    config: Any,
    *,
    seed: int = 0,
    std: float | None = None,
    tokenizer_from: Path | None = None,
    tokenizer_files: tuple[str, ...] = TOKENIZER_FILES,
) -> Path:
    """Saves `tiny_model(config, seed=seed, std=std)` as a transformers checkpoint in `path` (config,
    generation config, safetensors), with `tokenizer_files` copied from the model folder `tokenizer_from`
    when given. Returns `path`: serve it as `f"file://{path}"`."""
    path = Path(path)
    tiny_model(config, seed=seed, std=std).save_pretrained(path)
    if tokenizer_from is not None:
        copy_tokenizer(Path(tokenizer_from), path, tokenizer_files)
    return path


def cpu_like_profile(num_kv_blocks: int, startup_s: float = 0.0) -> Profile:
    """The simulator's test step cost, CPU-like: a 20 ms floor to 8 decode tokens, then 3 ms per token (188 ms
    at 64), and 2 ms per prompt token; `startup_s` is a new replica's start-up delay (autoscaling tests)."""
    from specfleet.sim.profile import Profile

    return Profile(
        "test",
        "measured",
        False,
        ((1, 0.020), (8, 0.020), (64, 0.188)),
        prefill_s_per_token=0.002,
        num_kv_blocks=num_kv_blocks,
        block_size=16,
        startup_s=startup_s,
    )


class OutputWatch:
    """A child process's stdout (stderr merged into it) read line by line on a thread, so that a test can wait
    for a line while the process runs and show the output's tail when it fails."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None, "start the process with stdout=subprocess.PIPE"
        stdout = proc.stdout
        self.proc = proc
        self.seen: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [self._lines.put(raw.decode(errors="replace")) for raw in stdout], daemon=True
        ).start()

    @classmethod
    def start(cls, *args: str) -> OutputWatch:
        """`python ARGS` as a child (`-m specfleet.fleet.local ...`), its output watched."""
        proc = subprocess.Popen(
            python_command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        return cls(proc)

    def kill(self) -> None:
        """A test's cleanup: the child killed if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def tail(self) -> str:
        return "".join(self.seen)[-3000:]

    def wait_for(self, text: str, timeout_s: float) -> None:
        """Until a line holds `text`; fails with the output's tail when the process ended or time ran out."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.seen):
            assert self.proc.poll() is None or not self._lines.empty(), self.tail()
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s}s:\n" + self.tail()
            try:
                # a line is taken as soon as it comes; 0.2 s is how often the deadline and the process are
                # checked while none does
                self.seen.append(self._lines.get(timeout=0.2))
            except queue.Empty:
                pass
