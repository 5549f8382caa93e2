"""The engine flags the operator passes itself, which `engine.extraArgs` may not set again.

`engine.extraArgs` is appended last to the engine's command line and argparse keeps the last value, so a
repeated `--port` (or `--host`, `--admin-port`, a knob's start value or ceiling...) would silently replace
the operator's and break what depends on it: the probes, the Service, the tuner's admin API, the knob
ceilings the tuner's bounds rely on. argparse also takes an unambiguous abbreviation (`--admin-p 9000`) and
the `--flag=value` form, so both are refused too.

The list is the renderer's (operator/render/deployment.py: `engine_args`, `role_args`,
`_with_live_config`); tests/operator/test_op_admission_refusals.py renders every branch of it and checks
that each flag it writes is here and each flag here is written.
"""

from __future__ import annotations

import re

from specfleet.engine.args import flag
from specfleet.engine.knobs import SEARCHED

OPERATOR_FLAGS: tuple[str, ...] = (
    "--model",
    "--host",
    "--port",
    "--admin-port",
    "--block-size",
    "--max-model-len",
    "--dtype",
    "--speculative-method",
    # each searched knob's start value and its ceiling (engine/knobs.py)
    *(flag(k.name) for k in SEARCHED),
    *(flag(k.ceiling_field) for k in SEARCHED),
    "--kv-cache-memory-fraction",
    "--drain-timeout",
    "--shutdown-delay",
    "--quantization",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--speculative-disable-by-batch-size",
    "--draft-model",
    "--draft-quantization",
    "--no-prefix-caching",
    "--scheduling-policy",
    "--kv-role",
    "--kv-transfer-host",
    "--kv-transfer-port",
    "--live-config-file",
    "--enable-lora",
    "--max-loras",
    "--max-lora-rank",
    "--kv-events-config",  # routing.kvEvents: the router subscribes on the ports it names
)


def _abbreviations(name: str) -> str:
    """`--port` -> `--p(o(r(t)?)?)?`: the flag and every abbreviation argparse would expand to it."""
    body = name[2:]
    assert re.fullmatch("[a-z][-a-z]*", body), name  # no regex metacharacter to escape
    return "--" + body[0] + "".join(f"({c}" for c in body[1:]) + ")?" * (len(body) - 1)


# One engine argument that sets an operator flag: the flag, abbreviated or not, alone or as `--flag=value`
# (a regex for CEL's matches() and Python's re alike).
RESERVED_ARG_PATTERN = "^(" + "|".join(_abbreviations(f) for f in OPERATOR_FLAGS) + ")(=.*)?$"
RESERVED_ARGS_MESSAGE = (
    "engine.extraArgs may not set a flag the operator sets itself (as --flag value, --flag=value or "
    "abbreviated): " + ", ".join(OPERATOR_FLAGS) + "; use the spec's own fields"
)


def reserved_args(args: list[str]) -> list[str]:
    """The arguments of `args` that set an operator flag."""
    return [a for a in args if re.fullmatch(RESERVED_ARG_PATTERN, a)]
