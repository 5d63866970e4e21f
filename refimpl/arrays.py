"""Where the oracle's arrays live: NumPy on the CPU (the default), or CuPy on a CUDA GPU, chosen once per model.

The math is written once, in NumPy (``ops.py``, ``model.py``): NumPy's functions hand a CuPy array to CuPy
(NumPy's ``__array_ufunc__`` / ``__array_function__`` protocols), so the same lines run on the GPU, float64 and
the same formulas per element. Only what makes a new array from nothing (and the crossings between the host
and the device) names the module: a model keeps ``xp`` (``numpy`` or ``cupy``) and ``to_device``, and returns
its logits on the host.

    xp = array_module(device)           # numpy for "cpu"; cupy for "cuda" (imported only then)

A model not given a device takes REFIMPL_DEVICE's (cpu without it): ``conformance generate|check|explain
--device cuda`` sets it, so every oracle the command builds runs there.

Without a GPU, ``array_module("cuda")`` is one line (InputError, exit 2 from the command lines): CuPy not
installed (and which extra installs it), no CUDA device visible.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType

import numpy as np

from .errors import InputError, check_choice

__all__ = ["DEVICES", "DEVICE_ENV", "array_module", "gpus", "is_host", "memory_errors", "resolve_device", "take_rows",
           "to_host"]

DEVICES = ("cpu", "cuda")
DEVICE_ENV = "REFIMPL_DEVICE"  # the device of a model not given one (default cpu)
INSTALL = ("install CuPy for the machine's CUDA major version: pip install 'gemma4-conformance[cuda12]' or "
           "'gemma4-conformance[cuda13]' (docs/refimpl.md, 'GPU')")


def resolve_device(device: str | None = None) -> str:
    """``device`` when it is one of DEVICES; None reads REFIMPL_DEVICE (cpu without it); InputError (one line,
    naming the variable when it came from there) otherwise."""
    if device is not None:
        return check_choice("device", device, DEVICES)
    return check_choice(DEVICE_ENV, os.environ.get(DEVICE_ENV) or "cpu", DEVICES)


def array_module(device: str) -> ModuleType:
    """numpy for "cpu"; cupy for "cuda", checked: InputError naming what is missing (CuPy, a CUDA device)."""
    if resolve_device(device) == "cpu":
        return np
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        raise InputError(f"device cuda: CuPy is not installed ({exc}); {INSTALL}") from None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - whatever the CUDA runtime raises: no usable device
        raise InputError(f"device cuda: CuPy {cupy.__version__} finds no CUDA device ({type(exc).__name__}: "
                         f"{exc}); run on a machine with an NVIDIA GPU and its driver, or use device cpu") from None
    if count < 1:
        raise InputError(f"device cuda: CuPy {cupy.__version__} sees no CUDA device (getDeviceCount() is 0); run "
                         "on a machine with an NVIDIA GPU and its driver, or use device cpu")
    return cupy


def gpus() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them (each a worker's
    CUDA_VISIBLE_DEVICES: ``conformance generate --device cuda`` runs one worker on each); CuPy checked first
    (``array_module``)."""
    count = int(array_module("cuda").cuda.runtime.getDeviceCount())
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[:count] if visible else [str(i) for i in range(count)]


def is_host(a) -> bool:
    """Whether ``a`` is a NumPy array or scalar (not a device array)."""
    return isinstance(a, (np.ndarray, np.generic))


def to_host(a):
    """``a`` as a NumPy array: itself on the host, copied back from the device otherwise (``.get()``)."""
    return a if is_host(a) or not hasattr(a, "get") else a.get()


def take_rows(a, index):
    """``a[index]`` for a host ``index`` (integers or a bool mask along the first axis), ``a`` on the host or a
    device: a device array is indexed with the index copied to its device."""
    if is_host(a):
        return a[index]
    return a[sys.modules[type(a).__module__.split(".")[0]].asarray(index)]


def memory_errors(method):
    """A model method whose GPU running out of memory is one line (InputError) naming what was asked and what is
    free, and how to ask for less, not CuPy's traceback. On the CPU the method runs as it is."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.xp is np:
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except self.xp.cuda.memory.OutOfMemoryError as exc:
            free, total = self.xp.cuda.runtime.memGetInfo()
            raise InputError(f"device cuda: out of GPU memory ({exc}; {free / 2**30:.1f} of {total / 2**30:.1f} GiB "
                             f"free): keep fewer weights there (a smaller weight cache, REFIMPL_WEIGHT_CACHE; the "
                             f"cache now holds {self.weights.cache_bytes / 2**30:.1f} GiB), ask for fewer rows or "
                             "tokens at once, or use device cpu") from None
    return run
