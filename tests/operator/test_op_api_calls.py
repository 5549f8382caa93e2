"""The operator's API traffic at 200 InferenceServices (issue 34, section 3): the real kopf operator on the
strict API double, counted by the double (bench/operator_api_calls.py, in its own process: the timer's
interval is fixed when the handlers are imported). Bounds are on counts of calls, never on timings."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from isvc_schema_tools import REPO
from specfleet.engine.python_child import python_command

SERVICES = 200
STEADY_CALLS_PER_RECONCILE = 3  # the bound for a reconcile that changes nothing
STEADY_CALLS_PER_SECOND = 2.0  # the goal for all 200 at the production timer and resync


@pytest.mark.slow
def test_200_services_cost_at_most_2_calls_per_second_in_steady_state() -> None:
    # A 2 s timer: 100 reconciles/s of ~5 ms each, half a core of the shared CPU. The counts do not depend
    # on it (the same at 4 s, the bench's documented run: 0 calls a steady reconcile, 1802 in the resync,
    # 15 for the change); the phases that wait on timer passes (two steady ticks, the resync's nine passes,
    # the change's two) take half as long: 48 s for the bench instead of 82 s on the loaded 2-core host.
    command = python_command("-m", "specfleet.bench.operator_api_calls", "--services", str(SERVICES))
    done = subprocess.run(
        [*command, "--interval", "2"], capture_output=True, text=True, timeout=1200, cwd=REPO, env=os.environ
    )
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout)

    steady = figures["steady"]
    assert steady["reconciles"] >= 2 * SERVICES, steady  # every service's timer ran twice in the window
    assert steady["most_api_calls_in_one_reconcile"] <= STEADY_CALLS_PER_RECONCILE, steady
    resync = figures["resync"]  # the re-applies are spread over the timer's passes, not one burst
    assert resync["most_api_calls_in_one_reconcile"] <= STEADY_CALLS_PER_RECONCILE, resync
    assert figures["production"]["steady_api_calls_per_s"] <= STEADY_CALLS_PER_SECOND, figures
    # one service's spec change and rollout cost no more than a new service's first passes
    assert figures["change"]["api_calls"] <= figures["converge"]["api_calls"] / SERVICES, figures
