"""`resume_token_ids` (SamplingParams): a request continued from tokens another engine generated ends exactly
as the undisturbed request: same tokens, text, finish and stop reason, for greedy, seeded and penalised
sampling and a stop string that spans the seam; and what cannot be resumed is refused by name."""

from __future__ import annotations

import pytest
from specfleet.engine import LLM
from specfleet.engine.sampling_params import ParameterError, SamplingParams

PROMPT = "Once upon a time"
CASES = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0, "seed": 11},
    "penalised": {"temperature": 0.8, "seed": 5, "presence_penalty": 0.6, "frequency_penalty": 0.4},
}


def run(llm: LLM, params: SamplingParams, rid: str):
    engine = llm.engine
    engine.add_request(rid, PROMPT, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return final.outputs[0]


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_ends_as_the_undisturbed_one(tiny: LLM, case: str):
    params = dict(max_tokens=24, ignore_eos=True, **CASES[case])
    whole = run(tiny, SamplingParams(**params), f"{case}-whole")
    for cut in (1, 9, 23):
        resumed = run(tiny, SamplingParams(**params, resume_token_ids=whole.token_ids[:cut]), f"{case}-{cut}")
        assert resumed.token_ids == whole.token_ids  # the resumed tokens count as output: usage once
        assert (resumed.text, resumed.finish_reason) == (whole.text, whole.finish_reason)


def test_a_stop_string_across_the_seam_ends_the_resumed_request_where_it_ended_the_whole(tiny: LLM):
    free = run(tiny, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), "free")
    stop = free.text[10:13]  # three characters from the middle of the text: they span tokens
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    whole = run(tiny, SamplingParams(**params), "stopped")
    assert whole.finish_reason == "stop" and whole.stop_reason == stop
    resumed = run(tiny, SamplingParams(**params, resume_token_ids=whole.token_ids[:-1]), "stopped-resumed")
    assert (resumed.text, resumed.finish_reason, resumed.stop_reason) == (whole.text, "stop", stop)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"n": 2}, "this request sets n"),
        ({"logprobs": 1}, "this request sets logprobs"),
        ({"max_tokens": 2}, "max_tokens=2 leaves none"),
    ],
)
def test_what_cannot_be_resumed_is_refused_by_name(changes: dict, names: str):
    with pytest.raises(ParameterError) as refused:
        SamplingParams(**{"max_tokens": 8, **changes}, resume_token_ids=[5, 6])
    assert refused.value.param == "resume_token_ids" and names in str(refused.value)
