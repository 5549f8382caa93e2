"""The speculative-decoding rules a scheduler can see, as pure functions: how many tokens one sequence may
propose in a step, and when the batch guard turns proposals off. The engine (`llm_engine.py`) applies them
to its sequences and the simulator (`sim/engine.py`) to its simulated ones, so both follow one rule.

Plain Python on purpose: the simulator imports this module and stays free of torch.
"""

from __future__ import annotations

# Shadow drafts' new lookups per step (spec_decode/shadow.py; the simulator's sim/shadow.py): 4 lookups cost
# 20-40 us of numpy against a 20-200 ms CPU step, and even at 5 steps/s give ~150 scored drafts per 8 s
# metrics window, enough to read acceptance to a few percent.
LOOKUPS_PER_STEP = 4


def speculation_off(running: int, waiting: int, max_num_seqs: int, guard: int) -> bool:
    """The batch guard (`speculative_disable_by_batch_size`, 0: never): whether the batch this step will run
    (the running sequences plus the waiting ones `max_num_seqs` leaves room for) is larger than `guard`.
    Past the step cost's knee a draft token costs as much as a sequence's own, so a load that rose between
    two tuner intervals gets no drafts from its first step."""
    return bool(guard) and min(running + waiting, max_num_seqs) > guard


def k_room(max_model_len: int, num_tokens: int, tokens_left: int | None) -> int:
    """Proposals one sequence can still verify in a step (the k-room rule): the context must hold them and
    the bonus token, and the output must not run past what the request may still produce (`tokens_left`:
    output tokens before its max_tokens; None: no limit)."""
    room = max_model_len - num_tokens - 1
    return room if tokens_left is None else min(room, tokens_left - 1)


def proposal_length(k: int, room: int, ceiling: int) -> int:
    """Tokens to propose for one sequence: its k (the live value, or the request's own), within its room
    (`k_room`) and the engine's ceiling for k fixed at start; never negative."""
    return max(0, min(k, room, ceiling))
