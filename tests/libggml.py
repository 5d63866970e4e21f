"""libggml's own block functions, through ctypes on the libggml-base that llama-cpp-python ships (``make
llama-cpp``): ``to_float`` of ``ggml_get_type_traits`` (ggml's ``dequantize_row_*``) and ``ggml_quantize_chunk``
(the quantiser ``llama_model_quantize`` calls per tensor). The struct is ggml.h's ``ggml_type_traits`` of the
vendored llama.cpp."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import numpy as np


class TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


@cache
def library() -> ctypes.CDLL:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def traits(ggml_type: int) -> TypeTraits:
    return library().ggml_get_type_traits(ggml_type).contents


def to_float(raw: bytes, ggml_type: int, n: int) -> np.ndarray:
    """libggml's float32 decoding of ``n`` elements of ``ggml_type`` from ``raw``."""
    t = traits(ggml_type)
    assert len(raw) == n // t.blck_size * t.type_size
    if not t.to_float:  # F32: ggml has no conversion to do (its traits hold none)
        return np.frombuffer(bytes(raw), dtype="<f4").copy()
    src = ctypes.create_string_buffer(bytes(raw), len(raw))
    out = np.empty(n, dtype=np.float32)
    TO_FLOAT(t.to_float)(ctypes.cast(src, ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
    return out


def quantize(values: np.ndarray, ggml_type: int) -> np.ndarray:
    """libggml's quantisation of float32 ``values`` [rows, n_per_row] (no importance matrix): uint8 [rows, bytes]."""
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, values.shape[-1])
    rows, per_row = x.shape
    t = traits(ggml_type)
    row_bytes = per_row // t.blck_size * t.type_size
    out = np.zeros((rows, row_bytes), dtype=np.uint8)
    done = library().ggml_quantize_chunk(ggml_type, x.ctypes.data, out.ctypes.data, 0, rows, per_row, None)
    assert done == out.size
    return out.reshape(*values.shape[:-1], row_bytes)


# ---------------------------------------------------------------------------------------------------------
# the CPU backend's dot products (ggml-cpu.h's ggml_type_traits_cpu): how ggml's CPU matmul multiplies


class TypeTraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@cache
def cpu_library() -> ctypes.CDLL:
    import llama_cpp

    library()  # libggml-base first: the CPU library links against it
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_cpu_init.restype = None
    lib.ggml_cpu_init()  # the fp16 tables the CPU kernels read
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    return lib


def cpu_traits(ggml_type: int) -> TypeTraitsCpu:
    return cpu_library().ggml_get_type_traits_cpu(ggml_type).contents


def from_float_cpu(x: np.ndarray, ggml_type: int) -> bytes:
    """The CPU backend's conversion of float32 ``x`` (one row) to ``ggml_type`` (its ``from_float``: on x86 the
    SIMD quantisers)."""
    row = np.ascontiguousarray(x, dtype=np.float32)
    t = traits(ggml_type)
    out = ctypes.create_string_buffer(row.size // t.blck_size * t.type_size)
    FROM_FLOAT(cpu_traits(ggml_type).from_float)(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                 ctypes.cast(out, ctypes.c_void_p), row.size)
    return out.raw


def from_float_ref(x: np.ndarray, ggml_type: int) -> bytes:
    """libggml-base's reference conversion (``quantize_row_*_ref``, ggml_type_traits' from_float_ref)."""
    row = np.ascontiguousarray(x, dtype=np.float32)
    t = traits(ggml_type)
    out = ctypes.create_string_buffer(row.size // t.blck_size * t.type_size)
    FROM_FLOAT(t.from_float_ref)(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.cast(out, ctypes.c_void_p),
                                 row.size)
    return out.raw


def vec_dot(weight_row: bytes, x: np.ndarray, ggml_type: int) -> float:
    """ggml's CPU dot product of one ``ggml_type`` weight row with float32 activations ``x``, as its matmul takes
    it: ``x`` converted by the vec_dot_type's CPU ``from_float``, then ``vec_dot``."""
    t = cpu_traits(ggml_type)
    act = from_float_cpu(x, t.vec_dot_type) if t.vec_dot_type != 0 else np.ascontiguousarray(x, np.float32).tobytes()
    w = ctypes.create_string_buffer(bytes(weight_row), len(weight_row))
    a = ctypes.create_string_buffer(act, len(act))
    s = ctypes.c_float(0)
    VEC_DOT(t.vec_dot)(int(np.size(x)), ctypes.byref(s), 0, ctypes.cast(w, ctypes.c_void_p), 0,
                       ctypes.cast(a, ctypes.c_void_p), 0, 1)
    return float(s.value)
