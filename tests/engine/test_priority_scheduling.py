"""Priority scheduling (vLLM's `--scheduling-policy priority`) in the scheduler, without a model: the waiting
queue's order, the preemption victim under KV pressure, a high-priority arrival displacing low-priority
running sequences (never equals), and fcfs unchanged; plus the engine's refusal of a priority under fcfs."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.engine.args import add_engine_args, engine_config_kwargs
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.config import FCFS, PRIORITY, SCHEDULING_POLICIES, EngineConfig
from specfleet.engine.request_queue import waiting_queue
from specfleet.engine.sampling_params import ParameterError, SamplingParams
from specfleet.engine.scheduler import Scheduler, SchedulerOutput
from specfleet.engine.sequence import Sequence, Status

BS = 4


def _seq(i: int, priority: int, arrival: float, prompt_len: int = 4, max_tokens: int = 64) -> Sequence:
    prompt = [i % 7 + 1] * prompt_len
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(i, f"r{i}", 0, prompt, prompt_len, params, arrival_time=arrival, priority=priority)


def _sched(policy: str, num_blocks: int, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BS, enable_prefix_caching=False), max_num_seqs, budget, 256, policy
    )


def _run(sched: Scheduler, out: SchedulerOutput) -> None:
    """A stand-in model: every sampling sequence gets token 1."""
    sched.update(out, [[1] if item.sample else [] for item in out.scheduled])


def _ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


def test_priority_admits_lower_values_first_then_by_arrival() -> None:
    sched = _sched(PRIORITY, num_blocks=64, max_num_seqs=1)
    arrivals = [(0, 5, 1.0), (1, 0, 2.0), (2, 5, 0.5), (3, -2, 3.0), (4, 0, 1.5)]
    for i, priority, arrival in arrivals:
        sched.add(_seq(i, priority, arrival, max_tokens=1))
    admitted = []
    while sched.has_unfinished():
        out = sched.schedule()
        admitted += [item.seq.seq_id for item in out.scheduled if item.seq.seq_id not in admitted]
        _run(sched, out)
        for seq in list(sched.running):
            if seq.num_output_tokens >= 1:
                sched.finish(seq, "length")
    assert admitted == [3, 4, 1, 2, 0]  # -2; then the 0s by arrival (1.5, 2.0); then the 5s (0.5, 1.0)


def test_fcfs_admits_by_arrival_whatever_the_priority() -> None:
    sched = _sched(FCFS, num_blocks=64, max_num_seqs=1)
    for i, priority in enumerate([5, 0, -2]):
        sched.add(_seq(i, priority, float(i), max_tokens=1))
    out = sched.schedule()
    assert _ids(item.seq for item in out.scheduled) == [0]


def _fill(sched: Scheduler, priorities: list[int], prompt_len: int = 4) -> list[Sequence]:
    """Admit one prompt per priority (arrivals in order) and run their prefill step."""
    seqs = [_seq(i, p, float(i), prompt_len) for i, p in enumerate(priorities)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert len(out.scheduled) == len(seqs)
    _run(sched, out)
    return seqs


def test_under_kv_pressure_the_lowest_priority_latest_arrival_is_preempted() -> None:
    # 4 sequences of 5 tokens hold 2 blocks each once they decode; 7 blocks: one must go
    sched = _sched(PRIORITY, num_blocks=7)
    seqs = _fill(sched, [0, 3, 3, 1])  # each holds 1 block (4 prompt tokens), token 5 needs a 2nd
    out = sched.schedule()
    assert out.num_preemptions == 1 and out.num_priority_preemptions == 0  # the cache's, not an arrival's
    assert seqs[2].status is Status.WAITING and seqs[2].num_preemptions == 1  # priority 3, the later one
    assert all(s.status is Status.RUNNING for s in (seqs[0], seqs[1], seqs[3]))
    assert _ids(sched.running) == [0, 3, 1]  # kept in (priority, arrival) order: the tail goes first


def test_fcfs_preempts_the_latest_admitted_whatever_the_priority() -> None:
    sched = _sched(FCFS, num_blocks=7)
    seqs = _fill(sched, [0, 3, 3, 1])
    sched.schedule()
    assert seqs[3].status is Status.WAITING and seqs[2].status is Status.RUNNING


def test_a_high_priority_arrival_displaces_low_priority_running_ones_when_the_cache_is_full() -> None:
    sched = _sched(PRIORITY, num_blocks=4)
    low = _fill(sched, [5, 5, 5, 5])  # 4 blocks, all held
    urgent = _seq(9, 0, 10.0)
    sched.add(urgent)
    out = sched.schedule()
    # Each low sequence needs a 2nd block for its 5th token: the running pass preempts the latest arrivals
    # for the earlier ones; the step admits nobody after preempting (as before), the next admits `urgent`.
    if urgent.status is not Status.RUNNING:
        _run(sched, out)
        out = sched.schedule()
    assert urgent.status is Status.RUNNING and urgent in [item.seq for item in out.scheduled]
    assert out.num_batched_tokens == sum(item.num_new_tokens for item in out.scheduled)
    preempted = [s for s in low if s.status is Status.WAITING]
    assert preempted and all(s.num_preemptions >= 1 for s in preempted)
    # the victims are the latest arrivals among equals: the earliest low sequence still runs
    assert low[0].status is Status.RUNNING


def test_admission_displaces_a_victim_already_scheduled_this_step_and_gives_its_tokens_back() -> None:
    sched = _sched(PRIORITY, num_blocks=5, budget=64)
    low = _fill(sched, [5, 5], prompt_len=3)  # 1 block each, room in it for the 4th token; 3 free
    urgent = _seq(9, 0, 10.0, prompt_len=16)  # needs 4 blocks
    sched.add(urgent)
    out = sched.schedule()  # the two decode (no new block), then `urgent` needs 4 of the 3 free
    assert urgent.status is Status.RUNNING
    assert low[1].status is Status.WAITING and low[0].status is Status.RUNNING
    assert low[1] not in [item.seq for item in out.scheduled]  # its decode, scheduled first, was undone
    assert out.num_batched_tokens == sum(item.num_new_tokens for item in out.scheduled) == 1 + 16
    assert out.num_prompt_tokens == 16 and out.num_preemptions == out.num_priority_preemptions == 1
    _run(sched, out)


def test_equal_priorities_never_displace_each_other_and_fcfs_never_displaces() -> None:
    for policy, newcomer_priority in ((PRIORITY, 5), (FCFS, 0)):
        sched = _sched(policy, num_blocks=2)
        running = _fill(sched, [5, 5])
        sched.add(_seq(9, newcomer_priority, 10.0))
        out = sched.schedule()
        # no block for anyone's 5th token: one running sequence yields to the other, the newcomer waits
        assert all(item.seq.seq_id != 9 for item in out.scheduled), policy
        assert sum(s.status is Status.RUNNING for s in running) == 1, policy


def test_max_num_seqs_full_of_low_priority_makes_room_for_a_higher_one() -> None:
    sched = _sched(PRIORITY, num_blocks=64, max_num_seqs=2)
    low = _fill(sched, [4, 4])
    sched.add(_seq(9, 1, 10.0))
    out = sched.schedule()
    assert 9 in _ids(item.seq for item in out.scheduled) and low[1].status is Status.WAITING
    assert len(out.scheduled) == 2 and len(sched.running) == 2
    # and an equal one waits for a slot instead
    sched.add(_seq(10, 4, 11.0))
    _run(sched, out)
    assert 10 not in _ids(item.seq for item in sched.schedule().scheduled)


def test_a_preempted_sequence_resumes_ahead_of_later_arrivals_of_its_priority() -> None:
    queue = waiting_queue(PRIORITY)
    early, late = _seq(0, 2, 1.0), _seq(1, 2, 2.0)
    queue.add(late)
    queue.add_preempted(early)
    queue.add(_seq(2, 3, 0.0))
    assert queue.peek() is early and len(queue) == 3 and late in queue
    queue.remove(late)
    assert [queue.pop().seq_id for _ in range(2)] == [0, 2] and not queue


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_blocks=st.integers(8, 30),
    max_seqs=st.integers(1, 6),
    budget=st.integers(4, 40),
    jobs=st.lists(st.tuples(st.integers(1, 14), st.integers(-2, 2)), min_size=1, max_size=10),
    spec=st.integers(0, 3),
)
def test_priority_scheduling_keeps_the_cache_consistent_and_finishes_everyone(
    seed: int, num_blocks: int, max_seqs: int, budget: int, jobs: list[tuple[int, int]], spec: int
) -> None:
    """Random arrivals of random priorities, with speculative proposals: blocks stay consistent, the
    running list stays in key order, and everyone finishes with every block returned."""
    rng = random.Random(seed)
    kv = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_seqs, budget, 32, PRIORITY)
    pending = []
    for i, (n, p) in enumerate(jobs):
        params = SamplingParams(max_tokens=rng.randint(1, 10))
        prompt = [rng.randrange(4) for _ in range(n)]
        pending.append(Sequence(i, f"r{i}", 0, prompt, n, params, arrival_time=float(i), priority=p))
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        for seq in sched.running:
            if not seq.in_prefill:
                seq.spec_token_ids = [rng.randrange(4) for _ in range(spec)]
        out = sched.schedule()
        assert len(out.scheduled) <= max_seqs
        assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled) <= budget
        assert all(item.seq.status is Status.RUNNING for item in out.scheduled)
        sampled = []  # accepted proposals (a random prefix) and one token of the target's
        for item in out.scheduled:
            accepted = item.seq.spec_token_ids[: rng.randint(0, item.num_spec_tokens)]
            sampled.append(accepted + [rng.randrange(4)] if item.sample else [])
        sched.update(out, sampled)
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
        refs = [0] * num_blocks
        for seq in sched.running:
            for b in seq.block_table:
                refs[b] += 1
        assert refs == kv.ref_counts and all(not s.block_table for s in sched.waiting)
        keys = [(s.priority, s.arrival_time, s.seq_id) for s in sched.running]
        assert keys == sorted(keys)
    assert not sched.has_unfinished() and not pending, "a request was never finished"
    assert kv.num_free_blocks == num_blocks


def test_the_engine_refuses_a_priority_under_fcfs_naming_the_field() -> None:
    from specfleet.engine.llm_engine import Engine

    engine = Engine.__new__(Engine)  # the check needs only the config: no model
    engine.config = EngineConfig()
    with pytest.raises(ParameterError) as err:
        engine._check_priority(3)
    assert err.value.param == "priority" and "Priority scheduling is not enabled" in str(err.value)
    assert "--scheduling-policy priority" in str(err.value)
    engine._check_priority(0)
    engine.config = EngineConfig(scheduling_policy=PRIORITY)
    engine._check_priority(-7)
    bad_values: list[Any] = [2**63, True, 1.5]
    for bad in bad_values:
        with pytest.raises(ParameterError, match="priority"):
            engine._check_priority(bad)


def test_the_policy_is_an_engine_flag_and_an_unknown_one_is_refused() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--scheduling-policy", "priority"])
    assert EngineConfig(**engine_config_kwargs(args)).scheduling_policy == PRIORITY
    assert parser.parse_args([]).scheduling_policy == FCFS and SCHEDULING_POLICIES == (FCFS, PRIORITY)
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is not one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")


@pytest.mark.slow
def test_llm_generate_takes_one_priority_per_prompt(tiny_llama: str) -> None:
    from specfleet.engine import LLM

    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    llm = LLM(model=tiny_llama, max_num_seqs=1, max_model_len=64, scheduling_policy=PRIORITY)
    outs = llm.generate(prompts, greedy, priority=[2, 0, 1])
    started = [out.metrics.first_scheduled_time for out in outs if out.metrics is not None]
    assert sorted(range(3), key=lambda i: started[i]) == [1, 2, 0]  # one at a time, lowest value first
    with pytest.raises(ValueError, match="got 1 priorities for 3 prompts"):
        llm.generate(prompts, greedy, priority=[1])
    fcfs = LLM(model=tiny_llama, max_model_len=64)
    with pytest.raises(ParameterError, match="Priority scheduling is not enabled"):
        fcfs.generate(prompts, greedy, priority=[0, 0, 4])
    assert fcfs.engine.kv_blocks_in_use() == 0 and not fcfs.engine.has_unfinished_requests()


def test_max_loras_never_starves_an_adapter_behind_a_busy_one() -> None:
    """max_loras=1 with adapter A busy: a request for B waits, but requests for A that came after it wait
    behind it (they would otherwise keep A running for ever); base requests are not held up."""
    sched = _sched(FCFS, num_blocks=64, max_num_seqs=8)
    sched.max_loras = 1
    adapters = ["A", "B", "A", None, "A"]  # engine/lora LoraAdapter objects; the scheduler only compares them
    for i, lora in enumerate(adapters):
        seq = _seq(i, 0, float(i), max_tokens=2)
        seq.lora = lora
        sched.add(seq)
    admitted: list[list[int]] = []
    while sched.has_unfinished():
        out = sched.schedule()
        admitted.append(
            sorted(item.seq.seq_id for item in out.scheduled if item.seq.num_computed_tokens == 0)
        )
        _run(sched, out)
        for seq in list(sched.running):
            if seq.num_output_tokens >= 2:
                sched.finish(seq, "length")
    firsts = [ids for ids in admitted if ids]
    assert firsts == [[0, 3], [1], [2, 4]]  # A and the base; then B alone; then the later As
