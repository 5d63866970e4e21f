"""Compare a backend's trace with the oracle's, point by point and row by row, and find where it first
leaves the noise floor (``conformance explain``; the points are ``conformance.protocol.trace``'s).

Two scale-free errors per row and point. ``errors``: how wrong the point's own value is, the squared distance
to the oracle's value over the oracle value's squared norm (the NMSE of that point). ``effect``: how much
that moves the residual stream the point is added to, the same squared distance over the squared norm of
the oracle's stream entering the layer (for ``attn_out``, ``ffn_out`` and ``ple_add``; for ``embed``,
``residual`` and ``final_norm`` the two are the same). A row leaves the floor at a point when its error is
above the profile's per-row ``nmse`` threshold on logits (an error of e moves what follows by about sqrt(e)
relative) and its effect is above ``EFFECT_FRACTION`` of it: a wrong term is named where it is computed,
even while it is still small beside the stream, but a block whose own output is tiny (a near-zero
per-layer-input term, whose RMSNorm amplifies rounding some hundred times in a correct engine) is not
flagged for rounding that cannot reach the logits. ``logits`` closes the table: the NMSE of the returned
logits rows. The MoE router's choices are compared as sets and reported, never taken as the
divergence itself (a near tie flips them in a correct engine; a real difference shows in ``ffn_out``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..protocol.trace import EMBED, FINAL, LAYER_POINTS, SUB_BLOCKS, split_point

__all__ = ["EFFECT_FRACTION", "PointErrors", "TraceComparison", "compare_traces", "point_effect", "point_errors",
           "point_order"]

LOGITS = "logits"
ROUTER = "router.experts"
EFFECT_FRACTION = 1e-4  # a point is flagged when its effect on the stream is at least this part of the floor


def point_order(names: Sequence[str]) -> list[str]:
    """``names`` (trace points) in the order the forward reaches them."""

    def key(name: str) -> tuple[int, int]:
        layer, sub = split_point(name)
        if layer is None:
            return (-1, 0) if sub == EMBED else (1 << 30, 0)
        return layer, LAYER_POINTS.index(sub)

    return sorted(names, key=key)


@dataclass
class PointErrors:
    """One point's error at every compared row (NaN where the backend gave no value)."""

    name: str  # "embed", "layers.3.ffn_out", "final_norm", "logits"
    layer: int | None
    sub: str  # "attn_out", ..., "embed", "final_norm", "logits"
    errors: np.ndarray  # [R] the point's own NMSE (router: 1.0 where the chosen experts differ, else 0.0)
    effect: np.ndarray  # [R] the same squared distance over the squared norm of the stream it is added to

    def over(self, floor: float) -> list[int]:
        """The rows that leave the floor here (module doc)."""
        return [i for i, (e, f) in enumerate(zip(self.errors, self.effect, strict=True))
                if not np.isnan(e) and e > floor and f > floor * EFFECT_FRACTION]

    @property
    def worst(self) -> float:
        finite = self.errors[~np.isnan(self.errors)]
        return float(finite.max()) if finite.size else float("nan")

    def to_json(self) -> dict[str, Any]:
        def listed(x: np.ndarray) -> list[float | None]:
            return [None if np.isnan(e) else float(e) for e in x]

        return {"point": self.name, "layer": self.layer, "sub_block": self.sub, "errors": listed(self.errors),
                "effect": listed(self.effect)}


@dataclass
class TraceComparison:
    """Every compared point of one case, in forward order, and the first one past the floor."""

    rows: list[str]  # the rows' labels ("row 3", "decode 0", "seq 1 last")
    roles: list[str]  # per row: interior, last, decode, image, audio
    floor: float
    points: list[PointErrors] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # points the oracle has and the backend did not return
    traced: str = "returned rows"  # which rows: the request's returned rows, or "every prompt row"

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        """``{layer, point, sub_block, rows, error}`` of the first point where a row's error exceeds the floor
        (the router's choices aside); None when every compared point is within it."""
        for p in self.points:
            if p.sub == ROUTER:
                continue
            over = p.over(self.floor)
            if over:
                return {"layer": p.layer, "point": p.name, "sub_block": p.sub, "what": SUB_BLOCKS.get(p.sub, p.sub),
                        "rows": [self.rows[i] for i in over], "roles": sorted({self.roles[i] for i in over}),
                        "error": float(max(p.errors[i] for i in over)), "traced": self.traced}
        return None

    def router_differs(self) -> list[dict[str, Any]]:
        """The MoE layers whose chosen experts differ from the oracle's, with the rows."""
        return [{"layer": p.layer, "rows": [self.rows[i] for i, e in enumerate(p.errors) if e > 0]}
                for p in self.points if p.sub == ROUTER and np.nansum(p.errors) > 0]

    def growth(self) -> list[dict[str, Any]]:
        """From the first divergence on (every point when none), each point's worst row error."""
        first = self.first_divergence
        start = 0 if first is None else next(k for k, p in enumerate(self.points) if p.name == first["point"])
        return [{"point": p.name, "worst": p.worst} for p in self.points[start:] if p.sub != ROUTER]

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "roles": self.roles, "floor": self.floor, "traced": self.traced,
                "first_divergence": self.first_divergence, "router_differs": self.router_differs(),
                "missing_points": self.missing, "growth": self.growth(),
                "points": [p.to_json() for p in self.points]}


def _sq(x: np.ndarray) -> np.ndarray:
    return np.sum(np.square(x), axis=-1)


def _stream_before(ref: Mapping[str, np.ndarray], layer: int) -> np.ndarray | None:
    """The oracle's residual stream entering ``layer``: the residual after layer - 1, or the input embedding."""
    return ref.get(f"layers.{layer - 1}.residual") if layer > 0 else ref.get(EMBED)


def _relative(got: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        err = _sq(got - ref) / np.maximum(_sq(scale), np.finfo(np.float64).tiny)
    return np.where(np.isfinite(got).all(axis=-1), err, np.inf)


def point_errors(name: str, got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row: the NMSE of ``got`` against the oracle's ``ref`` at point ``name`` (for the router's choices:
    1.0 where the chosen experts differ as sets, else 0.0)."""
    if split_point(name)[1] == ROUTER:
        same = [set(np.asarray(a).tolist()) == set(np.asarray(b).tolist()) for a, b in zip(got, ref, strict=False)]
        return np.array([0.0 if s else 1.0 for s in same])
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return _relative(got, ref, ref)


def point_effect(name: str, got: np.ndarray, ref: np.ndarray, ref_trace: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per row: the squared distance of ``got`` to ``ref`` over the squared norm of the oracle's stream the point
    is added to (``point_errors`` where the point is the stream itself)."""
    layer, sub = split_point(name)
    before = _stream_before(ref_trace, layer) if sub in ("attn_out", "ffn_out", "ple_add") else None
    if before is None or sub == ROUTER:
        return point_errors(name, got, ref)
    return _relative(np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64),
                     np.asarray(before, dtype=np.float64))


def compare_traces(got: Sequence[Mapping[str, np.ndarray] | None], ref: Sequence[Mapping[str, np.ndarray]],
                   got_logits: Sequence[np.ndarray | None], ref_logits: Sequence[np.ndarray],
                   rows: list[str], roles: list[str], floor: float) -> TraceComparison:
    """Compare groups of rows (the prefill's rows, then each decode group): ``got[g]`` / ``ref[g]`` are the
    backend's and the oracle's trace maps of group g, ``got_logits[g]`` / ``ref_logits[g]`` their logits
    rows; ``rows`` and ``roles`` label every row of all groups in order."""
    names = point_order(sorted(set().union(*(r.keys() for r in ref)) if ref else set()))
    out = TraceComparison(rows=rows, roles=roles, floor=floor)
    served = set().union(*(g.keys() for g in got if g)) if any(got) else set()
    out.missing = [n for n in names if n not in served]
    for name in names + [LOGITS]:
        errs, effects = [], []
        for g, r, gl, rl in zip(got, ref, got_logits, ref_logits, strict=False):
            n = len(next(iter(r.values()))) if r else np.asarray(rl).shape[0]
            missing = (np.full(n, np.nan), np.full(n, np.nan))
            if name == LOGITS:
                e = (missing if gl is None or np.asarray(gl).shape != np.asarray(rl).shape
                     else (point_errors(FINAL, gl, rl),) * 2)
            elif g and name in g and name in r and np.asarray(g[name]).shape[0] == n:
                e = point_errors(name, g[name], r[name]), point_effect(name, g[name], r[name], r)
            else:
                e = missing
            errs.append(e[0])
            effects.append(e[1])
        errors = np.concatenate(errs) if errs else np.empty(0)
        if np.isnan(errors).all() and name != LOGITS:
            continue
        layer, sub = (None, LOGITS) if name == LOGITS else split_point(name)
        out.points.append(PointErrors(name, layer, sub, errors, np.concatenate(effects) if effects else np.empty(0)))
    return out
