"""Engine-side promises of issue 33 (items 6, 9, 10): a stop string that ends inside the first `min_tokens`
tokens does not count, in the engine and in the server's output processor; `num_cached_tokens` never
exceeds the prompt after a preemption; an unexpected exception in `add_request` fails that request only;
an empty step records nothing."""

from __future__ import annotations

import pickle

import pytest
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.core.messages import INTERNAL_ERROR, AddRequest, SeqDelta
from specfleet.engine.core.output_processor import OutputProcessor
from specfleet.engine.core.proc import EngineCore
from specfleet.engine.detokenizer import TextCursor
from specfleet.engine.scheduler import Scheduler
from specfleet.engine.sequence import Sequence

PROMPT = "Count: 1, 2, 3,"


def _expected_after_min_tokens(full: str, upto_min: str, stop: str) -> str:
    """vLLM's answer: the first occurrence of `stop` that ends after the first min_tokens tokens' text."""
    index = full.find(stop, len(upto_min) - len(stop) + 1)
    return full if index < 0 else full[:index]


@pytest.mark.slow
def test_a_stop_string_ending_in_token_min_tokens_does_not_stop_the_engine(tiny_llama: str) -> None:
    llm = LLM(model=tiny_llama, max_model_len=128, kv_cache_gib=0.01)
    greedy = dict(temperature=0, ignore_eos=True)
    full, upto2, upto3 = (
        llm.generate([PROMPT], SamplingParams(max_tokens=n, **greedy))[0].outputs[0].text for n in (16, 2, 3)
    )
    assert len(upto3) > len(upto2) >= 1, (upto2, upto3)  # token 3 has text of its own
    stop = upto3[len(upto2) - 1 :]  # ends at the end of token 3, starts in token 2
    out = llm.generate([PROMPT], SamplingParams(max_tokens=16, min_tokens=3, stop=[stop], **greedy))[0]
    # Before: the request stopped at token 3 with the text before `stop`.
    assert out.outputs[0].text == _expected_after_min_tokens(full, upto3, stop)
    assert len(out.outputs[0].token_ids) > 3
    # At min_tokens=2 the same stop string ends after the first 2 tokens: it stops there, as before.
    early = llm.generate([PROMPT], SamplingParams(max_tokens=16, min_tokens=2, stop=[stop], **greedy))[0]
    assert early.outputs[0].text == upto2[: len(upto2) - 1] and len(early.outputs[0].token_ids) == 3


def test_a_stop_string_ending_in_token_min_tokens_does_not_stop_the_server(bundled_path) -> None:
    from specfleet.engine.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(bundled_path)
    ids = tokenizer.encode(" alpha beta gamma delta beta epsilon", add_special_tokens=False)
    texts = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
    assert texts[3].endswith("gamma") and "beta" not in texts[3][len(texts[2]) :], texts
    processor = OutputProcessor(tokenizer)

    def run(min_tokens: int, stop: str) -> tuple[str, str | int | None]:
        """The sample's text and stop reason when the core sends every token in one delta, ending at length."""
        params = SamplingParams(max_tokens=len(ids), min_tokens=min_tokens, stop=[stop])
        processor.add("r", None, [1, 2], params, 0.0)
        outputs, _ = processor.process([SeqDelta("r", 0, list(ids), len(ids), "length")])
        processor.drop("r")
        return outputs[0].outputs[0].text, outputs[0].outputs[0].stop_reason

    # " gamma" ends in token 3 (min_tokens=3): not a stop (before: the text ended at " alpha beta ").
    assert run(3, "gamma") == (texts[-1], None)
    # "beta" ends inside the first 3 tokens (token 2), and again in token 5: that one stops it.
    assert run(3, "beta") == (texts[4] + " ", "beta")
    # From token min_tokens + 1 on a stop string counts: min_tokens=2 stops at " gamma" in token 3.
    assert run(2, "gamma") == (texts[2] + " ", "gamma")


def test_num_cached_tokens_never_exceeds_the_prompt_after_preemption() -> None:
    # A 5-token prompt decodes to 13 tokens (3 full blocks of 4, cached by the prefix cache), then is
    # preempted: readmitted, it finds 12 tokens cached, prompt *and* output, which were reported as the
    # prompt's cached tokens (12 of a 5-token prompt). What the prompt found at first admission is reported.
    kv = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    seq = Sequence(0, "r0", 0, [1, 2, 3, 4, 5], 5, SamplingParams(max_tokens=32, ignore_eos=True))
    sched.add(seq)
    for token in range(20, 28):
        out = sched.schedule()
        assert [item.seq for item in out.scheduled] == [seq]
        sched.update(out, [[token]])
    assert seq.num_tokens == 13 and seq.num_cached_tokens == 0
    sched._preempt(seq)  # as _make_room does to the latest arrival when blocks run out
    out = sched.schedule()
    assert [item.seq for item in out.scheduled] == [seq] and seq.num_computed_tokens == 12  # prefix hits
    assert seq.num_cached_tokens == 0


def _core(tiny_llama: str) -> EngineCore:
    from specfleet.engine.llm_engine import Engine

    cursors: list[TextCursor] = []

    def cursor() -> TextCursor:
        cursors.append(TextCursor())
        return cursors[-1]

    engine = Engine(model=tiny_llama, max_model_len=128, kv_cache_gib=0.01, text_cursor=cursor)
    return EngineCore(engine, cursors)


def _add(core: EngineCore, request_id: str, max_tokens: int = 4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return core.add(AddRequest(request_id, [5, 6, 7, 8], pickle.dumps(params)))


@pytest.mark.slow
def test_an_unexpected_add_request_failure_fails_that_request_and_the_core_serves_on(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug deep in add_request (here: a TypeError raised once the sequence is already queued) used to
    escape EngineCore.add and kill the core with everything in flight. It is that request's AddResult
    error now (the server's 500 `internal_error`), its sequences leave the queues, the next request runs."""
    core = _core(tiny_llama)
    engine = core.engine
    add = engine.scheduler.add

    def broken(seq):
        add(seq)
        if seq.request_id == "bad":
            raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setattr(engine.scheduler, "add", broken)
    result = _add(core, "bad")
    assert result.code == INTERNAL_ERROR and "TypeError" in (result.error or ""), result
    assert not engine.has_unfinished_requests()
    assert all(s.request_id != "bad" for s in (*engine.scheduler.waiting, *engine.scheduler.running))
    assert engine.kv_blocks_in_use() == 0
    assert _add(core, "good").error is None
    tokens: list[int] = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        report = core.step()
        tokens += [t for d in report.deltas if d.request_id == "good" for t in d.new_token_ids]
        assert all(d.request_id == "good" for d in report.deltas)
    assert len(tokens) == 4


@pytest.mark.slow
def test_an_empty_step_reports_not_stepped(tiny_llama: str) -> None:
    """A step that scheduled nothing must not be reported as a step: the server would record the previous
    step's duration into the step-time histogram again (the tuner fits it)."""
    core = _core(tiny_llama)
    engine = core.engine
    assert _add(core, "a").error is None
    assert core.step().stepped
    for seq in engine.scheduler.running:  # as if its grammar were still compiling: nothing to schedule
        seq.grammar_pending = True
    steps = engine.stats.num_steps
    report = core.step()
    assert not report.stepped and engine.stats.num_steps == steps
