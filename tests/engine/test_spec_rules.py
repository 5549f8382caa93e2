"""The speculative rules a scheduler can see (`engine/spec_decode/rules.py`): the engine and the simulator
both call them, so their edges are pinned here without a model."""

from __future__ import annotations

import subprocess

import pytest
from specfleet.engine.python_child import python_command
from specfleet.engine.spec_decode.rules import k_room, proposal_length, speculation_off


def test_the_batch_guard_counts_the_waiting_requests_max_num_seqs_admits() -> None:
    assert not speculation_off(running=40, waiting=40, max_num_seqs=64, guard=0)  # 0: never
    assert not speculation_off(running=4, waiting=0, max_num_seqs=64, guard=4)  # at the guard: still on
    assert speculation_off(running=4, waiting=1, max_num_seqs=64, guard=4)  # one admitted this step
    # waiting requests past max_num_seqs will not run in this step, so they do not count
    assert not speculation_off(running=2, waiting=30, max_num_seqs=4, guard=4)
    assert speculation_off(running=2, waiting=30, max_num_seqs=5, guard=4)


def test_the_k_room_keeps_the_bonus_token_inside_the_context_and_the_max_tokens() -> None:
    assert k_room(max_model_len=100, num_tokens=90, tokens_left=None) == 9  # 9 proposals + 1 bonus = 100
    assert k_room(max_model_len=100, num_tokens=90, tokens_left=4) == 3  # 3 proposals + 1 bonus = 4 left
    assert k_room(max_model_len=100, num_tokens=99, tokens_left=None) == 0
    assert proposal_length(k=5, room=3, ceiling=8) == 3
    assert proposal_length(k=5, room=30, ceiling=4) == 4
    assert proposal_length(k=5, room=-1, ceiling=8) == 0  # past the context: none, never negative


@pytest.mark.slow
def test_the_rules_import_without_torch() -> None:
    code = "import sys, specfleet.engine.spec_decode.rules; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run(python_command("-c", code), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
