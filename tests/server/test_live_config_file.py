"""`specfleet serve --live-config-file`: the live knobs a new pod starts on (the operator's `NAME-tuned`
ConfigMap, `specfleet up`'s file), checked at start as the admin API checks a PATCH. A bad value stops the
start before the model loads, with the field and the limit named; a missing file starts on the flags.
The happy path on a real engine: tests/fleet/test_scale_from_zero.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from specfleet.engine.config import EngineConfig
from specfleet.engine.server.admin import live_config_from_file
from specfleet.engine.server.cli import main

NGRAM = EngineConfig(speculative_method="ngram", max_num_seqs=512, max_num_batched_tokens=1024)


def write(tmp_path: Path, body: object) -> Path:
    path = tmp_path / "live-config.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


def test_the_file_sets_the_start_values_and_keeps_the_flags_ceilings(tmp_path: Path) -> None:
    values = {
        "num_speculative_tokens": 2,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "speculative_disable_by_batch_size": 6,
    }
    config = live_config_from_file(NGRAM, write(tmp_path, values))
    assert {name: getattr(config, name) for name in values} == values
    # the ceilings the flags fixed (512 = max_num_seqs from the flags), not ones derived from the file's 8
    assert (config.seqs_limit, config.batched_tokens_limit) == (NGRAM.seqs_limit, NGRAM.batched_tokens_limit)
    assert live_config_from_file(NGRAM, tmp_path / "absent.json") == NGRAM  # not tuned yet: the flags


@pytest.mark.parametrize(
    ("body", "config", "message"),
    [
        ({"max_num_seqs": 600}, NGRAM, "max_num_seqs=600 must be an integer between 1 and 512"),
        (
            {"max_num_batched_tokens": 0},
            NGRAM,
            "max_num_batched_tokens=0: Input should be greater than or equal to 1",
        ),
        (
            {"num_speculative_tokens": 9},
            NGRAM,
            "num_speculative_tokens=9 must be an integer between 0 and 8",
        ),
        (
            {"num_speculative_tokens": 2},
            EngineConfig(),
            "num_speculative_tokens=2 must be an integer between 0 and 0 (no speculative method configured",
        ),
        ({"max_num_seq": 8}, NGRAM, "max_num_seq is not a live knob; use one of ['num_speculative_tokens'"),
        ({"replicas": 2}, NGRAM, "replicas is a service knob, not an engine's"),
        ([8], NGRAM, "must hold a JSON object of live knobs"),
        ("{max_num_seqs: 8}", NGRAM, "is not JSON"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field_and_the_limit(
    tmp_path: Path, body: object, config: EngineConfig, message: str
) -> None:
    path = write(tmp_path, body)
    with pytest.raises(ValueError) as refused:
        live_config_from_file(config, path)
    assert str(refused.value).startswith(f"--live-config-file {path}")
    assert message in str(refused.value)


def test_serve_exits_2_before_loading_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What a pod's log shows: one line, and exit code 2 at once (no model load, no port opened)."""
    path = write(tmp_path, {"max_num_seqs": 600})
    code = main(["serve", "--max-num-seqs", "16", "--live-config-file", str(path)])
    assert code == 2
    err = capsys.readouterr().err
    assert (
        f"specfleet serve: --live-config-file {path}: max_num_seqs=600 must be an integer between 1 and 256"
        in err
    )
