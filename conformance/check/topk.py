"""Grading from top-k logprobs: what a server's completions endpoint returns instead of logits (issue 60).

A backend that answers ``Response.logprobs`` (``TopLogprobs``: per returned row the ids of its top k tokens and
their log-probabilities) is graded row by row against the oracle's log-softmax, as far as k values allow:

``logprob``  max over the returned ids of |server logprob - oracle logprob|. Bound: 2 x the profile's
             ``max_abs``. A logprob is the logit minus the row's log-sum-exp, and the log-sum-exp of two rows
             moves by at most their largest logit difference, so a row within ``max_abs`` of the oracle's logits
             has every logprob within 2 ``max_abs`` (the bound is derived, not tuned: docs/profiles.md).
``top1``     on a decided row (the oracle's top-1 minus top-2 logit above ``tie_margin``) the server's most likely
             returned token is the oracle's top-1.
``topk``     no token is missing that clearly belongs: the oracle's top-k ids (k the server's) that the server left
             out must lie within the bound of the server's least likely returned token, else the server's
             top-k set is not the model's.

Metrics per row: ``logprob_max_abs``, ``topk_overlap`` (the oracle's top-k among the returned), ``mass_outside``
(the oracle's probability mass outside the returned ids) and ``mass_outside_got`` (1 minus the server's returned
probabilities); the full-logit metrics (max_abs, nmse, cosine, KL, identity) are not applicable and stay None.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import metrics as M
from .grading import CaseGrade, RowResult, empty_metrics, show_threshold, show_value
from .profiles import Profile

__all__ = ["TOPK_CHECKS", "grade_topk_case", "logprob_bound"]

TOPK_CHECKS = ("count", "shape", "nonfinite", "logprob", "top1", "topk")
SHOWN = 5  # ids in a row's top_ref / top_got
PAD = -1  # an id that pads a row returned with fewer than k (TopLogprobs.ids)


def logprob_bound(profile: Profile) -> float:
    """The largest |logprob difference| a row within the profile's ``max_abs`` can show (module doc)."""
    return 2.0 * profile.max_abs


def _row(label: str, position: int, ref: np.ndarray, ids: np.ndarray, lps: np.ndarray,
         profile: Profile, unnamed: Sequence[int] = ()) -> RowResult:
    """One returned row (``ids`` [k], ``lps`` [k]; -1 pads) against the oracle's logits row ``ref`` [V];
    ``unnamed``: ids the answer cannot name (neither graded nor counted missing)."""
    keep = ids != PAD
    ids, lps = ids[keep], lps[keep]
    V, k, bound = ref.shape[0], ids.shape[0], logprob_bound(profile)
    unnamed_ids = {int(t) for t in unnamed}
    m = {key: None for key in (*empty_metrics(), "logprob_max_abs", "mass_outside", "mass_outside_got")}
    order = np.argsort(-ref, kind="stable")
    res = RowResult(label, position, "pass", None, m, [int(t) for t in order[:SHOWN]], [], "")

    def fail(check: str, message: str) -> RowResult:
        res.status, res.check, res.message = "fail", check, f"{label}: {message}"
        return res

    if k == 0 and unnamed_ids:
        return res  # nothing named: the server's text keys are all shared (nothing to grade on this row)
    if k == 0 or ids.shape != lps.shape or ids.min(initial=0) < 0 or ids.max(initial=0) >= V:
        return fail("shape", f"{k} ids and {lps.shape[0]} logprobs, ids in [0, {V}) needed")
    if len(set(ids.tolist())) != k:
        return fail("shape", f"the returned ids repeat: {ids.tolist()}")
    if not np.isfinite(lps).all() or (lps > 1e-6).any():
        return fail("nonfinite", f"the returned logprobs must be finite and <= 0: {lps.tolist()}")
    mine = np.argsort(-lps, kind="stable")
    res.top_got = [int(ids[j]) for j in mine[:SHOWN]]
    lp = M.log_softmax(ref)
    diff = np.abs(lps - lp[ids])
    top_k = order[:k]
    m.update(logprob_max_abs=float(diff.max()), topk_overlap=float(np.isin(top_k, ids).mean()),
             mass_outside=float(max(0.0, 1.0 - np.exp(lp[ids]).sum())),
             mass_outside_got=float(max(0.0, 1.0 - np.exp(lps).sum())), margin=float(ref[order[0]] - ref[order[1]]))
    j = int(np.argmax(diff))
    if not diff[j] <= bound:
        return fail("logprob", f"logprob {show_value(float(lps[j]))} of token {int(ids[j])}, the oracle's "
                               f"{show_value(float(lp[ids[j]]))}: |difference| {show_value(float(diff[j]))} > "
                               f"{show_threshold(bound)} (2 x max_abs)")
    best = int(ids[mine[0]])
    if m["margin"] > profile.tie_margin and best != int(order[0]) and int(order[0]) not in unnamed_ids:
        return fail("top1", f"the most likely returned token is {best}, the oracle's top-1 is {int(order[0])} "
                            f"(margin {show_value(m['margin'])})")
    floor = float(lps.min())
    accounted = set(ids.tolist()) | unnamed_ids
    missing = [int(t) for t in top_k if int(t) not in accounted and lp[t] > floor + bound]
    if missing:
        return fail("topk", f"token {missing[0]} (oracle logprob {show_value(float(lp[missing[0]]))}) is missing from "
                            f"the returned top {k}, whose least likely has {show_value(floor)}")
    return res


def grade_topk_case(case: Any, groups: Sequence[tuple[str, Sequence[Any]]], got: Sequence[Any],
                    base_logits, profile: Profile) -> CaseGrade:
    """A case graded from top-k logprobs: ``groups`` is ``row_groups(case)``, ``got`` one ``TopLogprobs`` (or None)
    per group, ``base_logits`` base id -> [N, V] oracle logits."""
    rows: list[RowResult] = []
    for (gname, specs), answer in zip(groups, list(got) + [None] * (len(groups) - len(got)), strict=False):
        n = len(specs)
        have = 0 if answer is None else int(np.asarray(answer.ids).shape[0])
        if have != n or (answer is not None and np.asarray(answer.ids).ndim != 2):
            return CaseGrade("fail", "count", f"{gname}: {have} top-k rows returned, the request defines {n}", rows,
                             {}, None)
        ids, lps = np.asarray(answer.ids, dtype=np.int64), np.asarray(answer.logprobs, dtype=np.float64)
        unnamed = getattr(answer, "unnamed", None) or [()] * n
        for i, spec in enumerate(specs):
            rows.append(_row(spec.label, spec.position, np.asarray(base_logits[spec.base][spec.position]), ids[i],
                             lps[i], profile, unnamed[i] if i < len(unnamed) else ()))
    failing = [r for r in rows if r.status == "fail"]
    worst = max((r.metrics["logprob_max_abs"] for r in rows if r.metrics["logprob_max_abs"] is not None),
                default=None)
    summary = {"logprob_max_abs": worst, "mass_outside_max": max(
        (r.metrics["mass_outside"] for r in rows if r.metrics["mass_outside"] is not None), default=None)}
    if failing:
        more = f" (+{len(failing) - 1} more of {len(rows)} rows fail)" if len(failing) > 1 else ""
        return CaseGrade("fail", failing[0].check, failing[0].message + more, rows, summary, None)
    return CaseGrade("pass", None, f"{len(rows)} row{'s' if len(rows) != 1 else ''} pass from top-k logprobs "
                                   f"(logprob max_abs {show_value(worst)} <= {show_threshold(logprob_bound(profile))})",
                     rows, summary, None)
