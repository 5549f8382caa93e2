"""No handler the operator image loads puts kopf's finalizer on an InferenceService.

kopf adds its finalizer to every object a timer or daemon runs for (and for every deletion handler), and a
finalizer makes deletions hang whenever the operator is not running (docs/operator.md, "Finalizers and
deletion"); operator/handlers.py drops that requirement at startup by reaching into kopf's registry. These
tests take the handlers as the image loads them (`cli.load_handlers`: the operator's and the tuner's,
tests/operator/test_op_images.py proves the image loads the same), not a chosen few: the registry after
startup asks for no finalizer for any handler, and the entry point itself, run against the API double with
an autotuned service so that the tuner's timers run too, never writes one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from fake_kube import FakeKube
from helpers import wait_for
from isvc_schema_tools import REPO
from specfleet.engine.python_child import python_command
from specfleet.operator.cli import OPERATOR_MODULES, OPTIONAL_MODULES

NS = "team-a"  # the namespace tests/operator/conftest.py's double grants the chart's Role in
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")


# Run in a child process, so that this test's registry (the tuner's handlers included) does not become the
# registry of the kopf operators other tests start in this one. kopf has no public listing: each registry
# attribute that can list its handlers is asked (as tests/operator/test_op_images.py's probe does).
PROBE = """
import json, kopf
from specfleet.operator import handlers
from specfleet.operator.cli import load_handlers
loaded = load_handlers()
registry = kopf.get_default_registry()
def every_handler():
    return [h for sub in vars(registry).values() if hasattr(sub, "get_all_handlers") for h in sub.get_all_handlers()]
modules = sorted({h.fn.__module__ for h in every_handler()})
handlers.drop_finalizer_requirements(registry)  # what the `configure` startup handler does
requiring = sorted(f"{h.fn.__module__}.{h.fn.__qualname__}" for h in every_handler()
                   if getattr(h, "requires_finalizer", False))
print(json.dumps({"loaded": loaded, "modules": modules, "requiring": requiring}))
"""


@pytest.mark.slow
def test_after_startup_no_handler_the_image_loads_requires_a_finalizer() -> None:
    probe = subprocess.run(python_command("-c", PROBE), capture_output=True, text=True, check=True)
    found = json.loads(probe.stdout)
    assert found["loaded"] == [*OPERATOR_MODULES, *OPTIONAL_MODULES]
    assert {"specfleet.operator.handlers", "specfleet.tuner.handlers"} <= set(found["modules"]), found
    assert not found["requiring"], f"these handlers would make kopf add its finalizer: {found['requiring']}"


@pytest.mark.slow
def test_the_entry_point_with_every_handler_never_writes_a_finalizer(
    fake_kube: FakeKube, tmp_path: Path
) -> None:
    """`python -m specfleet.operator.cli` as the image runs it, over two services, one autotuned: it runs
    until the tuner's timer has written the autotuned one's status, and no write ever carries a finalizer."""
    fake_kube.add_namespace(NS)
    plain = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    tuned = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    tuned["metadata"]["name"] = "tuned"
    tuned["spec"]["autotune"] = {"enabled": True, "intervalSeconds": 5}
    fake_kube.put(*ISVC, NS, plain)
    fake_kube.put(*ISVC, NS, tuned)
    env = {
        **os.environ,
        "KUBECONFIG": str(fake_kube.write_kubeconfig(tmp_path / "kubeconfig", NS)),
        "SPECFLEET_TUNER_TICK_SECONDS": "1",  # the tuner's timer within a second of the start
        "SPECFLEET_RECONCILE_INTERVAL": "2",
    }
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            python_command("-m", "specfleet.operator.cli", "--namespace", NS, "--standalone"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:

            def tuner_wrote() -> bool:
                conditions = ((fake_kube.get(*ISVC, NS, "tuned") or {}).get("status") or {}).get("conditions")
                return any(c.get("type") == "Tuned" for c in conditions or [])

            wait_for("the tuner's timer to report on the autotuned service", tuner_wrote, 90)
            wait_for(
                "another timer pass",
                lambda: (
                    proc.poll() is not None
                    or (sum(1 for r in fake_kube.requests if r.path.endswith("/tuned/status")) >= 4)
                ),
                30,
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    text = log.read_text(errors="replace")
    assert "specfleet.tuner.handlers" in text, text[-3000:]  # the handlers line: the tuner was loaded
    for name in ("smollm2", "tuned"):
        assert not (fake_kube.get(*ISVC, NS, name) or {})["metadata"].get("finalizers"), name
    finalizing = [
        (r.method, r.path)
        for r in fake_kube.requests
        if r.method in ("PATCH", "PUT") and "finalizers" in yaml.safe_dump(r.body or {})
    ]
    assert not finalizing, finalizing
