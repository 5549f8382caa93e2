"""`specfleet up` runs spec.adapters from the same YAML as the cluster (examples/smollm2-lora.yaml, its
file:// sources pointed at adapters PEFT saved): the engines load them at start, `model` naming one goes
through the router to an engine that serves it, and the answer is the adapter's, not the base's."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from helpers import OutputWatch, free_port
from lora_helpers import save_random_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-lora.yaml"


def test_up_serves_the_adapters_of_the_yaml(tiny_llama: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama.removeprefix("file://"), dtype=torch.float32)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["source"] = tiny_llama
    doc["spec"]["model"]["maxModelLen"] = 256
    for i, adapter in enumerate(doc["spec"]["adapters"]):
        path = save_random_adapter(
            base,
            tmp_path / adapter["name"],
            seed=i,
            r=adapter["rank"],
            lora_alpha=32,
            target_modules=["q_proj", "v_proj"],
        )
        adapter["source"] = f"file://{path}"
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump(doc))
    port = free_port()
    out = OutputWatch.start(
        "-m",
        "specfleet.fleet.local",
        "-f",
        str(config),
        "--port",
        str(port),
        "--engine-arg=--kv-cache-gib=0.1",
    )
    try:
        out.wait_for(f"serving {tiny_llama}", 180)
        url = f"http://127.0.0.1:{port}/v1"
        models = httpx.get(f"{url}/models", timeout=30).json()["data"]
        (name,) = [m["id"] for m in models if not m.get("parent")]
        assert {(m["id"], m.get("parent")) for m in models if m.get("parent")} == {
            ("sql", name),
            ("chat", name),
        }
        texts = {}
        for model in (name, "sql", "chat"):
            body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            answer = httpx.post(f"{url}/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
            texts[model] = answer.json()["choices"][0]["text"]
        assert len(set(texts.values())) == 3, texts  # each adapter changes the greedy tokens
        out.proc.send_signal(signal.SIGINT)
        assert out.proc.wait(60) == 0, out.tail()
    finally:
        out.kill()
