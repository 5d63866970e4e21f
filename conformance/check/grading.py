"""Grade one case: every returned logits row against the oracle row it must equal.

``grade_case(case, groups, got, base_logits, profile)`` checks each row, in this order, and stops the
row at its first failing check (the later metrics are still computed and reported where defined):

``count``      the group returned a different number of rows than requested (or nothing, or not a
               2-D array): every row of the group fails
``shape``      the row's vocabulary size differs from the oracle's
``nonfinite``  NaN/Inf where the oracle is finite, or a finite value (or an Inf of the other sign)
               where the oracle is infinite; columns where both are the same Inf are left out of every
               metric below
``identity``   the nearest oracle row of the same base (L2 over all its rows) is not the requested
               one. The second half of the identity rule (rows i±1 at least ``identity_ratio`` times
               farther than row i) is evaluated here too, but a row that only misses that ratio and
               also fails a closeness or distribution check is reported under that check: it is an
               inaccurate row, not a row from elsewhere. A row that passes every other check but
               cannot be told apart from its neighbours at this precision fails ``identity``.
``max_abs`` ``max_rel`` ``nmse`` ``cosine``   closeness (``conformance.metrics``)
``kl`` ``delta_p``                             distribution
``top1`` ``topk``   token agreement, on decided rows only (oracle top-1 minus top-2 logit > the
                    profile's ``tie_margin``); ``topk`` forgives a missing oracle top-k token whose
                    oracle logit is within ``tie_margin`` of the oracle's (k+1)-th (its rank is not
                    decided either)

Then per case: ``kl_mean`` (mean KL over the rows that have one) and, for generation cases, the
first decided step whose backend argmax is not the golden token (``first_divergence``, check
``generation``).

All metric values are JSON-serialisable: Python floats (``identity_nearest``: an int), or ``None``
where a metric is undefined (the row was not returned, has another vocabulary size, a non-finite
result, or a value that is not finite, such as the identity ratio of a one-row base).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from . import metrics as M
from .profiles import Profile

__all__ = ["RowResult", "CaseGrade", "grade_case", "CHECKS", "CASE_CHECKS", "METRIC_KEYS", "MOE_NEAR_TIE", "TOP_N"]

CHECKS = ("count", "dtype", "shape", "nonfinite", "identity", "max_abs", "max_rel", "nmse", "cosine", "kl", "delta_p",
          "top1", "topk", "hidden", "hidden_identity")  # the last two: hidden-state rows (conformance.check.hidden)
CASE_CHECKS = ("count", "dtype", "kl_mean", "generation", "mtp", "mtp_output", "mtp_accepted", "mtp_trace")
METRIC_KEYS = ("max_abs", "max_rel", "nmse", "cosine", "kl", "delta_p", "top1_agree", "topk_overlap", "margin",
               "identity_nearest", "identity_ratio", "got_max_abs", "got_spread", "got_digest")
# got_max_abs: the row's largest finite |logit|; got_spread: its largest minus its smallest finite logit (0: a
# constant row); got_digest: 48 bits of a hash of the returned row's bytes (equal digests: the very same row
# returned twice), both for the diagnosis of degenerate output (conformance.check.diagnosis)
#: top-N ids reported in every RowResult (``top_ref`` / ``top_got``)
TOP_N = 5
#: a failing MoE case whose smallest router margin (probability gap between the k-th chosen and the
#: best unchosen expert) is below this gets a note: rounding can flip the expert choice there
MOE_NEAR_TIE = 1e-2
#: floating dtypes of ml_dtypes (numpy kind "V"), which a backend may return as they are
ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e4m3b11fnuz")


@dataclass
class RowResult:
    label: str
    position: int
    status: str  # "pass" | "fail"
    check: str | None  # first failing check (see CHECKS)
    metrics: dict[str, float | int | None]
    top_ref: list[int]
    top_got: list[int]
    message: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CaseGrade:
    status: str  # "pass" | "fail"
    check: str | None  # first failing check of the first failing row, or count / kl_mean / generation
    message: str
    rows: list[RowResult]
    summary: dict[str, float | None]  # kl_mean, kl_p99, kl_max, max_abs, nmse_max, top1_rate (decided rows)
    first_divergence: int | None = None  # generation cases: first decided step whose argmax differs

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "check": self.check,
            "message": self.message,
            "rows": [r.to_json() for r in self.rows],
            "summary": dict(self.summary),
            "first_divergence": self.first_divergence,
        }


# ---------------------------------------------------------------------------------------------
# helpers


def finite_or_none(x) -> float | None:
    """A Python float, or None when undefined / not finite (JSON has no inf or nan)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def show_value(x: float | None) -> str:
    """A metric value for messages: 0.41, 3.2e-03, n/a."""
    if x is None:
        return "n/a"
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{x:.3g}" if 1e-2 <= abs(x) < 1e4 else f"{x:.1e}"


def show_threshold(x: float) -> str:
    """A threshold, printed compactly (1e-07, 0.02, 10)."""
    return f"{x:g}"


def empty_metrics() -> dict[str, float | int | None]:
    return {k: None for k in METRIC_KEYS}


def _describe_nonfinite(v: float) -> str:
    return "nan" if math.isnan(v) else ("+inf" if v > 0 else "-inf")


# what _BaseCache derives from a base's oracle rows, kept while that array lives: a set's cases grade against
# the same bases, and each derived value is a pass over all of a base's rows (at real size 1,032 rows of 262,144
# logits: a second or so a case, before the rows it grades)
_DERIVED: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}  # id(rows) -> (a weak reference to rows, what)


def _derived_of(rows: Any) -> dict[str, Any]:
    """The values derived from the array ``rows`` so far (forgotten when it is): TypeError where it cannot be
    weakly referenced."""
    key = id(rows)
    entry = _DERIVED.get(key)
    if entry is None or entry[0]() is not rows:
        entry = (weakref.ref(rows), {})
        _DERIVED[key] = entry
        weakref.finalize(rows, _DERIVED.pop, key, None)
    return entry[1]


class _BaseCache:
    """Per-base data: the oracle rows, their finite-column mask and squared norms, each computed once per base
    array (shared by the cases that grade against it; computed per grade_case call for rows that cannot be
    weakly referenced)."""

    def __init__(self, base_logits: dict[str, np.ndarray]):
        self.base_logits = base_logits
        self._own: dict[str, dict[str, Any]] = {}

    def rows(self, base: str) -> np.ndarray:
        try:
            return self.base_logits[base]
        except KeyError:
            raise KeyError(f"no oracle logits for base {base!r} (have: {', '.join(self.base_logits)})") from None

    def _derived(self, base: str, what: str, make) -> Any:
        rows = self.rows(base)
        try:
            kept = _derived_of(rows)
        except TypeError:  # (not weakly referable)
            kept = self._own.setdefault(base, {})
        if what not in kept:
            kept[what] = make(rows)
        return kept[what]

    def sq_norms(self, base: str) -> np.ndarray:
        """sum of squares of every oracle row of the base (for row identity's candidate search)."""
        return self._derived(base, "sq", lambda rows: np.concatenate(
            [np.sum(np.asarray(rows[s : s + 64], dtype=np.float64) ** 2, axis=-1) for s in range(0, len(rows), 64)]))

    def finite_cols(self, base: str) -> np.ndarray | None:
        """Columns finite in every oracle row of the base (None: all of them)."""
        def make(rows):
            ok = np.all(np.isfinite(np.asarray(rows)), axis=0)
            return None if ok.all() else ok
        return self._derived(base, "cols", make)


@dataclass
class _Row:
    """Working state of one row while grading."""

    spec: Any
    index: int  # index in the concatenated groups
    result: RowResult
    got: np.ndarray | None = None  # float64 [V] (structural checks passed)
    ref: np.ndarray | None = None
    margin: float | None = None
    decided: bool = False
    argmax_got: int | None = None


def _tie_aware_overlap(ref: np.ndarray, top_ref: np.ndarray, top_got: np.ndarray, k: int,
                       tie_margin: float) -> tuple[float, float, list, list]:
    """(plain overlap, tie-aware overlap, ref top-k ids, got top-k ids); ``top_ref``: the oracle's top k + 1
    ids or more (``M.topk_ids``), ``top_got``: the returned row's top k or more (a longer stable top list starts
    with the shorter one: each row's ids are ranked once for every check that reads them)."""
    k = min(k, ref.shape[-1])
    ids_ref, ids_got = top_ref[:k], top_got[:k]
    plain = M.topk_overlap(ids_ref, ids_got)
    if k >= ref.shape[-1]:
        return plain, 1.0, ids_ref.tolist(), ids_got.tolist()
    kth1 = float(ref[top_ref[k]])  # the oracle's (k+1)-th logit
    got_set = set(ids_got.tolist())
    ok = sum(1 for t in ids_ref.tolist() if t in got_set or ref[t] - kth1 <= tie_margin)
    return plain, ok / k, ids_ref.tolist(), ids_got.tolist()


# ---------------------------------------------------------------------------------------------
# one row


def _nonfinite(label: str, ref: np.ndarray, got: np.ndarray,
               failures: list[tuple[str, str]]) -> tuple[np.ndarray | None, np.ndarray]:
    """(the columns finite in both rows, None: all; the returned row's finite columns), a failure for the
    non-finite mismatches."""
    fin_ref, fin_got = np.isfinite(ref), np.isfinite(got)
    same_inf = (~fin_ref) & (~fin_got) & (ref == got)  # the same +-inf on both sides (nan != nan)
    bad = (fin_ref != fin_got) | ((~fin_ref) & (~fin_got) & ~same_inf)
    if bad.any():
        idx = np.flatnonzero(bad)
        j = int(idx[0])
        where_finite = int(np.count_nonzero(bad & fin_ref))
        if fin_ref[j]:
            what = f"{_describe_nonfinite(got[j])} where the oracle is finite ({ref[j]:.4g})"
        else:
            gv = _describe_nonfinite(got[j]) if not fin_got[j] else f"{got[j]:.4g}"
            what = f"{gv} where the oracle is {_describe_nonfinite(ref[j])}"
        failures.append(("nonfinite", f"{label}: {len(idx)} non-finite mismatch(es) ({where_finite} where the "
                                      f"oracle is finite); first at token {j}: {what}"))
    return (None if fin_ref.all() and fin_got.all() else (fin_ref & fin_got)), fin_got


def _identity(spec: Any, got: np.ndarray, fin_got: np.ndarray, base_rows: np.ndarray, base_cols: np.ndarray | None,
              profile: Profile, approx_sq_dist: np.ndarray | None, m: dict,
              failures: list[tuple[str, str]]) -> str | None:
    """The identity check over the columns finite in every oracle row of the base and in the returned row: a
    failure when the row is nearest another oracle row; the message of a short ratio (reported only when nothing
    else fails), else None."""
    idcols = fin_got if base_cols is None else (base_cols & fin_got)
    if idcols.any():
        if idcols.all():
            nearest, ratio = M.row_identity(got, base_rows, spec.position, approx_sq_dist=approx_sq_dist)
        else:
            nearest, ratio = M.row_identity(got[idcols], np.asarray(base_rows)[:, idcols], spec.position)
        m["identity_nearest"] = int(nearest)
        m["identity_ratio"] = finite_or_none(ratio)
    else:
        nearest, ratio = spec.position, math.inf
    if nearest != spec.position:
        a = got if idcols.all() else got[idcols]
        pair = np.asarray(base_rows[[nearest, spec.position]], dtype=np.float64)
        d_near, d_own = M.row_distances(a, pair if idcols.all() else pair[:, idcols])
        failures.append(("identity", f"{spec.label}: identity: the returned row is nearest to oracle row {nearest} "
                                     f"(distance {show_value(d_near)}), not to row {spec.position} (distance "
                                     f"{show_value(d_own)}): a shifted or misindexed row"))
    elif ratio < profile.identity_ratio:
        return (f"{spec.label}: identity ratio {show_value(ratio)} < {show_threshold(profile.identity_ratio)}: rows "
                f"{spec.position}±1 are not clearly farther than row {spec.position} (the row cannot be "
                f"told apart from its neighbours at this precision)")
    return None


def _closeness(label: str, ref: np.ndarray, got: np.ndarray, r: np.ndarray, g: np.ndarray, colmap: np.ndarray,
               profile: Profile, m: dict, failures: list[tuple[str, str]]) -> str:
    """max_abs, max_rel, nmse and cosine over the finite columns (``r``, ``g``); returns where max_abs is."""
    diff = np.abs(g - r)
    j = int(np.argmax(diff))
    ma = float(diff[j])
    tok = int(colmap[j])
    rel = diff / np.maximum(np.abs(r), profile.rel_floor)
    jr = int(np.argmax(rel))
    mr = float(rel[jr])
    nm = float(M.nmse(g, r))
    cs = float(M.cosine(g, r))
    m["max_abs"], m["max_rel"] = finite_or_none(ma), finite_or_none(mr)
    m["nmse"], m["cosine"] = finite_or_none(nm), finite_or_none(cs)
    if not ma <= profile.max_abs:
        failures.append(("max_abs", f"{label}: max_abs {show_value(ma)} > {show_threshold(profile.max_abs)} at token "
                                    f"{tok} (got {got[tok]:.7g}, oracle {ref[tok]:.7g}; nmse {show_value(nm)})"))
    if not mr <= profile.max_rel:
        tr = int(colmap[jr])
        failures.append(("max_rel", f"{label}: max_rel {show_value(mr)} > {show_threshold(profile.max_rel)} at token "
                                    f"{tr} (got {got[tr]:.7g}, oracle {ref[tr]:.7g}, floor "
                                    f"{show_threshold(profile.rel_floor)})"))
    at = f"max_abs {show_value(ma)} at token {tok}: got {got[tok]:.7g}, oracle {ref[tok]:.7g}"
    if not nm <= profile.nmse:
        failures.append(("nmse", f"{label}: nmse {show_value(nm)} > {show_threshold(profile.nmse)} ({at})"))
    if not cs >= profile.cosine_min:
        failures.append(("cosine", f"{label}: cosine {cs:.9f} < {profile.cosine_min:.9f} (1 - cosine "
                                   f"{show_value(1 - cs)}; nmse {show_value(nm)})"))
    return at


def _distribution(label: str, r: np.ndarray, g: np.ndarray, colmap: np.ndarray, at: str, profile: Profile, m: dict,
                  failures: list[tuple[str, str]]) -> None:
    """KL and the change of the oracle's top token's probability, over the finite columns."""
    kl = float(M.kl(r, g))
    dp = float(M.delta_p(r, g))
    m["kl"], m["delta_p"] = finite_or_none(kl), finite_or_none(dp)
    if not kl <= profile.kl_max:
        failures.append(("kl", f"{label}: kl {show_value(kl)} > {show_threshold(profile.kl_max)} (delta_p "
                               f"{show_value(dp)}; {at})"))
    if not dp <= profile.delta_p:
        jt = int(np.argmax(r))
        p_ref, p_got = float(M.softmax(r)[jt]), float(M.softmax(g)[jt])
        failures.append(("delta_p", f"{label}: delta_p {show_value(dp)} > {show_threshold(profile.delta_p)} on the "
                                    f"oracle's top token {int(colmap[jt])} (p oracle {p_ref:.4g}, p got {p_got:.4g}; "
                                    f"kl {show_value(kl)})"))


def _agreement(row: _Row, ref: np.ndarray, got: np.ndarray, tops: tuple[np.ndarray, np.ndarray], profile: Profile,
               m: dict, failures: list[tuple[str, str]]) -> None:
    """Top-1 and the tie-aware top-k overlap, failing only on a decided row; ``tops``: the rows' ranked ids
    (``_tie_aware_overlap``)."""
    label = row.spec.label
    ref_top = int(M.top1(ref))
    agree = row.argmax_got == ref_top
    m["top1_agree"] = 1.0 if agree else 0.0
    plain, tie_aware, ids_ref, ids_got = _tie_aware_overlap(ref, *tops, profile.topk, profile.tie_margin)
    m["topk_overlap"] = finite_or_none(plain)
    if row.decided and not agree:
        gg = np.nan_to_num(got, nan=-np.inf)
        v = gg[ref_top]
        rank = 1 + int(np.count_nonzero(gg > v)) + int(np.count_nonzero(gg[:ref_top] == v))
        failures.append(("top1", f"{label}: top-1 differs on a decided row: got token {row.argmax_got}, oracle "
                                 f"{ref_top} (oracle margin {show_value(row.margin)} > "
                                 f"{show_threshold(profile.tie_margin)}; the oracle's token is rank {rank} in the "
                                 "returned row)"))
    if row.decided and tie_aware < profile.topk_overlap_min:
        failures.append(("topk", f"{label}: top-{profile.topk} overlap {show_value(tie_aware)} < "
                                 f"{show_threshold(profile.topk_overlap_min)} on a decided row: oracle {ids_ref}, got "
                                 f"{ids_got}"))


def _grade_row(row: _Row, got_row: np.ndarray, base_rows: np.ndarray, base_cols: np.ndarray | None,
               profile: Profile, approx_sq_dist: np.ndarray | None = None) -> None:
    """Grade one returned row against the oracle's, check by check in check order (shape, nonfinite, identity,
    closeness, distribution, token agreement); the first failure is the row's verdict."""
    spec, res = row.spec, row.result
    label = spec.label
    ref = np.asarray(base_rows[spec.position], dtype=np.float64)
    got = np.asarray(got_row, dtype=np.float64)
    failures: list[tuple[str, str]] = []  # (check, message) in check order
    if got.shape[-1] != ref.shape[-1]:
        res.status, res.check = "fail", "shape"
        res.message = f"{label}: vocabulary size {got.shape[-1]} != oracle's {ref.shape[-1]}"
        res.top_ref = M.topk_ids(ref, TOP_N).tolist()
        return
    row.got, row.ref = got, ref
    cols, fin_got = _nonfinite(label, ref, got, failures)
    r = ref if cols is None else ref[cols]
    g = got if cols is None else got[cols]
    colmap = np.arange(ref.shape[-1]) if cols is None else np.flatnonzero(cols)
    m = res.metrics
    margin = M.top1_margin(ref)
    m["margin"] = finite_or_none(margin)
    m["got_max_abs"] = finite_or_none(np.abs(g).max()) if g.size else None
    m["got_spread"] = finite_or_none(g.max() - g.min()) if g.size else None
    m["got_digest"] = M.row_digest(got)
    tops = M.topk_ids(ref, max(TOP_N, profile.topk + 1)), M.topk_ids(got, max(TOP_N, profile.topk))
    res.top_ref, res.top_got = tops[0][:TOP_N].tolist(), tops[1][:TOP_N].tolist()
    row.argmax_got = int(M.top1(got))
    row.margin = float(margin)
    row.decided = row.margin > profile.tie_margin
    if r.size == 0:
        failures.append(("nonfinite", f"{label}: no column where both rows are finite"))
        _finish(res, failures)
        return
    ratio_short = _identity(spec, got, fin_got, base_rows, base_cols, profile, approx_sq_dist, m, failures)
    at = _closeness(label, ref, got, r, g, colmap, profile, m, failures)
    _distribution(label, r, g, colmap, at, profile, m, failures)
    _agreement(row, ref, got, tops, profile, m, failures)
    if ratio_short is not None and not failures:
        failures.append(("identity", ratio_short))
    _finish(res, failures)


def _finish(res: RowResult, failures: list[tuple[str, str]]) -> None:
    if failures:
        order = {c: i for i, c in enumerate(CHECKS)}
        check, message = min(failures, key=lambda f: order[f[0]])
        res.status, res.check, res.message = "fail", check, message
    else:
        res.status, res.check = "pass", None
        m = res.metrics
        res.message = (f"{res.label}: ok (max_abs {show_value(m['max_abs'])}, nmse {show_value(m['nmse'])}, "
                       f"kl {show_value(m['kl'])})")


def _group_sq_distances(bases: _BaseCache, specs: Sequence[Any], arr: np.ndarray) -> dict[int, np.ndarray]:
    """Approximate squared L2 distances from each returned row to every oracle row of its base, with
    one matrix product per base (``|a|^2 + |b|^2 - 2 a.b``): row identity's candidate search. Only for
    finite rows of bases without infinite columns and with more than 8 rows; others search directly."""
    out: dict[int, np.ndarray] = {}
    by_base: dict[str, list[int]] = {}
    for ri, spec in enumerate(specs):
        by_base.setdefault(spec.base, []).append(ri)
    for base, idx in by_base.items():
        rows = bases.rows(base)
        if len(rows) <= 8 or bases.finite_cols(base) is not None or arr.shape[-1] != rows.shape[-1]:
            continue
        a = arr[idx]
        ok = np.all(np.isfinite(a), axis=-1)
        if not ok.any():
            continue
        a = a[ok]
        dots = np.concatenate([a @ np.asarray(rows[s : s + 256], dtype=np.float64).T for s in range(0, len(rows), 256)],
                              axis=1)
        d2 = bases.sq_norms(base)[None, :] - 2.0 * dots + np.sum(a * a, axis=-1)[:, None]
        for k, ri in enumerate(np.asarray(idx)[ok]):
            out[int(ri)] = d2[k]
    return out


# ---------------------------------------------------------------------------------------------
# one case


def real_array(gname: str, arr: Any) -> tuple[np.ndarray | None, str | None]:
    """A returned group as float64, or why it is not logits: only real floating and integer dtypes are
    (complex values, objects, strings and booleans are refused, never coerced)."""
    try:
        a = np.asarray(arr)
    except (TypeError, ValueError) as exc:  # e.g. ragged nested lists
        return None, f"group '{gname}' is not an array ({type(exc).__name__}: {exc})"
    floating = a.dtype.kind == "f" or a.dtype.name in ML_FLOATS
    if not (floating or a.dtype.kind in "iu"):
        return None, (f"group '{gname}' has dtype {a.dtype}: logits must be a real floating (or integer) "
                      f"array")
    return a.astype(np.float64), None



def _group_problem(gname: str, specs: Sequence[Any], arr: Any) -> tuple[Any, tuple[str, str] | None]:
    """(the group's rows as a real array, None when it cannot be graded row by row: (check, message))."""
    if arr is None:
        return None, ("count", f"no rows returned for group '{gname}' (expected {len(specs)})")
    arr, bad_dtype = real_array(gname, arr)
    if bad_dtype is not None:
        return arr, ("dtype", bad_dtype)
    if arr.ndim != 2:
        return arr, ("count", f"group '{gname}' has shape {tuple(arr.shape)}, expected [{len(specs)}, V]")
    if arr.shape[0] != len(specs):
        return arr, ("count", f"group '{gname}' returned {arr.shape[0]} rows, expected {len(specs)}")
    return arr, None


def _grade_rows(groups: Sequence[tuple[str, Sequence[Any]]], got: Sequence[np.ndarray | None], bases: _BaseCache,
                profile: Profile) -> tuple[list[_Row], bool]:
    """(every row graded, whether some group had the wrong row count or dtype)."""
    rows: list[_Row] = []
    count_failed = False
    for gi, (gname, specs) in enumerate(groups):
        arr, problem = _group_problem(gname, specs, got[gi] if gi < len(got) else None)
        approx = _group_sq_distances(bases, specs, arr) if problem is None else {}
        for ri, spec in enumerate(specs):
            res = RowResult(label=spec.label, position=int(spec.position), status="fail", check=None,
                            metrics=empty_metrics(), top_ref=[], top_got=[], message="")
            row = _Row(spec=spec, index=len(rows), result=res)
            rows.append(row)
            base_rows = bases.rows(spec.base)
            if problem is not None:
                count_failed = True
                res.check, res.message = problem[0], f"{spec.label}: {problem[1]}"
                res.top_ref = M.topk_ids(np.asarray(base_rows[spec.position], dtype=np.float64), TOP_N).tolist()
                continue
            _grade_row(row, arr[ri], base_rows, bases.finite_cols(spec.base), profile, approx.get(ri))
    return rows, count_failed


def _summary(rows: list[_Row]) -> dict[str, float | None]:
    """The case's row metrics summed up: KL mean, p99 and max, the largest max_abs and nmse, the top-1 rate."""
    results = [r.result for r in rows]
    kls = [r.metrics["kl"] for r in results if r.metrics["kl"] is not None]
    mas = [r.metrics["max_abs"] for r in results if r.metrics["max_abs"] is not None]
    nms = [r.metrics["nmse"] for r in results if r.metrics["nmse"] is not None]
    # top-1 agreement is undefined on a row with no finite column (it failed nonfinite before)
    top1 = [a for r in rows if r.got is not None and r.decided
            and (a := r.result.metrics["top1_agree"]) is not None]
    return {
        "kl_mean": finite_or_none(np.mean(kls)) if kls else None,
        "kl_p99": finite_or_none(np.quantile(kls, 0.99)) if kls else None,
        "kl_max": finite_or_none(max(kls)) if kls else None,
        "max_abs": finite_or_none(max(mas)) if mas else None,
        "nmse_max": finite_or_none(max(nms)) if nms else None,
        "top1_rate": finite_or_none(np.mean(top1)) if top1 else None,
    }


def _divergence(case: Any, rows: list[_Row], profile: Profile) -> tuple[int | None, str | None]:
    """A generation case's first decided step whose argmax is not the golden token: (its index, the message)."""
    if not getattr(case, "generation", False):
        return None, None
    for r in rows:
        gold = getattr(r.spec, "golden_token", None)
        if gold is None or r.got is None or not r.decided:
            continue
        if r.argmax_got != int(gold):
            return r.index, (f"generation diverges at step {r.index} ({r.spec.label}): got token {r.argmax_got}, "
                             f"golden {int(gold)} (oracle margin {show_value(r.margin)} > "
                             f"{show_threshold(profile.tie_margin)})")
    return None, None


def grade_case(case, groups: Sequence[tuple[str, Sequence[Any]]], got: Sequence[np.ndarray | None],
               base_logits: dict[str, np.ndarray], profile: Profile) -> CaseGrade:
    """Grade a case's returned rows against the oracle's.

    ``groups`` is ``row_groups(case)``: ``[(group_name, [RowSpec, ...]), ...]``; ``got`` is aligned
    with it (one ``[R, V]`` array per group, or ``None`` where the backend returned nothing; a
    missing trailing entry counts as ``None``); ``base_logits`` maps base id -> ``[N, V]`` float64
    oracle rows; ``profile`` the tolerances. Uses ``case.generation`` and ``case.moe_min_margin``.
    """
    rows, count_failed = _grade_rows(groups, got, _BaseCache(base_logits), profile)
    results = [r.result for r in rows]
    summary = _summary(rows)
    first_div, div_msg = _divergence(case, rows, profile)
    failing = [r for r in results if r.status == "fail"]
    n = len(results)
    status, check, message = "pass", None, ""
    if failing:
        # a group with the wrong row count is a case-level structural failure: it comes first
        lead = (next((r for r in failing if r.check in ("count", "dtype")), failing[0]) if count_failed
                else failing[0])
        status, check = "fail", lead.check
        message = lead.message
        if len(failing) > 1:
            checks = sorted({r.check for r in failing}, key=CHECKS.index)
            message += f" (+{len(failing) - 1} more of {n} rows fail: {', '.join(checks)})"
        if div_msg:
            message += f"; {div_msg}"
    elif first_div is not None:
        status, check, message = "fail", "generation", div_msg
    elif summary["kl_mean"] is not None and not summary["kl_mean"] <= profile.kl_mean:
        status, check = "fail", "kl_mean"
        kls = sum(r.metrics["kl"] is not None for r in results)
        message = (f"kl_mean {show_value(summary['kl_mean'])} > {show_threshold(profile.kl_mean)} over {kls} rows "
                   f"(kl_max {show_value(summary['kl_max'])})")
    else:
        message = (f"{n} row{'s' if n != 1 else ''} pass (max_abs {show_value(summary['max_abs'])}, nmse_max "
                   f"{show_value(summary['nmse_max'])}, kl_mean {show_value(summary['kl_mean'])})")
    moe = getattr(case, "moe_min_margin", None)
    if status == "fail" and moe is not None and moe < MOE_NEAR_TIE:
        message += (f"; note: MoE router near-tie in this case (smallest router margin {show_value(moe)} < "
                    f"{show_threshold(MOE_NEAR_TIE)}): rounding can flip an expert choice, which moves logits far "
                    "beyond the tolerance")
    return CaseGrade(status=status, check=check, message=message, rows=results, summary=summary,
                     first_divergence=first_div)
