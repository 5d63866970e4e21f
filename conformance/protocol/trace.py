"""The trace vocabulary: the named points of the forward pass a backend may return for its output rows
(capability ``traces``; docs/backend-protocol.md, "Traces").

A request with ``trace=True`` asks, beside the logits, for the value of every point the backend can
expose at every row it returns: ``Response.trace`` maps a point's name to an array row for row with
``logits``, and ``decode_trace`` row for row with ``decode_logits`` (a list of such maps, one per
sequence, for ``multi``). A backend serves any subset of the points; a name it does not return is not
compared. The names, in the order the computation reaches them (gemma4-text-spec.md section 4; H the
hidden size, i the layer):

``embed``                       [R, H] the decoder's input row x0: E[id] * sqrt(H) at text rows, the soft
                                token (unscaled) at image and audio rows
``layers.{i}.attn_out``         [R, H] post_attention_layernorm(o_proj(attention)): the term the attention
                                block adds to the residual
``layers.{i}.ffn_out``          [R, H] post_feedforward_layernorm(...) of the dense MLP (plus, on MoE
                                layers, the normed expert branch): the term the feed-forward block adds
``layers.{i}.ple_add``          [R, H] post_per_layer_input_norm(per_layer_projection(gelu(gate x) * ple_i)):
                                the term the per-layer-input block adds (checkpoints with per-layer inputs)
``layers.{i}.residual``         [R, H] the residual stream after layer i, layer_scalar applied
``layers.{i}.router.experts``   [R, k] int: the experts a MoE layer routes each row to (compared as sets)
``final_norm``                  [R, H] the final RMSNorm's output, the LM head's input (= ``Response.hidden``)
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

__all__ = ["FINAL", "EMBED", "LAYER_POINTS", "SUB_BLOCKS", "check_trace", "point_names", "split_point",
           "trace_rows"]

EMBED = "embed"
FINAL = "final_norm"
# the points of one layer, in the order the layer computes them
LAYER_POINTS = ("attn_out", "ffn_out", "router.experts", "ple_add", "residual")
# what each point names of the computation, for people
SUB_BLOCKS = {
    EMBED: "input embedding",
    "attn_out": "attention block",
    "ffn_out": "feed-forward block",
    "router.experts": "MoE router",
    "ple_add": "per-layer-input block",
    "residual": "residual after the layer",
    FINAL: "final norm",
    "logits": "LM head and softcap",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def point_names(num_layers: int) -> list[str]:
    """Every point of a ``num_layers``-layer decoder, in the order the forward reaches them."""
    return [EMBED] + [f"layers.{i}.{p}" for i in range(num_layers) for p in LAYER_POINTS] + [FINAL]


def split_point(name: str) -> tuple[int | None, str]:
    """``"layers.3.ffn_out"`` -> ``(3, "ffn_out")``; ``"embed"`` -> ``(None, "embed")``. ValueError for a name
    outside the vocabulary."""
    m = _LAYER.fullmatch(name)
    if m is not None and m.group(2) in LAYER_POINTS:
        return int(m.group(1)), m.group(2)
    if name in (EMBED, FINAL):
        return None, name
    raise ValueError(f"{name!r} is not a trace point (embed, layers.<i>.<{'|'.join(LAYER_POINTS)}>, final_norm)")


def check_trace(trace: Any, rows: int, what: str) -> dict[str, np.ndarray]:
    """A backend's trace map, checked: a dict of known point names to arrays with ``rows`` rows. ValueError
    naming ``what`` ("trace", "decode trace of sequence 1") and the point otherwise."""
    if not isinstance(trace, Mapping):
        raise ValueError(f"the {what} must be a dict of point name -> array, got {type(trace).__name__}")
    out: dict[str, np.ndarray] = {}
    for name, value in trace.items():
        split_point(str(name))
        arr = np.asarray(value)
        if arr.ndim != 2 or arr.shape[0] != rows:
            raise ValueError(f"the {what}'s point {name!r} has shape {tuple(arr.shape)}, expected [{rows}, ...] "
                             "(one row per returned row)")
        out[str(name)] = arr
    return out


def trace_rows(traces: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The traces of several forwards (each a map of point -> [r, ...]) as one map, rows in order; a point
    missing from any forward that has rows is dropped (it cannot be lined up with the returned rows)."""
    traces = [t for t in traces if t and next(iter(t.values())).shape[0] > 0]
    if not traces:
        return {}
    names = [n for n in traces[0] if all(n in t for t in traces)]
    return {n: np.concatenate([t[n] for t in traces]) for n in names}
