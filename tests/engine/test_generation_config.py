"""--generation-config as vLLM: under `auto` the checkpoint's generation_config.json sets the sampling fields a
request leaves out; `vllm` ignores the file; a folder is read instead of the model's own."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from specfleet.engine import LLM, EngineConfig, SamplingParams
from specfleet.engine.checkpoint import read_generation_config, sampling_defaults

PROMPT = [101, 202, 303, 404, 505, 606, 707, 101, 202]
KWARGS = {"block_size": 4, "max_model_len": 256}  # small engines; the same for every one compared
# tokens compared: SamplingParams' default max_tokens, so `generate` without SamplingParams is comparable, and
# enough that an unseeded sample at temperature 1 leaves the greedy path
STEPS = SamplingParams().max_tokens


def with_generation_config(tiny_llama: str, folder: Path, **fields: object) -> str:
    """A copy of the tiny checkpoint whose generation_config.json also holds `fields`; its file:// URI."""
    source = Path(tiny_llama.removeprefix("file://"))
    shutil.copytree(source, folder)
    merged = {**read_generation_config(source), **fields}
    (folder / "generation_config.json").write_text(json.dumps(merged))
    return f"file://{folder}"


def _tokens(llm: LLM, params: SamplingParams | None = None) -> list[int]:
    return list(llm.generate(PROMPT, params)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def plain(tiny_llama: str) -> LLM:
    """The tiny checkpoint as written: its generation_config.json sets no sampling field."""
    return LLM(model=tiny_llama, **KWARGS)


@pytest.fixture(scope="module")
def greedy_reference(plain: LLM) -> list[int]:
    return _tokens(plain, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))


def test_auto_takes_the_files_temperature_as_the_default(
    tiny_llama, plain, greedy_reference, tmp_path, caplog
) -> None:
    model = with_generation_config(tiny_llama, tmp_path / "m", temperature=0.0, top_p=0.9, top_k=50)
    with caplog.at_level(logging.WARNING, logger="specfleet.engine"):
        llm = LLM(model=model, **KWARGS)
    # top_k 50 is transformers' own default, which vLLM's reading of the file drops too
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_p": 0.9}
    assert "event=generation_config_defaults generation_config=auto temperature=0.0 top_p=0.9" in caplog.text
    unset = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    assert plain.engine.sampling_defaults == {}
    assert _tokens(plain, unset) != greedy_reference, "the tiny model samples off the greedy path at 1.0"
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.0, 0.9)
    with_defaults = SamplingParams(**{**vars(defaults), "max_tokens": STEPS, "ignore_eos": True})
    assert _tokens(llm, with_defaults) == greedy_reference
    assert _tokens(llm) == greedy_reference  # no SamplingParams: the defaults in force


def test_vllm_ignores_the_file(tiny_llama, tmp_path) -> None:
    model = with_generation_config(tiny_llama, tmp_path / "m", temperature=0.0, repetition_penalty=1.3)
    llm = LLM(model=model, generation_config="vllm", **KWARGS)
    assert llm.engine.sampling_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_folder_is_read_instead_of_the_models_file(tiny_llama, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_k": 20, "min_p": 0.05})
    )
    model = Path(with_generation_config(tiny_llama, tmp_path / "m", temperature=0.0).removeprefix("file://"))
    assert sampling_defaults(model, str(other), read_generation_config(model)) == {
        "temperature": 0.6,
        "top_k": 20,
        "min_p": 0.05,
    }
    assert sampling_defaults(model, "auto", read_generation_config(model)) == {"temperature": 0.0}


def test_a_folder_without_the_file_is_an_error_naming_the_flag(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"generation_config='.*': no generation_config.json in that folder"):
        sampling_defaults(tmp_path, str(tmp_path / "missing"), {})


@pytest.mark.parametrize(("field", "value"), [("top_p", 0.0), ("temperature", -1.0), ("top_k", -5)])
def test_a_value_no_request_could_send_is_an_error_at_start(tmp_path, field, value) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({field: value}))
    with pytest.raises(ValueError, match=rf"generation_config.json: {field}=.*generation_config='vllm'"):
        sampling_defaults(tmp_path, "auto", read_generation_config(tmp_path))


def test_an_empty_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="generation_config='' must be 'auto', 'vllm' or a folder"):
        EngineConfig(generation_config="")
