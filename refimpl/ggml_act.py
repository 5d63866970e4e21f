"""ggml's CPU activation quantisation, emulated exactly (docs/quantised.md, "ggml's activation quantisation").

ggml's CPU matmul does not multiply a quantised weight row by the float32 activations: it first converts each
activation row to the weight type's ``vec_dot_type`` (Q8_0, Q8_1 or Q8_K; F16 or BF16 for half weights; F32
stays) and takes integer dot products block by block. The values it multiplies are therefore the decoded
activation codes x_hat, not x; given x_hat, the rest is the float64 product with the exactly dequantised weight
(refimpl/ggml_blocks.py) up to float32 accumulation.

Which activation type goes with which weight type is ggml-cpu's ``type_traits_cpu`` (``VEC_DOT_TYPE``). The
quantisers, for a float32 block x (every step in float32, as ggml computes it):

* **Q8_0** (blocks of 32): amax = max|x|, d = amax / 127, codes round(x * id), d stored as fp16 (nearest-even);
  x_hat = code * fp16(d). Three kernel paths: ``x86`` (the AVX / AVX2 / AVX-512 ``quantize_row_q8_0`` and the
  repacked kernels' ``ggml_quantize_mat_q8_0_4x8``): id = 127 / amax, rounded half to even; ``ref``
  (``quantize_row_q8_0_ref``, builds without an architecture-specific version): id = 1 / d, rounded half away
  from zero; ``arm`` (the NEON ``quantize_row_q8_0`` / ``_q8_1`` of ggml-cpu/arch/arm/quants.c and the repacked
  ``ggml_quantize_mat_q8_0_4x4`` / ``_4x8`` of arch/arm/repack.cpp): id = 1 / d, rounded half to even
  (``vcvtnq_s32_f32``); read from the vendored source, not checked against an ARM build. An all-zero block has
  d = 0 and codes 0.
* **Q8_1**: the Q8_0 codes and d of the same path, and s = fp16(d * sum(codes)) with the float32 d. A Q4_1 / Q5_1
  weight block (w = d_w q + m) is multiplied as d_w d sum(q codes) + m s: against the exact product of the
  dequantised weights and x_hat, whose min term is m fp16(d) sum(codes), that adds m e per block, e = s - fp16(d)
  sum(codes) (``min_term_error``; the weights' ``product`` adds it).
* **Q8_K** (blocks of 256, one path: the x86 and ARM builds call the reference): m the signed element of largest |x|
  (the first under strict comparison), iscale = -127 / m, codes min(127, round-half-even(iscale * x)), d = 1 /
  iscale stored as float32 (negative when m > 0: the codes then have the opposite sign to x); x_hat = code * d.
  An all-zero block has d = 0.
* **F16 / BF16**: x rounded to the half type (nearest-even); **F32**: x itself.
"""

from __future__ import annotations

import numpy as np

from .errors import InputError

__all__ = ["CONVENTIONS", "PATHS", "VEC_DOT_TYPE", "activation_values", "convention_gelu", "convention_kv",
           "convention_path", "min_term_error", "quantize_q8_0", "quantize_q8_1", "quantize_q8_k", "round_bf16",
           "round_f16"]

PATHS = ("x86", "ref", "arm")  # the kernel paths of the Q8_0 / Q8_1 quantisers emulated
F16_KV = "/f16-kv"  # a convention's suffix: llama.cpp's fp16 K/V cache, as ggml's CPU path computes with it
GELU_TABLE = "/gelu-table"  # and the stock library's GELU: a table of fp16 values (GGML_GELU_FP16)
# the activation conventions of a forward: "none" (the dequantised weights times the activations as they are:
# MLX, and any float engine) and ggml's CPU rule on one kernel path, with an f32 cache or (F16_KV) an fp16 one,
# with the exact GELU or (GELU_TABLE) the stock library's table
CONVENTIONS = ("none", *(f"ggml-cpu/{path}{kv}{gelu}" for gelu in ("", GELU_TABLE) for kv in ("", F16_KV)
                         for path in PATHS))
# ggml-cpu's type_traits_cpu[weight type].vec_dot_type, for the weight types ggml_blocks decodes
VEC_DOT_TYPE = {"Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0", "MXFP4": "Q8_0",
                "Q4_1": "Q8_1", "Q5_1": "Q8_1",
                "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
                "F16": "F16", "BF16": "BF16", "F32": "F32"}
QK8_0, QK_K = 32, 256
F32 = np.float32


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    """x [..., n] as float32 [..., n / size, size]; InputError when n is not a whole number of blocks."""
    x = np.asarray(x, dtype=F32)
    if x.shape[-1] % size:
        raise InputError(f"an activation row of {x.shape[-1]} values is not a whole number of {size}-value blocks")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: to nearest, ties away from zero."""
    return np.sign(v) * np.floor(np.abs(v) + F32(0.5))


def quantize_q8_0(x: np.ndarray, path: str = "x86") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes int64 [..., n], fp16 d as float64 [..., n / 32], float32 d [..., n / 32]) of ggml's Q8_0 quantiser on
    the kernel ``path``."""
    if path not in PATHS:
        raise InputError(f"unknown ggml kernel path {path!r} (emulated: {', '.join(PATHS)})")
    xb = _blocks(x, QK8_0)  # [..., B, 32] float32
    amax = np.max(np.abs(xb), axis=-1)  # [..., B]
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        if path == "x86":
            inv = np.where(amax > 0, F32(127) / np.where(amax > 0, amax, F32(1)), F32(0)).astype(F32)
        else:  # ref, arm: 1 / d
            inv = np.where(d > 0, F32(1) / np.where(d > 0, d, F32(1)), F32(0)).astype(F32)
    v = (xb * inv[..., None]).astype(F32)
    codes = _round_half_away(v) if path == "ref" else np.rint(v)  # x86, arm: half to even
    codes = codes.astype(np.int64).reshape(np.shape(x))
    return codes, d.astype(np.float16).astype(np.float64), d


def quantize_q8_1(x: np.ndarray, path: str = "x86") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, fp16 d, fp16 s = fp16(d * sum(codes)) as float64) of ggml's Q8_1 quantiser on the kernel ``path``."""
    codes, d16, d32 = quantize_q8_0(x, path)
    sums = codes.reshape(*d32.shape, QK8_0).sum(axis=-1)
    s = (d32 * sums.astype(F32)).astype(F32)
    return codes, d16, s.astype(np.float16).astype(np.float64)


def min_term_error(x: np.ndarray, path: str = "x86") -> np.ndarray:
    """[..., n / 32] float64: per block of float32 activations x [..., n], what ggml's Q4_1 / Q5_1 dot product adds
    to the exact product of the dequantised weights and x_hat per unit of the weight block's minimum m: its min
    term m s uses Q8_1's fp16 s = fp16(d * sum(codes)), the exact product's is m fp16(d) sum(codes), so e = s -
    fp16(d) sum(codes) (exact in float64)."""
    codes, d16, s = quantize_q8_1(x, path)
    return s - d16 * codes.reshape(*d16.shape, QK8_0).sum(axis=-1)


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64 [..., n], float32 d as float64 [..., n / 256]) of ggml's Q8_K quantiser."""
    xb = _blocks(x, QK_K)  # [..., B, 256]
    first = np.argmax(np.abs(xb), axis=-1)  # the first of the largest |x| (strict comparison keeps the first)
    m = np.take_along_axis(xb, first[..., None], axis=-1)[..., 0]  # [..., B], signed
    with np.errstate(divide="ignore"):
        iscale = np.where(m != 0, F32(-127) / np.where(m != 0, m, F32(1)), F32(0)).astype(F32)
    codes = np.minimum(np.rint((xb * iscale[..., None]).astype(F32)), 127).astype(np.int64)
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, F32(1) / np.where(iscale != 0, iscale, F32(1)), F32(0)).astype(F32)
    return codes.reshape(np.shape(x)), d.astype(np.float64)


def round_f16(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to fp16 (nearest-even), as float64."""
    return np.asarray(x, dtype=F32).astype(np.float16).astype(np.float64)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to bf16 (nearest-even, ggml's ``ggml_compute_fp32_to_bf16``; NaN stays NaN), float64."""
    bits = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    rounded = np.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits | 0x400000) >> 16 << 16, rounded)
    return rounded.astype(np.uint32).view(F32).astype(np.float64)


def convention_path(convention: str) -> str | None:
    """The ggml kernel path of an activation convention (None for "none"); InputError, one line, when unknown."""
    if convention not in CONVENTIONS:
        raise InputError(f"unknown activation convention {convention!r} (known: {', '.join(CONVENTIONS)})")
    return None if convention == "none" else convention.removesuffix(GELU_TABLE).removesuffix(F16_KV).split("/")[1]


def convention_kv(convention: str) -> str:
    """The K/V cache of an activation convention: "f16" for the ``/f16-kv`` ones, else "exact"."""
    convention_path(convention)
    return "f16" if convention.removesuffix(GELU_TABLE).endswith(F16_KV) else "exact"


def convention_gelu(convention: str) -> str:
    """The GELU of an activation convention: "table" for the ``/gelu-table`` ones, else "exact"."""
    convention_path(convention)
    return "table" if convention.endswith(GELU_TABLE) else "exact"


def activation_values(x: np.ndarray, weight_type: str, path: str = "x86") -> np.ndarray:
    """The float64 values ggml's CPU dot product multiplies a ``weight_type`` row by, for float32 activations x
    [..., n]: x converted to the weight type's vec_dot_type and decoded (exact in float64). Q4_1 / Q5_1 weights
    add a min term built from Q8_1's s, which these values alone do not give (``min_term_error``)."""
    act = VEC_DOT_TYPE.get(weight_type)
    if act is None:
        raise InputError(f"no emulated activation quantisation for weight type {weight_type!r}")
    if act in ("Q8_0", "Q8_1"):
        codes, d16, _ = quantize_q8_0(x, path)
        return (codes.reshape(*d16.shape, QK8_0) * d16[..., None]).reshape(np.shape(x))
    if act == "Q8_K":
        codes, d = quantize_q8_k(x)
        return (codes.reshape(*d.shape, QK_K) * d[..., None]).reshape(np.shape(x))
    if act == "F16":
        return round_f16(x)
    if act == "BF16":
        return round_bf16(x)
    return np.asarray(x, dtype=F32).astype(np.float64)
