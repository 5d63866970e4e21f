"""The row-wise steps of ``ops.py`` as fused CUDA kernels, for the oracle's CuPy arrays (issue 53).

On a GPU the oracle's time between its matrix products goes to launching kernels from Python: ``ops.rms_norm``
is seven of them (square, mean, add, sqrt, divide, scale), ``ops.gelu_tanh`` nine, ``ops.norm_rope`` fifteen,
each a launch the GPU waits for at these sizes. Here each such step is one kernel that evaluates the same
formula, operation by operation in the same order, each result rounded to float64 as the separate kernels round
it: compiled with ``--fmad=false`` (no product and sum contracted into one fused multiply-add, which rounds once
where the formula rounds twice) and with CUDA's own ``sqrt``, ``tanh`` and IEEE division, which CuPy's kernels
call too. The one difference from the composition is the order of the sum of a row's squares (a block of
threads a row, then a tree), which CuPy's own reduction does not fix either: the norms are within float64
rounding of ``ops`` on NumPy and on CuPy, and the GELUs equal to CuPy's composition
(``tests/oracle/test_cupy.py``).

``schedule.py`` runs these for float64 CuPy arrays and ``ops.py``'s definitions for everything else (NumPy
arrays, other dtypes, the tests' stand-in device): each function here returns None where it does not apply.
CuPy is never imported here: the array's own module builds the kernels, once per process.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from typing import Iterator

import numpy as np

__all__ = ["geglu", "gelu_tanh", "masked_softmax", "norm_rope", "rms_norm", "switched"]

FLAGS = ("--fmad=false",)  # every product and sum rounded on its own, as the separate kernels round it

# gelu_tanh's steps (ops.gelu_tanh): t = x x; t x; * 0.044715; + x; * sqrt(2/pi); tanh; + 1; * x; * 0.5
_GELU = ("T t = x * x; t = t * x; t = t * a; t = t + x; t = t * c; t = tanh(t); t = t + (T)1; t = t * x; "
         "t = t * (T)0.5;")

_GELU_ARGS = (np.float64(0.044715), np.float64(math.sqrt(2.0 / math.pi)))  # a and c above, as ops.gelu_tanh's

# ops.rms_norm and ops.norm_rope on rows of D values, one block of BLOCK threads a row: the sum of the row's squares
# (each thread's strided share, then a tree over the block's shared memory), the mean sum / D, + eps, sqrt, then
# each value x / that, * w; norm_rope then rotates the pairs (j, j + D/2) of the normed row of query or key head
# t h (rows = T heads): out_j = a cos - b sin, out_{j + D/2} = b cos + a sin (ops.apply_rope)
BLOCK = 256
ROW_KERNELS = r"""
#define BLOCK 256
#define NEG_INF __longlong_as_double(0xfff0000000000000ULL)  /* -inf (NVRTC has no math.h: no INFINITY) */
__device__ double row_rms(const double* xr, long long D, double eps) {
    __shared__ double part[BLOCK];
    double acc = 0.0;
    for (long long j = threadIdx.x; j < D; j += BLOCK) { double v = xr[j] * xr[j]; acc = acc + v; }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] = part[threadIdx.x] + part[threadIdx.x + s];
        __syncthreads();
    }
    double r = part[0] / (double)D;
    r = r + eps;
    return sqrt(r);
}

extern "C" __global__ void refimpl_rms_norm(const double* x, const double* w, double* y, long long D, double eps,
                                            int has_w) {
    const double* xr = x + (long long)blockIdx.x * D;
    double* yr = y + (long long)blockIdx.x * D;
    double r = row_rms(xr, D, eps);
    for (long long j = threadIdx.x; j < D; j += BLOCK) {
        double v = xr[j] / r;
        if (has_w) v = v * w[j];
        yr[j] = v;
    }
}

extern "C" __global__ void refimpl_norm_rope(const double* x, const double* w, const double* cs, const double* sn,
                                             double* y, long long D, long long heads, double eps) {
    long long row = blockIdx.x, t = row / heads, half = D / 2;
    const double* xr = x + row * D;
    double* yr = y + row * D;
    double r = row_rms(xr, D, eps);
    for (long long j = threadIdx.x; j < half; j += BLOCK) {
        double a = xr[j] / r; a = a * w[j];
        double b = xr[j + half] / r; b = b * w[j + half];
        double c = cs[t * half + j], s = sn[t * half + j];
        double p = a * c, q = b * s;
        yr[j] = p - q;
        p = b * c; q = a * s;
        yr[j + half] = p + q;
    }
}

__device__ double max_nan(double a, double b) { return isnan(a) ? a : (isnan(b) || b > a) ? b : a; }

extern "C" __global__ void refimpl_masked_softmax(double* x, const bool* mask, long long S, long long T,
                                                  long long G) {
    // ops.masked_softmax of scores x [K, T, G, S] (row (k T + t) G + g) under mask [T, S], in place: masked
    // scores -inf, m = max (NaN if any is), e = exp(x - m), e / sum(e)
    __shared__ double part[BLOCK];
    long long r = blockIdx.x, t = (r / G) % T;
    double* xr = x + r * S;
    const bool* mr = mask + t * S;
    double m = NEG_INF;
    for (long long j = threadIdx.x; j < S; j += BLOCK) m = max_nan(m, mr[j] ? xr[j] : NEG_INF);
    part[threadIdx.x] = m;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] = max_nan(part[threadIdx.x], part[threadIdx.x + s]);
        __syncthreads();
    }
    m = part[0];
    __syncthreads();
    double acc = 0.0;
    for (long long j = threadIdx.x; j < S; j += BLOCK) {
        double e = mr[j] ? xr[j] : NEG_INF;
        e = e - m;
        e = exp(e);
        xr[j] = e;
        acc = acc + e;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] = part[threadIdx.x] + part[threadIdx.x + s];
        __syncthreads();
    }
    double total = part[0];
    for (long long j = threadIdx.x; j < S; j += BLOCK) xr[j] = xr[j] / total;
}
"""


_STATE = {"on": True}  # (``switched``)


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """The fused kernels on or off inside the block (off: the schedule runs ``ops.py``'s compositions on the
    device too): benchmarks/fused_kernels.py's side-by-side timing."""
    before, _STATE["on"] = _STATE["on"], on
    try:
        yield
    finally:
        _STATE["on"] = before


def _cupy(*arrays):
    """CuPy, when every array given is a float64 CuPy array (None skipped) and the kernels are on; else None."""
    cp = sys.modules.get("cupy")
    if cp is None or not _STATE["on"] or not hasattr(cp, "ElementwiseKernel"):  # (the stand-in compiles nothing)
        return None
    for a in arrays:
        if a is not None and (not isinstance(a, cp.ndarray) or a.dtype != cp.float64):
            return None
    return cp


@functools.cache
def _kernels(cp) -> dict:
    """The kernels, built (and compiled on first launch) once for the CuPy module ``cp``."""
    ew = cp.ElementwiseKernel
    rows = cp.RawModule(code=ROW_KERNELS, options=FLAGS)
    return {
        "rms_norm": rows.get_function("refimpl_rms_norm"), "norm_rope": rows.get_function("refimpl_norm_rope"),
        "masked_softmax": rows.get_function("refimpl_masked_softmax"),
        "gelu": ew("T x, T a, T c", "T y", _GELU + " y = t;", "refimpl_gelu", options=FLAGS),
        "geglu": ew("T x, T u, T a, T c", "T y", _GELU + " y = t * u;", "refimpl_geglu", options=FLAGS),
    }


def rms_norm(x, weight, eps: float):
    """``ops.rms_norm`` (x [..., D] -> x / sqrt(mean(x^2) + eps) * weight) in one kernel; None where not CuPy."""
    cp = _cupy(x, weight)
    if cp is None or x.ndim < 1 or x.size == 0 or (weight is not None and weight.shape != x.shape[-1:]):
        return None
    x = cp.ascontiguousarray(x)
    y = cp.empty_like(x)
    D = x.shape[-1]
    w = x if weight is None else cp.ascontiguousarray(weight)  # (not read without a weight)
    _kernels(cp)["rms_norm"]((x.size // D,), (BLOCK,), (x, w, y, np.int64(D), np.float64(eps),
                                                         np.int32(weight is not None)))
    return y


def gelu_tanh(x):
    """``ops.gelu_tanh`` in one kernel; None where not CuPy."""
    cp = _cupy(x)
    return None if cp is None else _kernels(cp)["gelu"](x, *_GELU_ARGS)


def geglu(gate, up):
    """``ops.geglu`` (gelu_tanh(gate) * up) in one kernel; None where not CuPy or the shapes differ."""
    cp = _cupy(gate, up)
    if cp is None or gate.shape != up.shape:
        return None
    return _kernels(cp)["geglu"](gate, up, *_GELU_ARGS)


def norm_rope(x, cos, sin, weight, eps: float):
    """``ops.norm_rope`` (x [T, heads, D]; cos, sin [T, D/2]; weight [D]) in one kernel; None where not CuPy or
    the shapes are others."""
    cp = _cupy(x, cos, sin, weight)
    if cp is None or x.ndim != 3 or weight is None or x.size == 0:
        return None
    T, heads, D = x.shape
    if D % 2 or cos.shape != (T, D // 2) or sin.shape != (T, D // 2) or weight.shape != (D,):
        return None
    x = cp.ascontiguousarray(x)
    y = cp.empty_like(x)
    _kernels(cp)["norm_rope"]((T * heads,), (BLOCK,), (x, cp.ascontiguousarray(weight), cp.ascontiguousarray(cos),
                                                       cp.ascontiguousarray(sin), y, np.int64(D), np.int64(heads),
                                                       np.float64(eps)))
    return y


def masked_softmax(scores, mask):
    """``ops.masked_softmax`` of attention's scores [K, T, G, S] under its mask [1, T, 1, S] (``ops.attention``'s
    broadcast of [T, S]) in one kernel, in scores' buffer; None where not CuPy or the shapes are others."""
    cp = _cupy(scores)
    if cp is None or scores.ndim != 4 or scores.size == 0 or not scores.flags.c_contiguous:
        return None
    K, T, G, S = scores.shape
    if not isinstance(mask, cp.ndarray) or mask.dtype != cp.bool_ or mask.shape != (1, T, 1, S):
        return None
    _kernels(cp)["masked_softmax"]((K * T * G,), (BLOCK,), (scores, cp.ascontiguousarray(mask[0, :, 0, :]),
                                                            np.int64(S), np.int64(T), np.int64(G)))
    return scores
