"""The oracle's schedule: how ``ops.py``'s steps run on a large input, in blocks of rows over the thread pool.

``ops.py`` defines every step once, plainly, in one call on the whole input; this module takes those very
functions and only decides how they are run (llama.cpp's split between a graph's ops and its scheduler;
ONNX keeps its reference ops plain and makes optimisation opt-in). The model modules (``model.py``,
``vision.py``, ``audio.py``, ``unified.py``, ``assistant.py``) import the scheduled steps from here and the
rest of the math from ``ops.py``.

* **Row-wise steps** (``rms_norm``, ``layer_norm``, ``gelu_tanh``, ``softmax``, ``softcap``, ``geglu``,
  ``apply_rope``, ``norm_rope``, ``apply_rope_2d``): the rows are independent, so with two threads or more a
  large input is cut into blocks of rows and each thread runs the unchanged step on its blocks
  (``threads.rowwise``). Every element goes through the same NumPy calls in the same order as in one call:
  the result is the plain step's, to the last bit (tests still bound it by two units of rounding).
  ``.whole`` is the plain step.
* **Attention** (``attention``): the query rows are taken in blocks of ``ATTENTION_BLOCK`` scores (fixed by
  the shapes, whatever the thread count), and a block attends only over the span of keys its rows can see
  (``key_span``: causal and sliding masks leave the rest to other blocks); with several threads the blocks
  are split between them in ``balanced_order``, each on its thread's own BLAS. A block's keys outside its
  span have probability 0 either way, so the result is the plain ``ops.attention``'s up to rounding: its
  products and sums run over other lengths (BLAS blocks by shape; a sum of S probabilities with zeros
  among them associates differently), which moves each output by at most a few units of rounding of the
  values it averages (``tests/oracle/test_schedule.py`` states and checks the bound).
* ``mlp``: ``ops.mlp`` with the scheduled ``geglu``.
* **On a GPU** (float64 CuPy arrays) ``rms_norm``, ``gelu_tanh``, ``geglu``, ``norm_rope`` and attention's
  ``masked_softmax`` run as ``device_kernels``' fused kernels: the same operations in the same order, one launch
  where the composition makes up to fifteen (a launch from Python costs more than the pass it starts at these
  sizes); the rest run as defined, one call each, the device scheduling it.

Shapes as in ``ops.py``: T queries, S keys, N query heads, K KV heads, D head dim.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np

from . import device_kernels, ops
from .threads import in_parts, rowwise

__all__ = ["ATTENTION_BLOCK", "apply_rope", "apply_rope_2d", "attention", "balanced_order", "geglu", "gelu_tanh",
           "key_span", "layer_norm", "mlp", "norm_rope", "rms_norm", "softcap", "softmax"]

# ----------------------------------------------------------------------------------------------
# row-wise steps: the plain step on blocks of rows


def fused(kernel: Callable[..., Any]) -> Callable[[Callable[..., np.ndarray]], Callable[..., np.ndarray]]:
    """Decorator: on a device array, the step as ``device_kernels``' fused kernel where that applies (float64
    CuPy; it returns None elsewhere), else the step as it is."""

    def wrap(step: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        first = next(iter(inspect.signature(step).parameters))

        @functools.wraps(step)
        def run(*args, **kwargs):
            if not isinstance(args[0] if args else kwargs.get(first), np.ndarray):
                y = kernel(*args, **kwargs)
                if y is not None:
                    return y
            return step(*args, **kwargs)
        return run
    return wrap


rms_norm = fused(device_kernels.rms_norm)(rowwise(flat=True)(ops.rms_norm))
layer_norm = rowwise(flat=True)(ops.layer_norm)
gelu_tanh = fused(device_kernels.gelu_tanh)(rowwise(flat=True)(ops.gelu_tanh))
softmax = rowwise(flat=True)(ops.softmax)
softcap = rowwise(flat=True)(ops.softcap)
geglu = fused(device_kernels.geglu)(rowwise(aligned=2)(ops.geglu))
masked_softmax = fused(device_kernels.masked_softmax)(ops.masked_softmax)  # (attention's, on a device)
apply_rope = rowwise(aligned=3)(ops.apply_rope)
norm_rope = fused(device_kernels.norm_rope)(rowwise(aligned=3)(ops.norm_rope))
apply_rope_2d = rowwise(aligned=5)(ops.apply_rope_2d)


def mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """``ops.mlp`` (GeGLU; x [T, H] -> [T, H]) with its gated activation on blocks of rows."""
    return ops.linear(geglu(ops.linear(x, gate), ops.linear(x, up)), down)


# ----------------------------------------------------------------------------------------------
# attention: blocks of query rows over the span of keys they see

ATTENTION_BLOCK = 1 << 17  # scores per block of query rows of ``attention`` (1 MiB of float64)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, half: bool = False) -> np.ndarray:
    """``ops.attention`` (q [T, N, D], k/v [S, K, D], mask [T, S] -> [T, N, D]) on blocks of query rows of
    about ATTENTION_BLOCK scores, each over its span of keys (``key_span``); with several threads the blocks
    are split between them in the order ``balanced_order`` gives (a causal block's work grows with its row:
    in row order the last thread would get the most of it), each block's product on its thread's own BLAS."""
    if not isinstance(q, np.ndarray):  # a device array (CuPy): one call, the device schedules it
        return ops.attention(q, k, v, mask, half=half, masked_softmax=masked_softmax)
    T, N, _ = q.shape
    unit = max(1, ATTENTION_BLOCK // max(1, N * k.shape[0]))  # query rows whose scores [N, S] fill a block
    out = np.empty(q.shape, dtype=np.result_type(q, k, v))
    order = balanced_order(-(-T // unit))

    def blocks(first: int, last: int) -> None:  # the blocks order[first:last]
        for j in order[first:last]:
            a, b = j * unit, min(j * unit + unit, T)
            lo, hi = key_span(mask[a:b])
            args = (q[a:b], k[lo:hi], v[lo:hi], mask[a:b, lo:hi])
            out[a:b] = ops.attention(*args, half=True) if half else ops.attention(*args)

    in_parts(len(order), blocks, own_blas=True)
    return out


def balanced_order(n: int) -> list[int]:
    """0, n-1, 1, n-2, 2, ...: for blocks whose work grows (or shrinks) steadily with their index, each pair
    order[2i], order[2i+1] holds about the same work, so the parts ``in_parts`` cuts of whole pairs are
    balanced (with one block per thread there is nothing to balance)."""
    return [j // 2 if j % 2 == 0 else n - 1 - j // 2 for j in range(n)]


def key_span(mask: np.ndarray) -> tuple[int, int]:
    """[lo, hi): from the first key any of the rows of ``mask`` [T, S] sees to one past the last (all the
    keys when none is seen: the rows' results are then NaN either way)."""
    seen = np.flatnonzero(mask.any(axis=0))
    return (int(seen[0]), int(seen[-1]) + 1) if seen.size else (0, mask.shape[1])
