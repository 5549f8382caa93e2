"""The offline API on the bundled model: chat template, stops, n > 1 with shared prompt blocks, logprobs,
seeds, min_tokens, penalties and per-request results in order."""

from __future__ import annotations

import math

import pytest
from specfleet.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_chat_uses_the_template_and_answers(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )[0]
    assert "<|im_start|>assistant" in llm.tokenizer.decode(out.prompt_token_ids)
    assert "Paris" in out.outputs[0].text


def test_results_in_prompt_order_and_lengths(llm):
    prompts = ["One, two, three,", "The alphabet: A, B, C,", "Hello"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    results = llm.generate(prompts, params)
    assert [r.prompt for r in results] == prompts
    assert [len(r.outputs[0].token_ids) for r in results] == [3, 9, 5]
    assert all(r.outputs[0].finish_reason == "length" for r in results)


def test_stop_string_spanning_tokens_is_cut(llm):
    base = llm.generate("One, two, three, four, five,", SamplingParams(temperature=0, max_tokens=24))[0]
    text = base.outputs[0].text
    stop = text[5:9]  # four characters from the middle of the output, likely spanning tokens
    out = llm.generate(
        "One, two, three, four, five,", SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    )[0]
    assert out.outputs[0].text == text[: text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(
        "Count: 1 2 3 4 5 6 7 8", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    ids = base.outputs[0].token_ids
    out = llm.generate(
        "Count: 1 2 3 4 5 6 7 8", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[3]])
    )[0]
    cut = ids.index(ids[3]) + 1
    assert out.outputs[0].token_ids == ids[:cut] and out.outputs[0].stop_reason == ids[3]
    eos = llm.engine.eos_token_ids
    out = llm.chat(
        [{"role": "user", "content": "Say OK."}], SamplingParams(temperature=0, max_tokens=30, min_tokens=20)
    )[0]
    assert len(out.outputs[0].token_ids) >= 20
    assert not set(out.outputs[0].token_ids[:20]) & eos


def test_n_samples_share_prompt_blocks(llm):
    prompt = "Write a sentence about the sea. " * 8  # several full blocks
    before = llm.engine.stats.prefix_cache_hits
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True))[
        0
    ]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different samples
    assert llm.engine.stats.prefix_cache_hits - before >= 2 * 48  # siblings adopted the prompt blocks
    assert llm.engine.kv_blocks_in_use() == 0


def test_seeded_sampling_reproduces(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    a = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    b = llm.generate(
        ["Tell me a joke.", "Once upon a time"], [SamplingParams(temperature=1.0, max_tokens=20), params]
    )
    assert a == b[1].outputs[0].token_ids


def test_logprobs(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for token, lp in zip(out.outputs[0].token_ids, lps):
        assert lp.token_id == token and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy picks the most likely
        assert all(v <= 0 for v in lp.top.values()) and math.isfinite(lp.logprob)


def test_penalties_reduce_repetition(llm):
    prompt = "Repeat after me: la la la la la la la la"
    plain = (
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    pen = (
        llm.generate(
            prompt,
            SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
            ),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(pen)) > len(set(plain))


def test_chat_continues_a_final_message_and_takes_a_template(llm):
    """vLLM's `LLM.chat` template controls: the last message left open, a template of the caller's own."""
    started = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "One, two,"}]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    out = llm.chat(started, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids)
    assert prompt.endswith("One, two,")  # no end of turn: the model writes on from there
    raw = llm.generate({"prompt_token_ids": out.prompt_token_ids}, greedy)[0]
    assert out.outputs[0].text == raw.outputs[0].text != ""
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(started, greedy, continue_final_message=True)
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    own = llm.chat(started[:1], greedy, chat_template=template)[0]
    assert llm.tokenizer.decode(own.prompt_token_ids) == "user: Count to ten.\nassistant:"
