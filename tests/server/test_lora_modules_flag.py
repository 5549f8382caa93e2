"""`--lora-modules` as vLLM spells it: `name=path` or a JSON object whose base_model_name must be the served
model; each wrong value named in the error. No server."""

from __future__ import annotations

import json

import pytest
from specfleet.engine.server.cli import main
from specfleet.engine.server.lora_api import parse_lora_modules


def test_both_spellings():
    spec = json.dumps({"name": "sql", "path": "/adapters/sql", "base_model_name": "base"})
    assert parse_lora_modules(["chat=/adapters/chat", spec], "base") == {
        "chat": "/adapters/chat",
        "sql": "/adapters/sql",
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("chat", "--lora-modules 'chat' must be name=path or a JSON object"),
        ("=/p", "must be name=path"),
        ('{"name": "sql"', "is not valid JSON"),
        ('{"name": "sql"}', "needs 'name' and 'path'"),
        (
            '{"name": "sql", "path": "/p", "base_model_name": "other"}',
            "base_model_name='other', this server serves 'base'",
        ),
    ],
)
def test_wrong_values_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_modules([value], "base")


def test_lora_modules_need_enable_lora(capsys):
    assert main(["--lora-modules", "a=/p"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
