"""The server's half of the engine core split: the core's token deltas become the same text, stops and
finish reasons as the in-process engine gives (stop strings matched here, token by token, first wins)."""

from __future__ import annotations

from typing import Any

import pytest
from specfleet.engine.core.messages import ENCODER, OUTPUT_DECODER, SeqDelta, StepReport
from specfleet.engine.core.output_processor import OutputProcessor
from specfleet.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(bundled_path: Any) -> Any:
    from specfleet.engine.checkpoint import load_tokenizer

    return load_tokenizer(bundled_path)


def _run(
    tokenizer: Any,
    params: SamplingParams,
    text: str,
    finish: str | None = None,
    stop_token: int | None = None,
    per_step: int = 1,
    extra: list[int] | None = None,
    ends_on_stop_token: bool = False,
):
    """Feed `text`'s tokens (plus `extra`) through a processor `per_step` at a time, as the core would; the
    last delta carries the core's finish (a stop token that ends it is not text). Returns (final output,
    to_finish)."""
    proc = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Say something:")
    proc.add("r", None, prompt, params, 0.0)
    tokens = tokenizer.encode(text, add_special_tokens=False) + (extra or [])
    finished_here: list[tuple[str, int]] = []
    last = None
    for start in range(0, len(tokens), per_step):
        chunk = tokens[start : start + per_step]
        end = start + len(chunk) == len(tokens)
        upto = start + len(chunk) - (1 if end and ends_on_stop_token else 0)
        delta = SeqDelta("r", 0, chunk, upto, finish if end else None, stop_token if end else None)
        report = OUTPUT_DECODER.decode(ENCODER.encode(StepReport([delta])))  # the wire, both ways
        outputs, to_finish = proc.process(report.deltas)
        finished_here += to_finish
        last = outputs[-1] if outputs else last
        if last is not None and last.finished:
            break
    return last, finished_here


def test_a_stop_string_ends_the_sample_here_and_is_handed_back_to_the_core(tokenizer: Any) -> None:
    out, to_finish = _run(
        tokenizer, SamplingParams(stop=["world"]), "Hello world, and more text after it.", finish="length"
    )
    c = out.outputs[0]
    assert out.finished and c.text == "Hello " and c.finish_reason == "stop" and c.stop_reason == "world"
    assert tokenizer.decode(c.token_ids).startswith("Hello world")  # tokens up to the one that completed it
    assert to_finish == [("r", 0)]


def test_several_tokens_per_delta_stop_at_the_first_match(tokenizer: Any) -> None:
    out, to_finish = _run(
        tokenizer,
        SamplingParams(stop=["b", "world"], include_stop_str_in_output=True),
        "Hello world, bye.",
        per_step=5,
    )
    assert out.outputs[0].text == "Hello world" and out.outputs[0].stop_reason == "world"
    assert to_finish == [("r", 0)]


def test_min_tokens_keeps_early_stop_strings_out(tokenizer: Any) -> None:
    text = "Hello world, hello world again."
    out, _ = _run(tokenizer, SamplingParams(stop=["world"], min_tokens=4), text, finish="length")
    assert out.outputs[0].text == "Hello world, hello "


def test_the_cores_stop_token_finishes_without_its_text(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    params = SamplingParams(skip_special_tokens=False)
    out, to_finish = _run(tokenizer, params, "Fine.", finish="stop", extra=[eos], ends_on_stop_token=True)
    c = out.outputs[0]
    assert c.text == "Fine." and c.token_ids[-1] == eos and c.finish_reason == "stop" and to_finish == []
