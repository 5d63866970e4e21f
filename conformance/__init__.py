"""Conformance harness for Gemma 4 inference engines: ``conformance check --backend X``.

Drives a backend through the paths an optimised engine takes during prefill and decode (full
forward, the three last-logits entry points at last and interior rows, output-row prefill with
micro-batches, chunked and multi-sequence prefill, decode) and grades every returned logits row
against golden float64 rows from the ``refimpl`` oracle. See docs/conformance.md.
"""

import os as _os

_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # before NumPy loads OpenBLAS: see refimpl/__init__.py


__version__ = "0.1.0"

from . import compat as _compat  # after the environment above

_compat.install()  # old import paths: the new module, with a DeprecationWarning
