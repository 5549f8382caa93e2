"""Kernel tests run on CPU tensors through Triton's interpreter.

TRITON_INTERPRET=1 is set here for a kernels-only run; the wrappers in ``specfleet.kernels`` also launch
CPU tensors through the interpreter when triton was imported earlier without it (a full-suite run where
transformers imported triton first), so the result does not depend on test order.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
