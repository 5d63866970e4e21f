"""Traces (capability ``traces``) on llama.cpp: the points of ``conformance.protocol.trace`` read off Gemma 4's graph
(``src/models/gemma4.cpp``) while it runs, through the graph evaluation callback (``llama_context_params.cb_eval``,
a ``ggml_backend_sched_eval_callback``; only a context made for a request with ``trace`` has one).

For every node of each micro-batch's graph the scheduler asks the callback (``ask=true``) whether it wants the
node's data; for a node named below it answers yes, the scheduler computes the graph up to that node and calls
again (``ask=false``), and the data is copied. Computing the graph in those pieces changes no arithmetic on the
CPU backend: the fused RMSNorm x weight pair stays in one piece (the callback asks for the product, not the norm).

The tensor names (``cb(cur, name, il)`` in the graph, ``-{il}`` for a layer) and the point each is, exactly:

``inp_scaled``              ``embed``: E[id] * sqrt(H) for token input, the given row for ``batch.embd`` input
``attn_post_norm-{i}``      ``layers.{i}.attn_out``: post_attention_layernorm(o_proj(attention))
``ffn_post_norm-{i}``       ``layers.{i}.ffn_out``: post_feedforward_layernorm of the MLP's output, on MoE layers
                            of ffn_post_norm_1(MLP) + ffn_post_norm_2(experts) (``ffn_moe_combined``)
``ffn_moe_topk-{i}``        ``layers.{i}.router.experts``: the top k of the router's softmax (a view of its argsort)
``per_layer_embd_out-{i}``  ``layers.{i}.ple_add``: per_layer_post_norm(per_layer_proj(gelu(gate x) * ple_i))
``l_out-{i}``               ``layers.{i}.residual``: after the per-layer-input add and ``layer_output_scale``
``result_norm``             ``final_norm``: the output norm at the output rows (the LM head's input)

The graph adds the terms in the vocabulary's grouping (x + attn_out, + ffn_out, + ple_add, then x layer_scalar,
which the converter keeps as its own tensor), so every point is served.

Rows. A layer's tensor is [H, n_tokens] of its micro-batch: the graph prunes to the output rows
(``inp_out_ids``) only at ``result_norm`` = ``get_rows(h_nextn, inp_out_ids)`` (earlier only in a context that
keeps masked next-n embeddings, which no traced context does). A tensor with n_tokens rows is taken at the
indices ``result_norm`` read, one with as many rows as the micro-batch has outputs as it is. The outputs come in
the order llama.cpp processed them: the batch's, except for a batch of several sequences on a per-sequence KV cache,
which ``split_equal`` groups by sequence. So each output's rows are lined up with the logits row it produced:
``result_output`` (copied too) is bit for bit the row ``llama_get_logits_ith`` returns.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np

from ...protocol.trace import EMBED, FINAL, trace_rows

__all__ = ["SOURCE", "GgmlTensor", "Tracer", "point_of"]

LOGITS = "logits"  # result_output: lines the rows up with the logits, not a trace point
NAMES = {b"inp_scaled": EMBED, b"result_norm": FINAL, b"result_output": LOGITS}
LAYER_NAMES = {b"attn_post_norm": "attn_out", b"ffn_post_norm": "ffn_out", b"ffn_moe_topk": "router.experts",
               b"per_layer_embd_out": "ple_add", b"l_out": "residual"}
_LAYER = re.compile(rb"(" + b"|".join(LAYER_NAMES) + rb")-(\d+)")
DTYPES = {0: np.float32, 26: np.int32}  # GGML_TYPE_F32, GGML_TYPE_I32
SOURCE = ("cb_eval (ggml_backend_sched_eval_callback) on gemma4.cpp's tensors: inp_scaled, attn_post_norm-i, "
          "ffn_post_norm-i, ffn_moe_topk-i, per_layer_embd_out-i, l_out-i, result_norm; rows lined up by result_output")


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` (ggml/include/ggml.h: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def point_of(name: bytes) -> str | None:
    """The trace point a graph tensor's name is (``LOGITS`` for ``result_output``), or None."""
    m = _LAYER.fullmatch(name)
    if m is not None:
        return f"layers.{int(m.group(2))}.{LAYER_NAMES[m.group(1)]}"
    return NAMES.get(name)


def _rows(t: GgmlTensor) -> np.ndarray:
    """A 2-D F32 or I32 tensor's data as [ne1, ne0] (a copy; strided views too)."""
    dtype = DTYPES.get(t.type)
    if dtype is None or t.ne[2] != 1 or t.ne[3] != 1:
        raise RuntimeError(f"llama-cpp backend: cannot trace {t.name.decode()} (ggml type {t.type}, "
                           f"ne {list(t.ne)}): expected a 2-D F32 or I32 tensor")
    n, m = t.ne[1], t.ne[0]
    if n == 0 or m == 0:
        return np.empty((n, m), dtype)
    buf = (ctypes.c_char * ((n - 1) * t.nb[1] + m * t.nb[0])).from_address(t.data)
    return np.ndarray((n, m), dtype, buffer=buf, strides=(t.nb[1], t.nb[0])).copy()


class Tracer:
    """The evaluation callback of one context (``callback``, for ``cb_eval``) and what it copied since the last
    ``take``: per micro-batch, its token count, its output rows' indices and the points' tensors."""

    def __init__(self, L):
        self.callback = L.ggml_backend_sched_eval_callback(self._eval)
        self._points: dict[bytes, str | None] = {}
        self._ubatches: list[dict] = []
        self._error: BaseException | None = None

    def _eval(self, ptr, ask, _user) -> bool:
        try:
            t = GgmlTensor.from_address(ptr)
            if t.name not in self._points:
                self._points[t.name] = point_of(t.name)
            point = self._points[t.name]
            if ask or point is None:
                return point is not None
            if point == EMBED:  # the first point of a micro-batch's graph
                self._ubatches.append({"tokens": t.ne[1], "points": {}})
            ub = self._ubatches[-1]
            ub["points"][point] = _rows(t)
            if point == FINAL:  # get_rows(h_nextn, inp_out_ids): which rows of the micro-batch are its outputs
                ub["outputs"] = _rows(GgmlTensor.from_address(t.src[1]))[0]
        except BaseException as exc:  # noqa: BLE001 - raised by take(); False would stop the graph
            self._error = self._error or exc
        return True

    def take(self, logits: np.ndarray) -> dict[str, np.ndarray]:
        """The points of the last ``llama_decode``'s outputs, row for row with ``logits`` (those outputs' logits as
        ``llama_get_logits_ith`` gives them, in batch order); forgets what it copied."""
        got, self._ubatches = self._ubatches, []
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"llama-cpp backend: the trace callback failed: {type(error).__name__}: {error}")
        per_ubatch = []
        for ub in got:
            out = ub.get("outputs", np.empty(0, dtype=np.int64))
            rows = {}
            for name, a in ub["points"].items():
                if a.shape[0] != len(out) and a.shape[0] != ub["tokens"]:
                    raise RuntimeError(f"llama-cpp backend: traced {name} has {a.shape[0]} rows in a micro-batch of "
                                       f"{ub['tokens']} tokens and {len(out)} outputs")
                rows[name] = a if a.shape[0] == len(out) else a[out]
            per_ubatch.append(rows)
        processed = trace_rows(per_ubatch) if len(logits) else {}
        if len(logits) and LOGITS not in processed:
            raise RuntimeError("llama-cpp backend: the trace callback saw no result_output for the outputs")
        where: dict[bytes, list[int]] = {}
        for k, row in enumerate(processed.pop(LOGITS, ())):
            where.setdefault(row.tobytes(), []).append(k)
        try:
            order = [where[np.asarray(row, dtype=np.float32).tobytes()].pop(0) for row in logits]
        except (KeyError, IndexError):
            raise RuntimeError("llama-cpp backend: a logits row matches no traced result_output row") from None
        return {name: a[order] for name, a in processed.items()}
