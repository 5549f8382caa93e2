"""--generation-config over HTTP: a served checkpoint whose generation_config.json says temperature 0 answers
a request that leaves temperature out (or sends null) greedily, as vLLM does under `auto`; an explicit value
keeps its meaning; `vllm` ignores the file. Real engine core, real uvicorn, the official client."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import serve_in_thread

pytestmark = pytest.mark.slow

PROMPT = [101, 202, 303, 404, 505, 606, 707, 101, 202]
MAX_TOKENS = 16  # enough that an unseeded sample at temperature 1 leaves the greedy path of the tiny model


@pytest.fixture(scope="module")
def greedy_file_model(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny checkpoint with temperature 0 in its generation_config.json."""
    source = Path(tiny_llama.removeprefix("file://"))
    folder = tmp_path_factory.mktemp("greedy-file") / "model"
    shutil.copytree(source, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    return f"file://{folder}"


def _serve(model: str, generation_config: str) -> Iterator[str]:
    from specfleet.engine import EngineConfig
    from specfleet.engine.core.client import EngineCoreClient
    from specfleet.engine.server.app import build_state, create_app

    config = EngineConfig(
        model=model, generation_config=generation_config, max_model_len=256, kv_cache_gib=0.05
    )
    client = EngineCoreClient(config, log_level="warning")
    uv, thread, url = serve_in_thread(create_app(build_state(client)))
    try:
        assert httpx.get(f"{url}/ready", timeout=30).status_code == 200
        yield url
    finally:
        uv.should_exit = True
        thread.join(15)
        client.stop()


@pytest.fixture(scope="module")
def auto_url(greedy_file_model: str) -> Iterator[str]:
    yield from _serve(greedy_file_model, "auto")


@pytest.fixture(scope="module")
def vllm_url(greedy_file_model: str) -> Iterator[str]:
    yield from _serve(greedy_file_model, "vllm")


def _tokens(url: str, **fields: Any) -> list[int]:
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_auto_samples_a_request_without_temperature_as_the_file_says(auto_url: str) -> None:
    greedy = _tokens(auto_url, temperature=0)
    assert _tokens(auto_url) == greedy
    assert _tokens(auto_url, temperature=None) == greedy  # null is the default, the file's under auto
    client = openai.OpenAI(base_url=f"{auto_url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS
    )
    plain = client.completions.create(model=answer.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].text == plain.choices[0].text


def test_an_explicit_temperature_keeps_its_meaning_under_auto(auto_url: str) -> None:
    greedy = _tokens(auto_url, temperature=0)
    seeded = _tokens(auto_url, temperature=1.0, seed=7)
    assert seeded != greedy
    assert _tokens(auto_url, temperature=1.0, seed=7) == seeded


def test_vllm_ignores_the_file(vllm_url: str) -> None:
    greedy = _tokens(vllm_url, temperature=0)
    unset = _tokens(vllm_url, seed=7)
    assert unset != greedy
    assert unset == _tokens(vllm_url, temperature=1.0, seed=7)  # SamplingParams' own default, 1.0
