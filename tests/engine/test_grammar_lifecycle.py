"""A structured request's grammar from admission to its last token (docs/structured_outputs.md): refused at
admission when it can match nothing or refuses the prefill's first token (P/D), compiled off the step's
critical path while other requests keep stepping, never an unconstrained token at a dead end, and logprobs
of the model's raw distribution, finite."""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
from specfleet.engine.kv_transfer.pair import generate_disaggregated
from specfleet.engine.llm_engine import Engine
from specfleet.engine.sampling_params import ParameterError, SamplingParams
from specfleet.engine.structured_output import StructuredOutputError

BLOCK = 4
COMMON = dict(block_size=BLOCK, num_kv_blocks=96, max_model_len=256, max_num_batched_tokens=64)
PROMPTS = [[(7 * i + 3) % 900 + 10 for i in range(13)], [11, 12, 13, 14] * 3, [501, 77, 9]]
CONSTRAINTS = [
    ({"regex": "[0-9]{3}-[a-z]{3}"}, re.compile(r"[0-9]{3}-[a-z]{3}")),
    ({"choice": ["alpha", "beta", "gamma"]}, re.compile(r"alpha|beta|gamma")),
]


def _params(constraint: dict, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=constraint, **kw)


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=tiny_llama, **COMMON)


@pytest.mark.parametrize(("constraint", "pattern"), CONSTRAINTS)
def test_disaggregated_structured_output_equals_aggregated(tiny_llama, engine, constraint, pattern):
    params = _params(constraint)
    done = _run(engine, {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)})
    reference = [done[f"r{i}"].outputs[0] for i in range(len(PROMPTS))]
    for out in reference:
        assert pattern.fullmatch(out.text), out.text
    prefill = Engine(model=tiny_llama, kv_role="prefill", **COMMON)
    decode = Engine(model=tiny_llama, kv_role="decode", **COMMON)
    try:
        outs = generate_disaggregated(prefill, decode, PROMPTS, params)
        assert [o.outputs[0].text for o in outs] == [o.text for o in reference]
        assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in reference]
        assert decode.kv_connector.stats.transfers == len(PROMPTS)
    finally:
        prefill.close()
        decode.close()


def test_first_token_the_grammar_refuses_is_a_400_naming_the_field(tiny_llama):
    decode = Engine(model=tiny_llama, kv_role="decode", **COMMON)
    try:
        (letter,) = decode.tokenizer.encode("x", add_special_tokens=False)
        remote = dict(
            remote_host="127.0.0.1",
            remote_port=1,
            transfer_id="t",
            num_tokens=3,
            num_blocks=1,
            first_token_id=letter,
        )
        with pytest.raises(ParameterError) as info:
            decode.add_request("v", [5, 6, 7], _params({"regex": "[0-9]{3}"}), remote)
        assert info.value.param == "kv_transfer_params.first_token_id"
        assert "not allowed by the regular expression in structured_outputs.regex" in str(info.value)
        assert not decode.has_unfinished_requests() and decode.kv.num_used_blocks == 0
    finally:
        decode.close()


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        ({"regex": r"[^\s\S]"}, "structured_outputs.regex"),
        ({"grammar": r"root ::= [^\x00-\U0010FFFF]"}, "structured_outputs.grammar"),
    ],
)
def test_a_grammar_that_matches_nothing_is_refused_at_admission(engine, constraint, param):
    with pytest.raises(StructuredOutputError) as info:
        engine.add_request("empty", [5, 6, 7], _params(constraint))
    assert info.value.param == param
    assert "matches no output" in str(info.value)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("constraint", "start"),
    [({"regex": r"a[^\s\S]"}, "a"), ({"json": {"type": "string", "pattern": r"[^\s\S]"}}, '"')],
)
def test_a_dead_end_mid_output_ends_the_request_without_an_unconstrained_token(engine, constraint, start):
    # The start is allowed; after it the grammar allows nothing: the request ends there, with the start only.
    done = _run(engine, {"dead": ([5, 6, 7], _params(constraint))})
    out = done["dead"].outputs[0]
    assert out.text == start, out.text
    assert len(out.token_ids) == 1, out.token_ids  # the start's token, and nothing unconstrained after it
    assert out.finish_reason == "abort"
    assert engine.kv_blocks_in_use() == 0


def test_logprobs_are_raw_and_finite(engine):
    params = _params({"choice": ["alpha", "beta", "gamma"]}, logprobs=5)
    plain = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    done = _run(engine, {"s": ([5, 6, 7], params), "u": ([5, 6, 7], plain)})
    lps = done["s"].outputs[0].logprobs
    assert lps and all(math.isfinite(lp.logprob) for lp in lps)
    assert all(math.isfinite(v) for lp in lps for v in lp.top.values())
    # the first position's top 5 are the model's own, the same as an unconstrained request's
    assert lps[0].top == done["u"].outputs[0].logprobs[0].top


def test_compile_runs_off_the_step_while_other_requests_keep_stepping(engine, monkeypatch):
    from specfleet.engine.structured_output.backend import GrammarBackend

    assert engine.structured.backend is not None  # built (xgrammar imported) before the clock starts
    started, release = threading.Event(), threading.Event()
    real = GrammarBackend.compile

    def slow_compile(self, spec):
        if spec.kind == "regex" and spec.value == "[0-9]{4}":
            started.set()
            release.wait(10)  # a large schema's compile, held until the test has stepped
        return real(self, spec)

    monkeypatch.setattr(GrammarBackend, "compile", slow_compile)
    engine.add_request("busy", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()
    begin = time.monotonic()
    engine.add_request("slow", [8, 9, 10], _params({"regex": "[0-9]{4}"}))
    assert time.monotonic() - begin < 2, "add_request waited for the compile"
    assert started.wait(10)
    tokens = {}
    for _ in range(6):
        for out in engine.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)
    assert tokens.get("busy", 0) >= 6, tokens  # one token a step while the grammar compiles
    assert "slow" not in tokens, tokens  # not scheduled before its grammar is ready
    release.set()
    done = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("[0-9]{4}", done["slow"].outputs[0].text), done["slow"].outputs[0].text
    assert done["slow"].outputs[0].finish_reason == "stop"
    assert engine.kv_blocks_in_use() == 0


def test_a_compile_that_fails_late_ends_its_request(engine, monkeypatch):
    from specfleet.engine.structured_output.backend import GrammarBackend

    def failing(self, spec):
        raise StructuredOutputError("cannot compile the regular expression: boom", spec.source)

    monkeypatch.setattr(GrammarBackend, "compile", failing)
    try:
        done = _run(engine, {"late": ([5, 6, 7], _params({"regex": "[0-9]{5}"}))})
    except StructuredOutputError:
        pytest.fail("the compile ran in add_request")
    out = done["late"].outputs[0]
    assert out.finish_reason == "abort" and out.token_ids == []
    assert engine.kv_blocks_in_use() == 0


def test_an_empty_step_returns_at_once_and_the_offline_loop_waits_for_the_compile(engine, monkeypatch):
    """The wait after a step that scheduled nothing has one home per loop: `Engine.step` returns at once
    (the engine core's loop then waits on its input, so a new request is taken without delay), and
    `step_or_wait` (offline loops) blocks until the compile ends instead of spinning."""
    from specfleet.engine.structured_output.backend import GrammarBackend

    release = threading.Event()
    real = GrammarBackend.compile

    def held_compile(self, spec):
        release.wait(10)
        return real(self, spec)

    monkeypatch.setattr(GrammarBackend, "compile", held_compile)
    waits: list[float] = []
    real_wait = engine.structured.wait
    monkeypatch.setattr(
        engine.structured, "wait", lambda timeout: waits.append(timeout) or real_wait(timeout)
    )
    engine.add_request("held", [8, 9, 10], _params({"regex": "[0-9]{2}"}))
    assert engine.step() == [] and waits == []  # the step itself never blocks
    engine.step_or_wait()
    assert waits, "step_or_wait stepped again without waiting for the compile"
    release.set()
    done = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        done.update({o.request_id: o for o in engine.step_or_wait() if o.finished})
    assert re.fullmatch("[0-9]{2}", done["held"].outputs[0].text)
    assert engine.kv_blocks_in_use() == 0
