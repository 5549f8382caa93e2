"""Request semantics as vLLM defines them: stop strings wait for min_tokens, logprobs are the model's raw
distribution, SentencePiece text keeps its leading space, the first of several stop conditions in one
speculative step wins, and a seeded request's tokens do not depend on load or speculation."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

PROMPT = [101, 202, 303, 404, 505, 606, 707]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(model=tiny_llama, block_size=4, max_model_len=256)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_stop_strings_are_ignored_before_min_tokens(tiny):
    base = tiny.generate(PROMPT, _greedy(max_tokens=30))[0].outputs[0]
    first = tiny.tokenizer.decode(base.token_ids[:2])
    stop = first.strip()[:3] or first[:3]
    assert stop and stop in base.text[: len(first)]
    early = tiny.generate(PROMPT, _greedy(max_tokens=30, stop=[stop]))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    late = tiny.generate(PROMPT, _greedy(max_tokens=30, stop=[stop], min_tokens=12))[0].outputs[0]
    assert len(late.token_ids) >= 12 and late.token_ids == base.token_ids[: len(late.token_ids)]
    if late.finish_reason == "stop":  # the string came again after min_tokens: cut there, not before
        assert (
            stop not in late.text
            and len(late.text) >= len(tiny.tokenizer.decode(base.token_ids[:11]).strip()) - 1
        )


def test_logprobs_are_the_models_raw_log_probabilities(tiny, tiny_llama):
    from transformers import AutoModelForCausalLM

    params = _greedy(max_tokens=12, logprobs=3, presence_penalty=1.5, frequency_penalty=1.0, min_tokens=12)
    out = tiny.generate(PROMPT, params)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama.removeprefix("file://"), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = hf(torch.tensor([PROMPT + out.token_ids])).logits[0].log_softmax(-1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logp[len(PROMPT) - 1 + i]
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-3)
        top_vals, top_ids = row.topk(3)
        assert list(lp.top) == top_ids.tolist()
        assert list(lp.top.values()) == pytest.approx(top_vals.tolist(), abs=1e-3)
    # The penalties changed what was chosen: the raw argmax is not always the token emitted.
    assert any(max(lp.top, key=lp.top.get) != token for token, lp in zip(out.token_ids, out.logprobs))


def _metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁the": 3, "!": 4, "▁Paris": 5, "▁is": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_sentencepiece_text_keeps_the_first_tokens_leading_space():
    tokenizer = _metaspace_tokenizer()
    assert tokenizer.decode([5]) == "Paris"  # alone, Metaspace drops the space: what went wrong before
    detok = IncrementalDetokenizer(tokenizer, [], prompt_ids=[1, 2, 6])
    output = []
    for token in (5, 4, 3, 2):
        output.append(token)
        detok.update(output)
    assert detok.text == " Paris! the world"
    assert detok.text == tokenizer.decode([1, 2, 6] + output)[len(tokenizer.decode([1, 2, 6])) :]


def test_the_first_stop_condition_in_one_speculative_step_wins(tiny):
    engine = tiny.engine
    pear, apple, plum = (
        tiny.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" pear", " apple", " plum")
    )
    cases = {  # tokens one step emitted -> (tokens kept, finish_reason, stop_reason, text)
        "string first": ([pear, apple, pear, plum, pear], [pear, apple], "apple", " pear "),
        "token first": ([pear, plum, apple, pear, pear], [pear, plum], plum, " pear"),
    }
    for rid, (step, kept, stop_reason, text) in cases.items():
        engine.add_request(
            rid, PROMPT, SamplingParams(temperature=0, max_tokens=8, stop=["apple"], stop_token_ids=[plum])
        )
        req = engine._requests[rid]
        engine.scheduler.append(req.seqs[0], step, engine._stop)  # as the scheduler takes a step's tokens
        out = engine._output(req, True).outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == (
            kept,
            "stop",
            stop_reason,
            text,
        )
        engine._requests.pop(rid)
    assert engine.kv_blocks_in_use() == 0


def test_seeded_output_is_independent_of_batch_and_speculation(tiny_llama):
    prompt = PROMPT * 3  # the tiny model repeats itself, so n-gram drafts get accepted
    # Near-greedy on this random model (its logits are flat), so that n-gram drafts get accepted at all.
    params = SamplingParams(temperature=0.05, top_p=0.95, seed=2024, max_tokens=40, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (7, 30, 19)]

    def run(**engine_kw) -> tuple[list[int], int]:
        llm = LLM(model=tiny_llama, block_size=4, max_model_len=256, **engine_kw)
        outs = llm.generate([[5, 6], prompt, [7, 8, 9], [10]], [others[0], params, *others[1:]])
        alone = llm.generate(prompt, params)[0].outputs[0].token_ids
        assert alone == outs[1].outputs[0].token_ids, "the batch changed a seeded request's tokens"
        return alone, llm.engine.stats.num_accepted_tokens

    plain, _ = run()
    for k in (2, 4):
        tokens, accepted = run(speculative_method="ngram", num_speculative_tokens=k)
        assert accepted > 0, "no draft was accepted: the test would not exercise verification"
        assert tokens == plain, f"speculation with k={k} changed a seeded request's tokens"
    tokens, _ = run(speculative_method="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=2)
    assert tokens == plain
