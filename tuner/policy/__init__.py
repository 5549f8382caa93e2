"""The tuning policy: observations in, one decision with a reason out. No I/O, no clock of its own.

Per interval (`decide.Policy.decide`):
1. data missing or the source down: hold the last good config and say so (fail static);
2. no traffic: hold (nothing to learn from an idle service);
3. load shift: the load moved within the window (its figures mix two loads): hold, except that
   speculation goes off at once when the load rose past the step cost's knee, and on when it fell under it
   (`shift.py`);
4. cooldown: the rate window still mixes samples from before the last change, so wait;
5. probation: a change is judged on the first clean window; if goodput or SLO attainment got worse by more
   than the margin (at a comparable load), revert it and do not retry it at that load for a while
   (`state.py`);
6. search: candidates one bounded step away (k +-4 or off, max_num_seqs x2 or /2), scored by predicted
   goodput (`model.py`, `candidates.py`); change only if the best beats the config in force by more than
   the dead band (`inherited_band`, for a config set before this load level began and unchanged since),
   or if the SLO is missed now and the candidate is predicted to meet it;
7. probes, where the model cannot tell (`probes.py`): speculation off past the knee (a proposer's own cost
   is invisible to it), a longer draft below it (acceptance past the measured positions is a guess), a
   shorter one when the last positions are rarely accepted; each judged by probation like any change.
Candidates are always inside the bounds, and a config outside them is moved inside first.

Beside the config, the policy keeps `guard`, the engines' `speculative_disable_by_batch_size`: the rule
of step 3 for a rise past the knee, applied by the engine at its next step instead of by the tuner at
its next interval. It follows the load at every settled interval and is not a decision of its own.

One concept per module: `params` (every tunable number and its reason), `load` (the shared load
quantities: batch per engine, step tokens, similar loads, a shift), `model` (step cost and goodput),
`memory` (what is learned from past windows), `candidates` (the bounded step and its scoring), `probes`,
`shift` (step 3 and the guard), `state` (probation, taboo, the shift being waited out), `reasons` (the
wording), `decide` (`Policy`, the steps in order), `resume` (what a restarted tuner continues from).
"""

from .decide import Policy
from .params import ModelParams, PolicyParams, StepLimits

__all__ = ["ModelParams", "Policy", "PolicyParams", "StepLimits"]
