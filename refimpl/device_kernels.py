"""The row-wise steps of ``ops.py`` as fused CUDA kernels, for the oracle's CuPy arrays (issue 53).

On a GPU the oracle's time between its matrix products goes to launching kernels: ``ops.rms_norm`` is seven
of them (square, mean, add, sqrt, divide, scale), ``ops.gelu_tanh`` nine, ``ops.norm_rope`` fifteen, each a
pass over memory and a launch from Python that the GPU waits on. Here each such step is one or two kernels
that evaluate the same formula, operation by operation in the same order, each result rounded to float64 as
the separate kernels round it: compiled with ``--fmad=false`` (no product and sum contracted into one fused
multiply-add, which rounds once where the formula rounds twice) and with CUDA's own ``sqrt``, ``tanh`` and
IEEE division, which the separate CuPy kernels call too. The one difference from the composition is the
order of a reduction's sum (the mean of squares), which CuPy's own kernels do not fix either: the result
is within float64 rounding of ``ops`` on NumPy, as the composition is (``tests/oracle/test_cupy.py``).

``schedule.py`` runs these for float64 CuPy arrays and ``ops.py``'s definitions for everything else (NumPy
arrays, other dtypes, the tests' stand-in device): each function here returns None where it does not apply.
CuPy is never imported here: the array's own module builds the kernels, once per process.
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np

__all__ = ["geglu", "gelu_tanh", "norm_rope", "rms_norm"]

FLAGS = ("--fmad=false",)  # every product and sum rounded on its own, as the separate kernels round it

# gelu_tanh's steps (ops.gelu_tanh): t = x x; t x; * 0.044715; + x; * sqrt(2/pi); tanh; + 1; * x; * 0.5
_GELU = ("T t = x * x; t = t * x; t = t * a; t = t + x; t = t * c; t = tanh(t); t = t + (T)1; t = t * x; "
         "t = t * (T)0.5;")

_GELU_ARGS = (np.float64(0.044715), np.float64(math.sqrt(2.0 / math.pi)))  # a and c above, as ops.gelu_tanh's

# ops.rms_norm's steps after the sum of squares ss of a row of n: ss / n (the mean); + eps; sqrt; x / that
_RMS = "T r = ss / n; r = r + eps; r = sqrt(r);"

# ops.norm_rope on x [R, D] (R = T heads rows, row t h): the two elements of a rotate-half pair (j, j + D/2)
# normed, then out_j = a cos - b sin, out_{j + D/2} = b cos + a sin (ops.apply_rope)
_NORM_ROPE = """
long long d = i % D, row = i / D, half = D / 2, t = row / heads;
long long j = d < half ? d : d - half;
T r = ss[row] / n; r = r + eps; r = sqrt(r);
T a = x[row * D + j] / r; a = a * w[j];
T b = x[row * D + j + half] / r; b = b * w[j + half];
T c = cs[t * half + j], s = sn[t * half + j];
if (d < half) { T p = a * c; T q = b * s; y = p - q; } else { T p = b * c; T q = a * s; y = p + q; }
"""


def _cupy(*arrays):
    """CuPy, when every array given is a float64 CuPy array (None skipped); else None."""
    cp = sys.modules.get("cupy")
    if cp is None or not hasattr(cp, "ElementwiseKernel"):  # (tests/strict_device.py's stand-in compiles nothing)
        return None
    for a in arrays:
        if a is not None and (not isinstance(a, cp.ndarray) or a.dtype != cp.float64):
            return None
    return cp


@functools.cache
def _kernels(cp) -> dict:
    """The kernels, built (and compiled on first launch) once for the CuPy module ``cp``."""
    ew, red = cp.ElementwiseKernel, cp.ReductionKernel
    return {
        "sumsq": red("T x", "T y", "x * x", "a + b", "y = a", "0", "refimpl_sumsq", options=FLAGS),
        "rms": ew("T x, T ss, T n, T eps", "T y", _RMS + " y = x / r;", "refimpl_rms", options=FLAGS),
        "rms_w": ew("T x, T ss, T w, T n, T eps", "T y", _RMS + " y = x / r; y = y * w;", "refimpl_rms_w",
                    options=FLAGS),
        "gelu": ew("T x, T a, T c", "T y", _GELU + " y = t;", "refimpl_gelu", options=FLAGS),
        "geglu": ew("T x, T u, T a, T c", "T y", _GELU + " y = t * u;", "refimpl_geglu", options=FLAGS),
        "norm_rope": ew("raw T x, raw T ss, raw T w, raw T cs, raw T sn, int64 D, int64 heads, T n, T eps", "T y",
                        _NORM_ROPE, "refimpl_norm_rope", options=FLAGS),
    }


def rms_norm(x, weight, eps: float):
    """``ops.rms_norm`` (x [..., D] -> x / sqrt(mean(x^2) + eps) * weight) in two kernels; None where not CuPy."""
    cp = _cupy(x, weight)
    if cp is None or x.ndim < 1 or x.shape[-1] == 0:
        return None
    k = _kernels(cp)
    ss = k["sumsq"](x, axis=-1, keepdims=True)  # [..., 1]
    n, eps = np.float64(x.shape[-1]), np.float64(eps)  # (typed scalars: T is float64 throughout)
    return k["rms"](x, ss, n, eps) if weight is None else k["rms_w"](x, ss, weight, n, eps)


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
    """``ops.norm_rope`` (x [T, heads, D]; cos, sin [T, D/2]; weight [D]) in two kernels; None where not CuPy or
    the shapes are others."""
    cp = _cupy(x, cos, sin, weight)
    if cp is None or x.ndim != 3 or weight is None:
        return None
    T, heads, D = x.shape
    if D % 2 or cos.shape != (T, D // 2) or sin.shape != (T, D // 2) or weight.shape != (D,):
        return None
    k = _kernels(cp)
    x = cp.ascontiguousarray(x)
    ss = k["sumsq"](x, axis=-1)  # [T, heads]
    y = cp.empty_like(x)  # (the output sets the kernel's size: every input is raw)
    k["norm_rope"](x, ss, cp.ascontiguousarray(weight), cp.ascontiguousarray(cos), cp.ascontiguousarray(sin),
                   np.int64(D), np.int64(heads), np.float64(D), np.float64(eps), y)
    return y
