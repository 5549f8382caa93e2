"""A structured output of a request that reasons first constrains only the tokens after the reasoning's end
marker (`SamplingParams.reasoning_end_token_ids`, set by the server's reasoning parser): the marker and
what precedes it are sampled free, every token after it under the grammar. On a tiny random model the
"end of reasoning" is a token its greedy output reaches anyway, so the path is known before the run."""

from __future__ import annotations

import pytest
from specfleet.engine.llm_engine import Engine
from specfleet.engine.sampling_params import SamplingParams

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(13)]
# The output must be a run of digits: a constraint the random model's free tokens do not meet.
CONSTRAINT = {"regex": "[0-9]{12}"}
# Where the free output's "end of reasoning" is taken: far enough in that the reasoning is several tokens.
END_AT = 3


def _run(engine: Engine, params: SamplingParams) -> list[int]:
    engine.add_request("r", PROMPT, params)
    done = None
    while engine.has_unfinished_requests():
        done = next((o for o in engine.step() if o.finished), done)
    assert done is not None
    return done.outputs[0].token_ids


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "ngram-speculative"])
def engine(request, tiny_llama) -> Engine:
    """With n-gram proposals too: a proposal past the end marker must not be verified unconstrained."""
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 3} if request.param else {}
    return Engine(
        model=tiny_llama, block_size=4, num_kv_blocks=96, max_model_len=256, max_num_batched_tokens=64, **spec
    )


def test_the_grammar_starts_after_the_reasoning_end(engine: Engine) -> None:
    free = _run(engine, SamplingParams(temperature=0.0, max_tokens=12))
    constrained = _run(engine, SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=CONSTRAINT))
    assert constrained[0] != free[0], "the grammar changes the first token when it applies from the start"
    end = free[END_AT - 1 : END_AT]  # one token: the first time it appears ends the reasoning
    first = free.index(end[0])
    params = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=CONSTRAINT, reasoning_end_token_ids=end
    )
    reasoned = _run(engine, params)
    assert reasoned[: first + 1] == free[: first + 1], "free sampling up to and with the end marker"
    answer = engine.tokenizer.decode(reasoned[first + 1 :], skip_special_tokens=True)
    assert answer and answer.isdigit(), (answer, reasoned)


def test_an_end_marker_the_output_never_writes_leaves_it_free(engine: Engine) -> None:
    free = _run(engine, SamplingParams(temperature=0.0, max_tokens=12))
    never = [t for t in range(100, 200) if t not in free][:1]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=CONSTRAINT, reasoning_end_token_ids=never
    )
    assert _run(engine, params) == free


@pytest.mark.parametrize(
    ("output", "proposals", "kept"),
    [
        # the marker [9, 4] would end at the third proposal: the drafts stop before it
        pytest.param([5, 6], [8, 9, 4, 1], [8, 9], id="marker-in-the-drafts"),
        # the first proposal would complete it: no drafts, the marker's token is sampled
        pytest.param([5, 9], [4, 1, 2], [], id="marker-begun-in-the-output"),
        pytest.param([5, 6], [1, 2, 3], [1, 2, 3], id="no-marker"),
    ],
)
def test_drafts_stop_before_the_token_that_ends_the_reasoning(output, proposals, kept) -> None:
    """So that the marker's last token is the last of its step and every token after it is masked."""
    from specfleet.engine.sequence import Sequence
    from specfleet.engine.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(None, 16, [0], max_num_speculative_tokens=4)
    params = SamplingParams(max_tokens=12, reasoning_end_token_ids=[9, 4])
    seq = Sequence(0, "r", 0, [3, 3, *output], 2, params)
    seq.grammar_after_reasoning = object()  # a grammar waiting for the reasoning to end
    seq.spec_token_ids = list(proposals)
    manager.filter_proposals(seq)
    assert seq.spec_token_ids == kept
