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
