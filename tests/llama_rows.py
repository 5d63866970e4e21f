"""llama.cpp's logits for every row of a prompt, from a fresh process (one library per process: the ``lib``
option picks it), for the tests that hold llama.cpp against the oracle."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.protocol import BackendError, Request

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import pickle, sys
from pathlib import Path
from conformance.backends.llama_cpp.engine import LlamaCppEngine
options, model_dir, requests = pickle.loads(Path(sys.argv[1]).read_bytes())
engine = LlamaCppEngine(**options)
engine.open(Path(model_dir))
Path(sys.argv[2]).write_bytes(pickle.dumps([engine.run(r).logits for r in requests]))
"""


def llama_logits(options: dict, model, tmp_path: Path, ids: tuple[int, ...]) -> np.ndarray:
    """llama.cpp's logits for every row of ``ids`` on ``model`` (a checkpoint directory or a GGUF file), float64,
    from a fresh process run with ``LlamaCppEngine(**options)``; the test fails with the child's stderr when it
    does."""
    (tmp_path / "job.pkl").write_bytes(pickle.dumps((options, str(model), [Request(kind="full", tokens=tuple(ids))])))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "job.pkl"), str(tmp_path / "out.pkl")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pickle.loads((tmp_path / "out.pkl").read_bytes())[0].astype(np.float64)


def llama_source() -> Path:
    """The llama.cpp sources the converter runs from; the calling test module is skipped when llama-cpp-python
    is not installed (looked up, not imported: importing it loads a library) or its sources are missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/build-llama-cpp.sh)", allow_module_level=True)
    from conformance.backends.llama_cpp import library

    try:
        return library.resolve_source()
    except BackendError as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"llama.cpp converter sources missing: {exc}", allow_module_level=True)
