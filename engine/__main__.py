"""`python -m specfleet.engine [serve] --model URI ...`: the engine pod's entry point."""

from __future__ import annotations

import sys

from specfleet.engine.server.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
