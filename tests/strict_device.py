"""A strict stand-in for CuPy on a machine without a GPU: the device's rules, NumPy's arithmetic.

CI has no GPU, so the CUDA path of the oracle (``Gemma4(dir, device="cuda")``) would rot unseen where it
crosses between the host and the device. ``install(monkeypatch)`` puts this module in ``sys.modules["cupy"]``:
its arrays (``DeviceArray``, wrapping a NumPy array) compute with NumPy, so the values are NumPy's, and they
follow CuPy's rules on crossings, stricter where CuPy is lenient:

- no implicit conversion to NumPy (``np.asarray(device_array)`` raises TypeError, as CuPy does); ``.get()`` or
  ``cupy.asnumpy`` copy back;
- no host array (of one value or more) as an operand of a device ufunc or NumPy function, nor as an index
  (CuPy refuses most of these; the oracle must copy with ``xp.asarray`` first);
- NumPy functions given only host arrays stay on the host (a forgotten ``xp`` shows up as a host operand later).

Where the code under test passes here, its crossings are explicit, which is what the GPU needs; the GPU run
(tests/oracle/test_cupy.py) checks CuPy's own kernels.
"""

from __future__ import annotations

import sys
import types

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array "
            "explicitly.")


def _host_operand(value) -> bool:
    return isinstance(value, np.ndarray)


def _unwrap(value, what: str):
    """DeviceArray -> its NumPy array (recursing into lists, tuples and dicts); a host array -> TypeError."""
    if isinstance(value, DeviceArray):
        return value.a
    if _host_operand(value):
        raise TypeError(f"a host numpy.ndarray {list(value.shape)} given to the device's {what}: copy it with "
                        "cupy.asarray first")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, what) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v, what) for k, v in value.items()}
    return value


def _wrap(value):
    if isinstance(value, np.ndarray):
        return DeviceArray(value)
    if isinstance(value, np.generic):  # CuPy's reductions return 0-d arrays, not scalars
        return DeviceArray(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


class DeviceArray(NDArrayOperatorsMixin):
    """An array "on the device": NumPy's values, CuPy's crossings."""

    __slots__ = ("a",)

    def __init__(self, a: np.ndarray):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = _unwrap(inputs, f"ufunc {ufunc.__name__}")
        kwargs = _unwrap(kwargs, f"ufunc {ufunc.__name__}")
        return _wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func, types_, args, kwargs):
        return _wrap(func(*_unwrap(args, func.__name__), **_unwrap(kwargs, func.__name__)))

    # -- what CuPy's ndarray has -------------------------------------------------------------------
    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)
    nbytes = property(lambda self: self.a.nbytes)
    itemsize = property(lambda self: self.a.itemsize)
    strides = property(lambda self: self.a.strides)
    flags = property(lambda self: self.a.flags)
    T = property(lambda self: DeviceArray(self.a.T))
    real = property(lambda self: DeviceArray(self.a.real))

    def get(self) -> np.ndarray:
        return self.a.copy()

    def __getitem__(self, index):
        return _wrap(self.a[_unwrap(index, "indexing")])

    def __setitem__(self, index, value):
        self.a[_unwrap(index, "indexing")] = _unwrap(value, "assignment")

    def __len__(self) -> int:
        return len(self.a)

    def __iter__(self):
        return (_wrap(v) for v in self.a)

    def __bool__(self) -> bool:
        return bool(self.a)

    def __float__(self) -> float:
        return float(self.a)

    def __int__(self) -> int:
        return int(self.a)

    def __index__(self) -> int:
        return self.a.__index__()

    def __repr__(self) -> str:
        return f"strict_device.DeviceArray({self.a!r})"

    def item(self):
        return self.a.item()

    def tolist(self):
        return self.a.tolist()

    def __getattr__(self, name):  # methods (reshape, astype, view, sum, max, ...): NumPy's, results on the device
        method = getattr(self.a, name)
        if not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: _wrap(method(*_unwrap(args, name), **_unwrap(kwargs, name)))


DeviceArray.__module__ = "cupy"  # (refimpl.arrays.take_rows finds an array's module by its type)


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError."""


CAPACITY = {"bytes": float("inf")}  # the largest copy to the device (``install(capacity=...)``)


def asarray(a, dtype=None, order=None):
    """To the device: a copy of a host array (or a DeviceArray itself, converted to ``dtype`` if given); a copy
    larger than the device's capacity is CuPy's OutOfMemoryError."""
    if isinstance(a, DeviceArray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else DeviceArray(a.a.astype(dtype))
    copy = np.array(a, dtype=dtype, order=order or "K")
    if copy.nbytes > CAPACITY["bytes"]:
        raise OutOfMemoryError(f"Out of memory allocating {copy.nbytes:,} bytes (allocated so far: 0 bytes).")
    return DeviceArray(copy)


def asnumpy(a):
    return a.get() if isinstance(a, DeviceArray) else np.asarray(a)


def _creation(name: str):
    fn = getattr(np, name)

    def make(*args, **kwargs):
        return _wrap(fn(*_unwrap(args, name), **_unwrap(kwargs, name)))
    return make


def module() -> types.ModuleType:
    """A fresh ``cupy`` stand-in: asarray, asnumpy, ndarray, NumPy's dtypes and functions (results on the device),
    and cuda.runtime with one device."""
    m = types.ModuleType("cupy")
    m.__version__ = "strict-device"
    m.ndarray, m.asarray, m.array, m.asnumpy = DeviceArray, asarray, asarray, asnumpy
    for name in dir(np):
        value = getattr(np, name)
        if name.startswith("_") or hasattr(m, name):
            continue
        if isinstance(value, (type, np.dtype)) or not callable(value):
            setattr(m, name, value)  # dtypes, constants
        elif isinstance(value, np.ufunc) or callable(value):
            setattr(m, name, _creation(name))
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, CUDARuntimeError=RuntimeError,
                                    memGetInfo=lambda: (0, 80 * 2**30))
    m.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None),
                                   memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError))
    return m


def install(monkeypatch, capacity: float = float("inf")) -> types.ModuleType:
    """``sys.modules["cupy"]`` = a fresh stand-in for the test's duration; ``capacity``: the largest copy to the
    device, in bytes, before it runs out of memory."""
    m = module()
    monkeypatch.setitem(sys.modules, "cupy", m)
    monkeypatch.setitem(CAPACITY, "bytes", capacity)
    return m


def model_outputs(model, ids) -> list:
    """What the device tests compare: a prefill of every row but the last three, those three as decode steps
    through the KV cache, and rows 3 and -1 of a pruned forward (logits and final-normed states)."""
    from refimpl.kv_cache import KVCache

    cache = KVCache()
    prefill = model.forward(ids[:-3], rows="all", cache=cache)
    steps = [model.forward(ids[i:i + 1], rows="last", cache=cache) for i in range(len(ids) - 3, len(ids))]
    logits, hidden = model.forward_rows(ids, rows=[3, -1])
    return [prefill, *steps, logits, hidden]


def assert_device_is_host(cpu, gpu) -> None:
    """``model_outputs`` of a model on the device (``gpu``) against the same model on the host: NumPy arrays of
    the same shapes and dtypes, within the rounding two float64 evaluations of the same logits may differ by
    (conformance.sets.bounds.logit_bound; it covers an fp16 K/V rounding a unit apart too)."""
    from conformance.sets.bounds import logit_bound

    ids = list(np.random.default_rng(5).integers(3, cpu.cfg.vocab_size, 23))
    want, got = model_outputs(cpu, ids), model_outputs(gpu, ids)
    bound = logit_bound(cpu.cfg, len(ids), max(float(np.max(np.abs(w))) for w in want))
    for w, g in zip(want, got, strict=True):
        assert type(g) is np.ndarray and g.dtype == w.dtype and g.shape == w.shape
        assert float(np.max(np.abs(g - w))) <= bound, (float(np.max(np.abs(g - w))), bound)
