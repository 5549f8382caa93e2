"""/v1/embeddings through the official openai client against a real server over a socket: the embeddings
equal transformers' `last_hidden_state` on the same checkpoint, pooled (LAST, MEAN) and L2-normalised."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from specfleet.engine.model_source import resolve_model
from specfleet.engine.server.pooler import PoolerConfig

MAX_MODEL_LEN = 64
TOL = 1e-4  # float32 on both sides: the two only differ in summation order
TEXTS = [
    "Paged attention",
    "A much longer sentence, so that the batch holds inputs of different lengths.",
    "x",
]


@pytest.fixture(scope="module")
def served(serve_app: Any, tiny_llama: str) -> Iterator[tuple[Any, str]]:
    from specfleet.engine import EngineConfig
    from specfleet.engine.core.client import EngineCoreClient
    from specfleet.engine.server.app import build_state, create_app

    # 8-token chunks: the longer inputs prefill over several steps beside the shorter ones
    config = EngineConfig(
        model=tiny_llama, max_model_len=MAX_MODEL_LEN, block_size=4, max_num_batched_tokens=8
    )
    client = EngineCoreClient(config, log_level="warning")
    state = build_state(client, admin_token="t")
    uv, thread, url = serve_app(create_app(state))
    try:
        yield state, url
    finally:
        uv.should_exit = True
        thread.join(15)
        client.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama: str):
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model(tiny_llama).path
    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def embed(item: str | list[int], how: str) -> torch.Tensor:
        ids = tokenizer(item)["input_ids"] if isinstance(item, str) else item
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden[-1] if how == "LAST" else hidden.mean(dim=0), dim=0)

    return embed


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("how", ["LAST", "MEAN"])
def test_batched_embeddings_equal_transformers_hidden_states(served, reference, how):
    state, url = served
    state.pooler = PoolerConfig(how)
    name = state.model_name
    result = _client(url).embeddings.create(model=name, input=TEXTS, user="u-1")
    assert result.object == "list" and result.model == name
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, result.data):
        assert item.object == "embedding"
        torch.testing.assert_close(torch.tensor(item.embedding), reference(text, how), atol=TOL, rtol=0)
    ids = [[1, 500, 600, 700], list(range(300, 330))]
    by_ids = _client(url).embeddings.create(model=name, input=ids)
    for prompt, item in zip(ids, by_ids.data):
        torch.testing.assert_close(torch.tensor(item.embedding), reference(prompt, how), atol=TOL, rtol=0)
    assert by_ids.usage.prompt_tokens == sum(map(len, ids)) == by_ids.usage.total_tokens
    assert state.async_engine.call_sync("kv_blocks_in_use") == 0


def test_one_string_and_one_id_list_and_base64(served, reference):
    state, url = served
    state.pooler = PoolerConfig()
    one = _client(url).embeddings.create(model=state.model_name, input=TEXTS[0])
    assert len(one.data) == 1
    torch.testing.assert_close(
        torch.tensor(one.data[0].embedding), reference(TEXTS[0], "LAST"), atol=TOL, rtol=0
    )
    ids = [1, 500, 600, 700]
    raw = httpx.post(
        f"{url}/v1/embeddings", json={"input": ids, "encoding_format": "base64"}, timeout=60
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    values = torch.tensor(struct.unpack(f"<{len(packed) // 4}f", packed))
    torch.testing.assert_close(values, reference(ids, "LAST"), atol=TOL, rtol=0)
    assert raw["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"input": "hi", "dimensions": 8}, "dimensions", "dimensions=8 is not supported"),
        (
            {"input": list(range(5, 5 + MAX_MODEL_LEN))},
            "input",
            f"maximum context length is {MAX_MODEL_LEN} tokens",
        ),
        ({"input": [[1, 2], list(range(5, 5 + MAX_MODEL_LEN))]}, "input", "input[1] has 64 tokens"),
        ({"input": [1, 10**9]}, "input", "token id 1000000000"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(served, body, param, needle):
    state, url = served
    resp = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert param in (error["param"] or "") and needle in error["message"], error
    assert state.async_engine.call_sync("kv_blocks_in_use") == 0


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (None, PoolerConfig("LAST", True)),
        ('{"pooling_type": "MEAN", "normalize": false}', PoolerConfig("MEAN", False)),
        ('{"seq_pooling_type": "MEAN", "use_activation": true}', PoolerConfig("MEAN", True)),
    ],
)
def test_pooler_config_reads_vllms_spellings(flag, expected):
    assert PoolerConfig.from_json(flag) == expected


@pytest.mark.parametrize(
    ("flag", "needle"),
    [
        ('{"pooling_type": "CLS"}', "pooling_type='CLS' must be one of LAST, MEAN"),
        ('{"dimensions": 8}', "dimensions not supported"),
        ("[1]", "must be a JSON object"),
        ('{"normalize": "yes"}', "normalize='yes'"),
    ],
)
def test_a_bad_pooler_config_names_the_key(flag, needle):
    with pytest.raises(ValueError, match="--pooler-config") as info:
        PoolerConfig.from_json(flag)
    assert needle in str(info.value)


@pytest.mark.parametrize("flag", ["--pooler-config", "--override-pooler-config"])
def test_serve_takes_both_flag_spellings_and_refuses_a_bad_config_before_loading(flag, capsys):
    from specfleet.engine.server.cli import build_parser, main

    args = build_parser().parse_args([flag, '{"pooling_type": "MEAN"}'])
    assert PoolerConfig.from_json(args.pooler_config) == PoolerConfig("MEAN")
    assert main([flag, '{"pooling_type": "CLS"}']) == 2
    assert "--pooler-config: pooling_type='CLS'" in capsys.readouterr().err
