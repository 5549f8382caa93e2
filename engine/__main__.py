"""`python -m specfleet.engine [serve] --model URI ...`: the engine pod's entry point."""

from __future__ import annotations

import os
import sys

# A multi-node group (the operator's LeaderWorkerSet, engine.nodes > 1) sets SPECFLEET_NODES on every pod.
# This engine's ranks are processes it spawns itself; joining ranks across pods (MASTER_ADDR/MASTER_PORT,
# SPECFLEET_NODE_RANK) is not implemented, so it stops with a message rather than serve a copy per pod.
MULTI_NODE_UNSUPPORTED = (
    "SPECFLEET_NODES={nodes}: this engine runs its pipeline stages as local processes; ranks "
    "across pods are not implemented yet. Set engine.nodes to 1 (all stages in one pod)."
)

if __name__ == "__main__":
    nodes = os.environ.get("SPECFLEET_NODES", "1").strip() or "1"
    if nodes != "1":  # checked before the server (and torch) is imported: the pod says why at once
        print(MULTI_NODE_UNSUPPORTED.format(nodes=nodes), file=sys.stderr)
        raise SystemExit(2)
    from specfleet.engine.server.cli import main

    raise SystemExit(main(sys.argv[1:]))
