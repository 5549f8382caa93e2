"""Tensor and pipeline parallelism: the shard plan, the slices, the stages, and split engines (processes over
gloo) against the whole model in one process."""

from __future__ import annotations

import multiprocessing
import subprocess
from typing import Any, NamedTuple

import pytest
import torch
from helpers import tiny_config, write_tiny_checkpoint
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.distributed import WorkerDied
from specfleet.engine.distributed.comm import COLLECTIVE_TIMEOUT_S
from specfleet.engine.distributed.pipeline import stage_layers
from specfleet.engine.distributed.sharding import plan, shard_state
from specfleet.engine.python_child import python_command


def test_a_size_that_does_not_divide_the_heads_is_refused_with_the_numbers():
    # SmolLM2-135M: 9 attention heads, 3 KV heads, MLP width 1536, vocab 49152
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 does not divide the model's 9 attention heads"
    ):
        plan(9, 3, 1536, 49152, 2, 0)
    with pytest.raises(ValueError, match="MLP width of 1536"):
        plan(9, 3, 1536, 49152, 9, 0)
    assert len(plan(9, 3, 1536, 49152, 3, 2).heads) == 3


def test_llm_refuses_a_size_that_does_not_divide_the_heads_before_it_starts_any_worker():
    # SmolLM2-135M splits only by 1 or 3 (9 heads, 3 KV heads, MLP width 1536 = 2^9 x 3)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 does not divide the model's 9 attention heads and 3 KV heads "
        r"\(the model: 9 attention heads, 3 KV heads, MLP width 1536.*use one of 1, 3$",
    ):
        LLM(model="bundled://smollm2-135m-instruct", tensor_parallel_size=2)
    assert not multiprocessing.active_children()  # refused in this process: no rank was spawned
    with pytest.raises(ValueError, match="pipeline_parallel_size=31 must be between 1 and the model's 30"):
        LLM(model="bundled://smollm2-135m-instruct", pipeline_parallel_size=31)
    assert not multiprocessing.active_children()


def _state(hidden=16, heads=4, kv=2, head_dim=4, inter=24, vocab=10):
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "model.embed_tokens.weight": r(vocab, hidden),
        "model.layers.0.self_attn.q_proj.weight": r(heads * head_dim, hidden),
        "model.layers.0.self_attn.q_proj.bias": r(heads * head_dim),
        "model.layers.0.self_attn.k_proj.weight": r(kv * head_dim, hidden),
        "model.layers.0.self_attn.v_proj.weight": r(kv * head_dim, hidden),
        "model.layers.0.self_attn.o_proj.weight": r(hidden, heads * head_dim),
        "model.layers.0.mlp.gate_proj.weight": r(inter, hidden),
        "model.layers.0.mlp.up_proj.weight": r(inter, hidden),
        "model.layers.0.mlp.down_proj.weight": r(hidden, inter),
        "model.layers.0.input_layernorm.weight": r(hidden),
        "lm_head.weight": r(vocab, hidden),
    }


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_slices_of_all_ranks_put_back_together_are_the_weights(size):
    state, head_dim = _state(), 4
    shards = [shard_state(state, plan(4, 2, 24, 10, size, rank), head_dim) for rank in range(size)]
    cat = lambda name, dim: torch.cat([s[name] for s in shards], dim=dim)  # noqa: E731
    for name in ("q_proj.weight", "q_proj.bias"):
        assert torch.equal(
            cat(f"model.layers.0.self_attn.{name}", 0), state[f"model.layers.0.self_attn.{name}"]
        )
    assert torch.equal(
        cat("model.layers.0.self_attn.o_proj.weight", 1), state["model.layers.0.self_attn.o_proj.weight"]
    )
    for name in ("gate_proj", "up_proj"):
        assert torch.equal(
            cat(f"model.layers.0.mlp.{name}.weight", 0), state[f"model.layers.0.mlp.{name}.weight"]
        )
    assert torch.equal(
        cat("model.layers.0.mlp.down_proj.weight", 1), state["model.layers.0.mlp.down_proj.weight"]
    )
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # 10 rows in shards of ceil(10 / size)
        whole = cat(name, 0)
        assert torch.equal(whole[:10], state[name]) and not whole[10:].any()
    assert all(
        torch.equal(
            s["model.layers.0.input_layernorm.weight"], state["model.layers.0.input_layernorm.weight"]
        )
        for s in shards
    )
    k = state["model.layers.0.self_attn.k_proj.weight"]
    for rank, s in enumerate(shards):  # 2 KV heads: split over 2 ranks, replicated over 4
        p = plan(4, 2, 24, 10, size, rank)
        assert torch.equal(
            s["model.layers.0.self_attn.k_proj.weight"], k[p.kv_heads.start * 4 : p.kv_heads.stop * 4]
        )
        group = 4 // 2  # query heads per KV head: each rank's query heads read the KV heads it holds
        assert {h // group for h in p.heads} <= set(p.kv_heads)


def _tiny(kind: str, tmp_path, bundled_path, vocab: int):
    """A tiny random `kind` model of `vocab` tokens (tied embeddings for llama), the bundled tokenizer."""
    config = tiny_config(kind, vocab_size=vocab, tie_word_embeddings=kind == "llama")
    return f"file://{write_tiny_checkpoint(tmp_path, config, std=0.2, tokenizer_from=bundled_path)}"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, bundled_path):
    """`tiny_checkpoint(kind, vocab)`: `_tiny`'s model, written once for the module (the same seed gives the
    same weights, and the engines only read it), so that it is written and converted once, not per test."""
    made: dict[tuple[str, int], str] = {}

    def get(kind: str, vocab: int) -> str:
        if (kind, vocab) not in made:
            made[kind, vocab] = _tiny(kind, tmp_path_factory.mktemp(f"{kind}-{vocab}"), bundled_path, vocab)
        return made[kind, vocab]

    return get


PROMPTS = [
    [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 4, 19, 23, 88, 90, 91, 92, 93, 5000],
    [42],
    [3, 1, 4, 1, 5, 9, 2, 6],
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
# Row-parallel partial sums are added in a different order than one matmul adds them: float32 logits of
# unit-scale activations then differ in the last bits, far below this.
LOGPROB_ATOL = 1e-3


class Run(NamedTuple):
    tokens: list[list[int]]
    logprobs: list[list[float]]
    stats: Any  # EngineStats at the end of the run


def _run(
    model: str,
    size: int,
    prompts=PROMPTS,
    params=GREEDY,
    split="tensor",
    preempts=False,
    then=(),
    **kwargs,
) -> Run:
    """Generate `prompts` in one call, then `then` in a second (whose repeats of earlier prompts can only
    hit the prefix cache: within one call every prompt is scheduled before any block is cached)."""
    llm = LLM(model=model, block_size=4, **{f"{split}_parallel_size": size}, **kwargs)
    try:
        outs = [r.outputs[0] for batch in (prompts, then) if batch for r in llm.generate(batch, params)]
        stats = llm.engine.stats
        assert (stats.num_preemptions > 0) == preempts
    finally:
        llm.close()
    return Run(
        [o.token_ids for o in outs],
        [[next(iter(lp.values())).logprob for lp in o.logprobs] for o in outs],
        stats,
    )


_UNSPLIT: dict[str, Run] = {}


def _unsplit(model: str, prompts=PROMPTS, **kwargs) -> Run:
    """`_run(model, 1, prompts, **kwargs)`, once per module for the same arguments: the one-process reference
    two tests compare against (the int8 engine's, split by tensor and by pipeline; the bundled model's, split
    three ways by tensor and two by pipeline)."""
    key = repr((model, prompts, sorted(kwargs.items())))
    if key not in _UNSPLIT:
        _UNSPLIT[key] = _run(model, 1, prompts, **kwargs)
    return _UNSPLIT[key]


def _same(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=LOGPROB_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "size"), [("llama", 2), ("qwen2", 2), ("mistral", 4), ("qwen3", 2), ("phi3", 2)]
)
def test_tp_greedy_output_equals_tp1_on_random_models(kind, size, tiny_checkpoint):
    # 4 query heads, 2 KV heads: TP=4 replicates each KV head on two ranks; a vocabulary of 49157 is not a
    # multiple of 2 or 4, so the last vocab shard is padded; llama ties the embeddings, the others do not.
    model = tiny_checkpoint(kind, 49157)
    _same(_run(model, size), _run(model, 1))


# The bundled model's prompts for TP=3 and PP=2 (the TP=3 test says why these): one one-process reference run
# serves both (`_unsplit`).
BUNDLED_FIRST = ["The capital of France is the city of", "one two three one two three one two three one"]
BUNDLED_AGAIN = ["The capital of France is the city of"]


@pytest.mark.slow
def test_tp3_on_the_bundled_model_equals_tp1_with_speculation_and_prefix_hits():
    # The second call repeats the first prompt: its full blocks come from the prefix cache, i.e. from every
    # rank's own KV cache (each holds its KV head), and the tokens after them must still be TP=1's. The
    # second prompt repeats itself, so the n-gram proposer has drafts to make.
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    first, again = BUNDLED_FIRST, BUNDLED_AGAIN
    one = _unsplit("bundled://smollm2-135m-instruct", first, then=again)
    plain = _run("bundled://smollm2-135m-instruct", 3, first, then=again)
    spec = _run("bundled://smollm2-135m-instruct", 3, first, then=again, **ngram)
    for run in (one, plain, spec):
        assert run.stats.prefix_cache_hits >= 4  # the first 4-token block of the repeated 8-token prompt
    assert spec.stats.num_drafts > 0 and spec.stats.num_accepted_tokens > 0
    _same(plain, one)
    _same(spec, one)


@pytest.mark.slow
def test_a_dead_worker_fails_the_step_with_its_rank_and_exit_code(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama", 49152), block_size=4, tensor_parallel_size=2)
    try:
        llm.generate([[1, 2, 3]], GREEDY)
        llm.engine.check_health()  # all ranks alive
        worker = llm.engine.runner.model._procs[0]
        worker.kill()
        worker.join(timeout=10)
        with pytest.raises(WorkerDied, match=r"rank 1 exited with code -9"):
            llm.engine.check_health()  # what the engine core asks while idle
        with pytest.raises(WorkerDied, match=r"rank 1 exited with code -9"):
            llm.generate([[1, 2, 3]], GREEDY)
    finally:
        llm.close()


def test_a_worker_that_dies_before_joining_the_group_is_worker_died_at_once(tmp_path, tiny_llama):
    # A script without `if __name__ == "__main__":` (a common mistake with the spawn method): the worker
    # re-runs it on start, fails there before it joins the process group, and exits. Rank 0 must say so
    # instead of waiting in the group's rendezvous until its timeout, and say what to do rather than leave
    # Python's bootstrapping error buried in the worker's stderr.
    script = tmp_path / "no_main_guard.py"
    script.write_text(
        f"from specfleet.engine import LLM\nLLM(model={tiny_llama!r}, tensor_parallel_size=2)\n"
    )
    done = subprocess.run(
        python_command(str(script)), capture_output=True, text=True, timeout=COLLECTIVE_TIMEOUT_S * 0.75
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]  # the exception the user sees last
    assert last.startswith(
        "specfleet.engine.distributed.WorkerDied: rank 1 exited with code 1 while starting"
    ), done.stderr[-3000:]
    assert f"the script {script} creates the engine at its top level" in last
    assert 'Put the code that creates the LLM under `if __name__ == "__main__":`' in last


@pytest.mark.slow
def test_a_worker_that_dies_while_loading_is_worker_died_and_leaves_no_group(tmp_path, bundled_path):
    # A checkpoint that lacks a tensor of its last layer: stage 0 (this process, layer 0) loads, stage 1
    # fails on the missing tensor and exits while rank 0 waits for it to be ready.
    from safetensors.torch import load_file, save_file

    model = _tiny("llama", tmp_path, bundled_path, vocab=49152)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(
        WorkerDied,
        match=r"worker failure: rank 1 exited with code 1 \(rank 1 was loading its part of the model\)",
    ):
        LLM(model=model, block_size=4, pipeline_parallel_size=2)
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()  # the next split engine of this process can start


def test_stages_are_equal_runs_of_layers():
    assert [len(stage_layers(30, 4, s)) for s in range(4)] == [8, 8, 7, 7]
    assert [stage_layers(30, 4, s).start for s in range(4)] == [0, 8, 16, 23]
    with pytest.raises(ValueError, match="between 1 and the model's 2 layers"):
        stage_layers(2, 3, 0)


@pytest.mark.slow
def test_pp2_on_the_bundled_model_equals_pp1_with_speculation_and_prefix_hits():
    # the TP=3 test's prompts and one-process reference; here each stage's KV cache holds the prefix hits
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    one = _unsplit("bundled://smollm2-135m-instruct", BUNDLED_FIRST, then=BUNDLED_AGAIN)
    split = _run(
        "bundled://smollm2-135m-instruct", 2, BUNDLED_FIRST, split="pipeline", then=BUNDLED_AGAIN, **ngram
    )
    assert split.stats.prefix_cache_hits >= 4 and split.stats.num_drafts > 0
    _same(split, one)


@pytest.mark.slow
def test_pp2_equals_pp1_under_preemption(tiny_checkpoint):
    # 3 sequences of up to 35 tokens in blocks of 4 need 27 blocks; 14 force preemption by recompute
    model = tiny_checkpoint("qwen2", 49152)
    tight = {"num_kv_blocks": 14, "max_model_len": 48, "max_num_seqs": 3}
    _same(_run(model, 2, split="pipeline", preempts=True, **tight), _run(model, 1, preempts=True, **tight))


@pytest.mark.slow
def test_pp2_keeps_two_micro_batches_in_flight_and_equals_pp1_with_speculation_under_preemption(
    tiny_checkpoint,
):
    # Overlap (vLLM's virtual engines) splits the sequences over two micro-batches in flight at once: each
    # sequence's steps, proposals (n-gram) and preemptions must still match one process token for token.
    model = tiny_checkpoint("llama", 49152)
    tight = {
        "num_kv_blocks": 14,
        "max_model_len": 48,
        "max_num_seqs": 3,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
    }
    prompts = PROMPTS + [[7, 8, 9, 7, 8, 9, 7, 8]]
    one = _run(model, 1, prompts, preempts=True, **tight)
    llm = LLM(model=model, block_size=4, pipeline_parallel_size=2, **tight)
    try:
        outs = [r.outputs[0] for r in llm.generate(prompts, GREEDY)]
        stats = llm.engine.stats
        assert stats.peak_micro_batches_in_flight == 2 and stats.num_preemptions > 0
        assert stats.num_drafts > 0
        assert llm.engine.kv.num_used_blocks == 0  # every block came back
    finally:
        llm.close()
    _same(
        ([o.token_ids for o in outs], [[next(iter(lp.values())).logprob for lp in o.logprobs] for o in outs]),
        one,
    )


@pytest.mark.slow
def test_pp2_without_overlap_runs_one_micro_batch_at_a_time(tiny_checkpoint):
    model = tiny_checkpoint("llama", 49152)
    llm = LLM(model=model, block_size=4, pipeline_parallel_size=2, pipeline_overlap=False)
    try:
        outs = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.stats.peak_micro_batches_in_flight == 0
    finally:
        llm.close()
    assert outs == _run(model, 1)[0]


@pytest.mark.slow
def test_tp2_x_pp2_on_a_random_model_equals_one_process(tiny_checkpoint):
    # Four ranks: each of two stages holds one layer split over its two ranks (a vocabulary of 49157 pads
    # the last vocab shard); the stages overlap two micro-batches.
    model = tiny_checkpoint("qwen2", 49157)
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    prompts = PROMPTS + [[7, 8, 9, 7, 8, 9, 7, 8]]  # a repeating prompt: the n-gram proposer drafts
    split = _run(model, 2, prompts, pipeline_parallel_size=2, **ngram)
    assert split.stats.num_drafts > 0
    _same(split, _run(model, 1, prompts))


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_int8_split_equals_the_unsplit_int8_engine(tp, pp, tiny_checkpoint):
    # Each rank quantizes its part at load; a row-parallel slice keeps the whole weight's column scales, so
    # the ranks together hold exactly the unsplit int8 codes (only the order of the partial sums differs).
    model = tiny_checkpoint("llama", 49152)
    _same(
        _run(model, tp, pipeline_parallel_size=pp, quantization="int8"), _unsplit(model, quantization="int8")
    )


@pytest.mark.slow
def test_gguf_splits_into_pipeline_stages_and_is_refused_under_tensor_parallelism():
    prompts, params = (
        ["The capital of France is"],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
    )
    gguf = {"quantization": "gguf"}
    _same(
        _run("bundled://smollm2-135m-instruct", 2, prompts, params, split="pipeline", **gguf),
        _run("bundled://smollm2-135m-instruct", 1, prompts, params, **gguf),
    )
    with pytest.raises(
        ValueError, match=r"quantization='gguf' with tensor_parallel_size=3: .*pipeline_parallel_size"
    ):
        LLM(model="bundled://smollm2-135m-instruct", quantization="gguf", tensor_parallel_size=3)
