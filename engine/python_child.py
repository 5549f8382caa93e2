"""The command line of every Python child process specfleet starts: this interpreter, never the working
directory on sys.path.

`python -m X` and `python -c CODE` put the directory they start in first on sys.path. Started in a checkout
of this repository (the tests, `specfleet up` and the benchmarks all start theirs from the repository root),
a child then finds the repository's folders under their top-level names: `kernels/` in place of Hugging
Face's `kernels` package, which transformers >= 5.25 imports at its first config import, and `operator/` in
place of the standard library's `operator` before the editable install's `.pth` has loaded it. `-P`
(Python 3.11, the same as PYTHONSAFEPATH=1) leaves that entry out; `python -P script.py` also leaves out the
script's folder, so a script imports what the installed environment has, as a `-m` module does. A process
started with `-P` hands the flag on to its multiprocessing children (`spawn` starts them with the parent's
interpreter flags), so the tensor-parallel ranks are covered by their parent's command.
"""

from __future__ import annotations

import sys


def python_command(*args: str) -> list[str]:
    """`[this interpreter, "-P", *args]`: e.g. `python_command("-m", "specfleet.engine", "--port", "8000")`."""
    return [sys.executable, "-P", *args]
