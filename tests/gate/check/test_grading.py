"""Metrics, profiles and per-row grading (conformance/metrics.py, profiles.py, grading.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from conformance.check import metrics as M
from conformance.check.grading import CHECKS, METRIC_KEYS, grade_case
from conformance.check.profiles import PROFILES, TOLERANCE_FIELDS, Profile, get_profile, with_overrides

try:  # prefer the real types; the grader only uses the contract's attributes
    from conformance.sets.case import Case as _Case
    from conformance.sets.case import RowSpec

    def make_case(generation: bool = False, moe_min_margin: float | None = None) -> _Case:
        return _Case(id="t/full/A", kind="full", base="A", length=0, generation=generation,
                     moe_min_margin=moe_min_margin)
except ImportError:  # pragma: no cover - stand-ins while cases.py is being written
    @dataclasses.dataclass(frozen=True)
    class RowSpec:  # type: ignore[no-redef]
        label: str
        base: str
        position: int
        golden_token: int | None = None

    @dataclasses.dataclass(frozen=True)
    class _Case:  # type: ignore[no-redef]
        id: str
        kind: str
        generation: bool = False
        ties: tuple = ()
        moe_min_margin: float | None = None
        features: tuple = ()

    def make_case(generation: bool = False, moe_min_margin: float | None = None) -> _Case:
        return _Case(id="t/full/A", kind="full", generation=generation, moe_min_margin=moe_min_margin)


V = 256
ALL = list(PROFILES)


def full_groups(base: str, n: int, start: int = 0) -> list:
    return [("logits", [RowSpec(f"row {i}", base, i) for i in range(start, start + n)])]


@pytest.fixture(scope="module")
def bases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    # A: independent rows, softcapped logits of a few units (like the synthetic presets)
    A = 30.0 * np.tanh(rng.normal(0.0, 4.0, (24, V)) / 30.0)
    # S: slowly varying rows: adjacent rows differ by ~0.06 at most, far below any loose max_abs
    c, u = rng.normal(0.0, 3.0, V), rng.normal(0.0, 1.0, V)
    S = c[None, :] + 0.02 * np.arange(25)[:, None] * u[None, :]
    # X: raw logits up to ~60 for the softcap test; the oracle row is 30 tanh(x / 30)
    X = rng.normal(0.0, 8.0, (12, V))
    X[np.arange(12), rng.integers(0, V, 12)] = rng.uniform(62.0, 66.0, 12)  # capped: 29.0..29.3
    return {"A": A, "S": S, "X": X, "Xcap": 30.0 * np.tanh(X / 30.0)}


# =============================================================================================
# metrics against hand computations


def test_closeness_metrics_closed_forms():
    got, ref = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 4.0])
    assert M.max_abs(got, ref) == 1.0
    assert M.argmax_abs(got, ref) == 2
    assert M.max_rel(got, ref) == pytest.approx(0.25)  # 1 / max(4, 1)
    assert M.max_rel(got, ref, floor=10.0) == pytest.approx(0.1)
    assert M.max_rel(np.array([0.5]), np.array([0.0])) == pytest.approx(0.5)  # floored denominator
    assert M.nmse(got, ref) == pytest.approx(1.0 / 21.0)
    assert M.cosine(got, ref) == pytest.approx(17.0 / math.sqrt(14.0 * 21.0))
    # a pure scale error: NMSE eps^2, cosine exactly 1
    r = np.random.default_rng(0).normal(size=64)
    assert M.nmse(1.001 * r, r) == pytest.approx(1e-6, rel=1e-9)
    assert M.cosine(1.001 * r, r) == pytest.approx(1.0, abs=1e-15)
    assert M.cosine(np.array([1.0, 0.0]), np.array([0.0, 2.0])) == 0.0
    assert M.cosine(np.zeros(3), np.zeros(3)) == 1.0 and M.cosine(np.ones(3), np.zeros(3)) == 0.0
    # vectorised over rows
    rows = np.stack([ref, 2 * ref])
    np.testing.assert_allclose(M.nmse(rows + 1.0, rows), [3 / 21, 3 / 84])
    assert M.max_abs(rows + 1.0, rows).shape == (2,)


def test_softmax_and_log_softmax():
    x = np.array([1000.0, 1000.0, -np.inf])
    np.testing.assert_allclose(M.softmax(x), [0.5, 0.5, 0.0])
    y = np.array([[0.1, -2.0, 3.0], [5.0, 5.0, 5.0]])
    np.testing.assert_allclose(M.softmax(y).sum(-1), 1.0)
    np.testing.assert_allclose(M.log_softmax(y), np.log(M.softmax(y)), rtol=1e-14)
    np.testing.assert_allclose(M.log_softmax(y + 123.0), M.log_softmax(y), atol=1e-13)


def test_kl_known_distributions():
    p, q = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert M.kl(np.log(p), np.log(q) + 7.0) == pytest.approx(expected, rel=1e-13)  # logits, any shift
    p3, q3 = np.array([0.7, 0.2, 0.1]), np.array([0.2, 0.5, 0.3])
    expected3 = sum(a * math.log(a / b) for a, b in zip(p3, q3, strict=True))
    assert M.kl(np.log(p3), np.log(q3)) == pytest.approx(expected3, rel=1e-13)
    assert M.kl(np.log(q3), np.log(p3)) != pytest.approx(expected3)  # KL(ref || got): order matters
    assert M.kl(np.log(p3), np.log(p3)) == 0.0
    assert M.kl(np.log(p3), np.log(p3) - 3.0) < 1e-30  # a shift is no difference (rounding of x - 3)
    # rows at once
    np.testing.assert_allclose(M.kl(np.log(np.stack([p3, p3])), np.log(np.stack([q3, p3]))), [expected3, 0.0],
                               rtol=1e-13, atol=1e-300)


def test_kl_is_exact_for_tiny_differences():
    """Second order: KL = var_p(e) / 2 + O(e^3). The stable form keeps that to ~1e-7 relative even at
    KL ~ 1e-15, where sum p (log p - log q) would be rounding noise."""
    rng = np.random.default_rng(3)
    ref = rng.normal(0.0, 3.0, 512)
    e = 1e-7 * rng.normal(size=512)
    p = M.softmax(ref)
    var = float(np.sum(p * e * e) - np.sum(p * e) ** 2)
    assert M.kl(ref, ref - e) == pytest.approx(var / 2, rel=1e-5)


def test_kl_keeps_small_probabilities_and_survives_huge_differences():
    # 100 000 entries at log p ~ -17 (llama.cpp's perplexity tool skips log p < -16) change KL by ~0.02
    ref = np.r_[0.0, np.full(100_000, -17.0)]
    got = np.r_[0.0, np.full(100_000, -10.0)]
    lp, lq = M.log_softmax(ref), M.log_softmax(got)
    exact = math.fsum(np.exp(lp) * (lp - lq))
    skipped = math.fsum((np.exp(lp) * (lp - lq))[lp >= -16.0])
    assert M.kl(ref, got) == pytest.approx(exact, rel=1e-10)
    assert abs(skipped - exact) > 1e-2
    # a returned logit 1000 or 5000 above the rest: KL = 0.5 * D - log 2, finite, both code paths
    for D in (1000.0, 5000.0):
        assert M.kl(np.array([0.0, 0.0]), np.array([0.0, D])) == pytest.approx(0.5 * D - math.log(2), rel=1e-12)


def test_delta_p_top1_margin_topk():
    ref, got = np.log([0.7, 0.2, 0.1]), np.log([0.5, 0.3, 0.2])
    assert M.delta_p(ref, got) == pytest.approx(0.2, rel=1e-12)
    assert M.top1_margin(np.array([1.0, 3.0, 2.5])) == pytest.approx(0.5)
    assert M.top1_margin(np.array([2.0, 2.0, 1.0])) == 0.0
    np.testing.assert_allclose(M.top1_margin(np.array([[1.0, 3.0, 2.5], [0.0, -1.0, 4.0]])), [0.5, 4.0])
    x = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    assert M.topk_ids(x, 2).tolist() == [1, 2]  # ties go to the lower id
    assert M.topk_ids(x, 4).tolist() == [1, 2, 4, 3]
    assert M.top1(np.array([np.nan, 1.0, 1.0])) == 1
    # the partition path (large V) agrees with a stable argsort, ties included
    rng = np.random.default_rng(5)
    big = rng.integers(0, 20, (3, 5000)).astype(float)
    for row in big:
        assert M.topk_ids(row, 7).tolist() == np.argsort(-row, kind="stable")[:7].tolist()
    assert M.topk_ids(big, 3).shape == (3, 3)
    assert M.topk_overlap([1, 2, 3, 4, 5], [5, 4, 9, 1, 8]) == pytest.approx(0.6)
    assert M.topk_overlap([], []) == 1.0


def test_row_identity():
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(6, 32))
    nearest, ratio = M.row_identity(rows[3], rows, 3)
    assert nearest == 3 and math.isfinite(ratio) and ratio > 1e250  # exact match: huge but finite
    assert M.row_identity(rows[4], rows, 3)[0] == 4 and M.row_identity(rows[4], rows, 3)[1] == 0.0
    # ratio = min(d(i-1), d(i+1)) / d(i); at the ends only the existing neighbour counts
    got = rows[2] + 0.01
    d = np.linalg.norm(rows - got, axis=1)
    assert M.row_identity(got, rows, 2)[1] == pytest.approx(min(d[1], d[3]) / d[2])
    got0 = rows[0] + 0.01
    dist = np.linalg.norm
    assert M.row_identity(got0, rows, 0)[1] == pytest.approx(dist(rows[1] - got0) / dist(rows[0] - got0))
    got5 = rows[5] + 0.01
    assert M.row_identity(got5, rows, 5)[1] == pytest.approx(dist(rows[4] - got5) / dist(rows[5] - got5))
    np.testing.assert_allclose(M.row_distances(got, rows, chunk=4), d, rtol=1e-14)  # chunking is invisible
    # larger bases: the candidate search (Gram trick) gives the brute-force answer, exact distances
    big = np.cumsum(rng.normal(size=(60, 32)), axis=0)  # a random walk: adjacent rows close
    for j, noise in ((0, 0.0), (17, 0.3), (59, 0.05), (30, 3.0)):
        got = big[j] + noise * rng.normal(size=32)
        dd = M.row_distances(got, big)
        for pos in (j, max(j - 1, 0), 31):
            nearest, ratio = M.row_identity(got, big, pos)
            assert nearest == int(np.argmin(dd))
            neigh = [dd[k] for k in (pos - 1, pos + 1) if 0 <= k < 60]
            assert ratio == pytest.approx(min(neigh) / max(dd[pos], M.IDENTITY_FLOOR), rel=1e-12)


# =============================================================================================
# profiles

CONTRACT_FIELDS = ["name", "description", "max_abs", "max_rel", "rel_floor", "nmse", "cosine_min", "kl_max",
                   "kl_mean", "delta_p", "tie_margin", "topk", "topk_overlap_min", "identity_ratio", "sources",
                   "scaling"]


def test_profiles_shape_and_order():
    assert [f.name for f in dataclasses.fields(Profile)] == CONTRACT_FIELDS
    assert {"exact-f64", "fp32", "bf16", "fp16-kv", "q8", "q4"} <= set(PROFILES)
    for name, p in PROFILES.items():
        assert p.name == name and p.description and len(p.sources) >= 2
        assert p.tie_margin > 0 and p.topk >= 1 and 0 < p.topk_overlap_min <= 1 and p.identity_ratio >= 1
        assert 0 < p.cosine_min <= 1 and p.kl_mean <= p.kl_max
    # exact-f64 passes float64 rounding only; fp32 separates float32 noise from bugs
    assert PROFILES["exact-f64"].max_abs <= 1e-9 and PROFILES["exact-f64"].nmse <= 1e-18
    assert PROFILES["fp32"].nmse <= 1e-6 and PROFILES["fp32"].max_abs <= 2e-2 and PROFILES["fp32"].kl_max <= 1e-5
    assert PROFILES["exact-f64"].identity_ratio == PROFILES["fp32"].identity_ratio == 10.0
    # looser along the precision ladder
    ladder = [PROFILES[n] for n in ("exact-f64", "fp32", "fp16-kv", "bf16", "q8", "q4")]
    for key in ("max_abs", "nmse", "kl_max", "kl_mean", "delta_p", "tie_margin"):
        values = [getattr(p, key) for p in ladder]
        assert values == sorted(values), key
    json.dumps([p.to_json() for p in PROFILES.values()])


def test_get_profile_and_overrides():
    assert get_profile("fp32") is PROFILES["fp32"]
    assert get_profile(PROFILES["q8"]) is PROFILES["q8"]
    with pytest.raises(ValueError, match=r"unknown profile 'fp33'.*exact-f64.*fp32"):
        get_profile("fp33")
    p = with_overrides("fp32", {"max_abs": 0.05, "kl_mean": 1e-4, "topk": 3})
    assert (p.max_abs, p.kl_mean, p.topk, p.name) == (0.05, 1e-4, 3, "fp32")
    assert PROFILES["fp32"].max_abs == 2e-2  # the registry is untouched
    assert "max_abs 0.02 -> 0.05" in p.sources[-1]
    assert with_overrides(PROFILES["fp32"], {}) is PROFILES["fp32"]
    with pytest.raises(ValueError, match="'max_abz'"):
        with_overrides("fp32", {"max_abz": 1.0})
    with pytest.raises(ValueError, match="'name'"):
        with_overrides("fp32", {"name": "x"})
    for bad in ({"nmse": -1.0}, {"nmse": "big"}, {"nmse": float("nan")}, {"topk": 2.5}, {"kl_max": True}):
        with pytest.raises(ValueError):
            with_overrides("fp32", bad)
    assert "sources" not in TOLERANCE_FIELDS and "max_abs" in TOLERANCE_FIELDS


# =============================================================================================
# grading


def grade(bases, got, profile, groups=None, base="A", case=None):
    groups = groups or full_groups(base, len(bases[base]))
    return grade_case(case or make_case(), groups, got, bases, get_profile(profile))


@pytest.mark.parametrize("profile", ALL)
def test_exact_rows_pass_every_profile(bases, profile):
    for base in ("A", "S", "Xcap"):
        g = grade(bases, [bases[base].copy()], profile, base=base)
        assert g.status == "pass" and g.check is None, g.message
        assert all(r.status == "pass" and r.check is None for r in g.rows)
        assert g.summary["max_abs"] == 0.0 and g.summary["kl_mean"] == 0.0
        assert g.summary["top1_rate"] in (1.0, None)  # None: no decided row at this tie margin
        assert g.first_divergence is None
    # a single interior row, and two groups (prompt row + decode rows), in float32
    groups = [("logits", [RowSpec("row 9", "A", 9)]),
              ("decode", [RowSpec(f"decode {j}", "A", 10 + j) for j in range(3)])]
    got = [bases["A"][9:10].astype(np.float32) if profile != "exact-f64" else bases["A"][9:10], bases["A"][10:13]]
    g = grade(bases, got, profile, groups=groups)
    assert g.status == "pass", g.message
    assert [r.label for r in g.rows] == ["row 9", "decode 0", "decode 1", "decode 2"]


@pytest.mark.parametrize("profile", ALL)
@pytest.mark.parametrize("shift", [1, -1])
def test_shifted_row_fails_identity_even_when_values_are_close(bases, profile, shift):
    S = bases["S"]
    n = len(S) - 1
    positions = np.arange(n) + (1 if shift < 0 else 0)
    got = S[positions + shift]
    g = grade(bases, [got], profile, groups=[("logits", [RowSpec(f"row {i}", "S", int(i)) for i in positions])])
    assert g.status == "fail" and g.check == "identity"
    assert all(r.check == "identity" for r in g.rows)
    p = PROFILES[profile]
    for r in g.rows:
        assert r.metrics["identity_nearest"] == r.position + shift
        assert r.metrics["identity_ratio"] < 1e-6
        assert re.search(rf"nearest to oracle row {r.position + shift}\b.*not to row {r.position}\b", r.message)
    if profile in ("fp16-kv", "bf16", "q8", "q4"):  # a tolerance-only check would have passed these rows
        r = g.rows[len(g.rows) // 2]
        assert r.metrics["max_abs"] < p.max_abs and r.metrics["nmse"] < p.nmse and r.metrics["kl"] < p.kl_max
        assert r.metrics["top1_agree"] == 1.0


@pytest.mark.parametrize("profile", ALL)
def test_shifted_row_with_noise_fails_identity(bases, profile):
    S = bases["S"]
    noise = np.random.default_rng(2).normal(0.0, 1e-4, (len(S) - 1, V))
    g = grade(bases, [S[1:] + noise], profile, groups=full_groups("S", len(S) - 1))
    assert g.check == "identity" and all(r.check == "identity" for r in g.rows)


@pytest.mark.parametrize("profile", ALL)
def test_dropped_softcap_fails_on_closeness_not_top1(bases, profile):
    g = grade(bases, [bases["X"]], profile, base="Xcap")
    assert g.status == "fail"
    assert g.check in ("max_abs", "max_rel", "nmse")
    for r in g.rows:
        assert r.status == "fail" and r.check in ("max_abs", "max_rel", "nmse"), r.message
        assert r.metrics["top1_agree"] == 1.0  # softcap is monotone: argmax-only checks cannot see it
        assert r.metrics["identity_nearest"] == r.position
        assert r.metrics["max_abs"] > 25.0


def test_nonfinite(bases):
    A = bases["A"]
    for bad in (np.nan, np.inf, -np.inf):
        got = A.copy()
        got[5, 17] = bad
        g = grade(bases, [got], "q4")
        assert g.check == "nonfinite" and g.rows[5].check == "nonfinite"
        assert "token 17" in g.rows[5].message and "where the oracle is finite" in g.rows[5].message
        assert [r.status for i, r in enumerate(g.rows) if i != 5] == ["pass"] * (len(A) - 1)
        assert g.rows[5].metrics["max_abs"] == 0.0  # the other columns are still measured
    # suppressed tokens: the same -inf on both sides is fine; a finite value there is not
    Ainf = A.copy()
    Ainf[:, 3] = -np.inf
    bases2 = {"A": Ainf}
    g = grade(bases2, [Ainf.copy()], "exact-f64")
    assert g.status == "pass", g.message
    got = Ainf.copy()
    got[2, 3] = -50.0
    g = grade(bases2, [got], "q4")
    assert g.check == "nonfinite" and "where the oracle is -inf" in g.rows[2].message


def test_count_and_shape(bases):
    A = bases["A"]
    groups = [("logits", [RowSpec(f"row {i}", "A", i) for i in range(4)]),
              ("decode", [RowSpec(f"decode {j}", "A", 4 + j) for j in range(3)])]
    g = grade(bases, [A[:4], A[4:6]], "fp32", groups=groups)  # one decode row missing
    assert g.status == "fail" and g.check == "count"
    assert [r.check for r in g.rows] == [None] * 4 + ["count"] * 3
    assert "returned 2 rows, expected 3" in g.rows[4].message
    g = grade(bases, [A[:4], None], "fp32", groups=groups)  # nothing for the decode group
    assert g.check == "count" and "no rows returned for group 'decode'" in g.message
    g = grade(bases, [A[:4]], "fp32", groups=groups)  # a missing trailing entry is None
    assert g.check == "count"
    g = grade(bases, [A[:4].ravel(), A[4:7]], "fp32", groups=groups)
    assert [r.check for r in g.rows] == ["count"] * 4 + [None] * 3
    # a count failure in a later group leads the case even when an earlier row failed otherwise
    bad = A[:4].copy()
    bad[0, 0] += 1.0
    g = grade(bases, [bad, None], "fp32", groups=groups)
    assert g.check == "count" and g.rows[0].check == "max_abs"
    # vocabulary size
    g = grade(bases, [A[:, :-1]], "fp32")
    assert g.check == "shape" and all(r.check == "shape" for r in g.rows)
    assert f"vocabulary size {V - 1} != oracle's {V}" in g.rows[0].message


def test_float32_noise_passes_fp32_fails_exact(bases):
    for base in ("A", "Xcap"):
        ref = bases[base]
        got = ref + np.random.default_rng(11).normal(0.0, 1e-5, ref.shape)
        g = grade(bases, [got], "fp32", base=base)
        assert g.status == "pass", g.message
        g = grade(bases, [got], "exact-f64", base=base)
        assert g.status == "fail" and g.check == "max_abs"
        # rounding to float32 only: still far from exact-f64's bar
        g = grade(bases, [ref.astype(np.float32)], "exact-f64", base=base)
        assert g.check == "max_abs"


def test_fp32_catches_a_subtle_error(bases):
    """Errors far below any argmax effect but well above float32 noise (NMSE ~1e-10) fail fp32."""
    A = bases["A"]
    signs = np.where(np.random.default_rng(12).random(A.shape) < 0.5, -1.0, 1.0)
    # 6e-3 on every logit: within fp32's max_abs (2e-2), NMSE ~2e-6
    g = grade(bases, [A + 6e-3 * signs], "fp32")
    assert g.status == "fail" and g.check == "nmse" and all(r.check == "nmse" for r in g.rows)
    assert all(r.metrics["max_abs"] < 2e-2 and r.metrics["top1_agree"] == 1.0 for r in g.rows)
    # a 0.1% scale error (a norm weight read as bf16, say)
    g = grade(bases, [A * 1.001 + 1e-3], "fp32")
    assert g.status == "fail" and g.check in ("max_abs", "nmse")
    assert grade(bases, [A + 6e-3 * signs], "fp16-kv").status == "pass"
    assert grade(bases, [A * 1.001 + 1e-3], "fp16-kv").status == "pass"


def test_message_format(bases):
    A = bases["A"]
    got = A.copy()
    got[9] += 6e-3 * np.where(np.arange(V) % 2 == 0, 1.0, -1.0)
    g = grade(bases, [got], "fp32")
    assert g.check == "nmse"
    msg = g.rows[9].message
    assert re.fullmatch(r"row 9: nmse \d\.\de-06 > 1e-06 \(max_abs [0-9.]+(e-0\d)? at token \d+: got -?[0-9.]+, "
                        r"oracle -?[0-9.]+\)", msg), msg
    assert g.message.startswith("row 9: nmse")


def test_decided_rows_only_for_top1():
    rng = np.random.default_rng(4)
    base = rng.normal(0.0, 2.0, (4, V))
    order = np.argsort(-base, axis=1)
    # row 0: near tie (margin 0.01 < fp32 tie_margin 0.05); row 1: decided (margin 1.0)
    for i, margin in ((0, 0.01), (1, 1.0)):
        base[i, order[i, 0]] = base[i, order[i, 1]] + margin
    swapped = base.copy()
    for i in (0, 1):
        a, b = order[i, 0], order[i, 1]
        swapped[i, a], swapped[i, b] = base[i, b], base[i, a]
    loose = with_overrides("fp32", {k: 1e9 for k in ("max_abs", "max_rel", "nmse", "kl_max", "kl_mean", "delta_p")}
                           | {"cosine_min": 0.0, "topk_overlap_min": 0.0})
    g = grade({"B": base}, [swapped], loose, base="B")
    assert [r.metrics["top1_agree"] for r in g.rows] == [0.0, 0.0, 1.0, 1.0]
    assert g.rows[0].status == "pass"  # undecided: a flip is rounding
    assert g.rows[1].check == "top1" and "rank 2" in g.rows[1].message
    assert g.summary["top1_rate"] == pytest.approx(2 / 3)  # decided rows only
    # the near-tie flip alone passes even the plain fp32 profile
    only0 = base.copy()
    only0[0] = swapped[0]
    assert grade({"B": base}, [only0], "fp32", base="B").status == "pass"


def test_topk_is_tie_aware():
    rng = np.random.default_rng(6)
    ref = rng.normal(0.0, 1.0, V)
    ids = np.argsort(-ref)
    ref[ids[0]] = ref[ids[1]] + 3.0  # decided
    ref[ids[4]] = ref[ids[5]] + 1e-3  # ranks 5 and 6 are a near tie
    loose = with_overrides("fp32", {k: 1e9 for k in ("max_abs", "max_rel", "nmse", "kl_max", "kl_mean", "delta_p")}
                           | {"cosine_min": 0.0})
    swapped = ref.copy()
    swapped[ids[4]], swapped[ids[5]] = ref[ids[5]], ref[ids[4]]
    g = grade({"B": ref[None]}, [swapped[None]], loose, base="B")
    assert g.status == "pass" and g.rows[0].metrics["topk_overlap"] == pytest.approx(0.8)
    pushed = ref.copy()
    pushed[ids[2]] = ref.min() - 1.0  # a clearly top-5 token drops out
    g = grade({"B": ref[None]}, [pushed[None]], loose, base="B")
    assert g.check == "topk" and "overlap 0.8 < 1" in g.message


def _generation_base():
    rng = np.random.default_rng(8)
    base = rng.normal(0.0, 2.0, (8, V))
    top = np.argsort(-base, axis=1)
    for i in range(8):
        base[i, top[i, 0]] = base[i, top[i, 1]] + (1e-3 if i == 3 else 2.0)  # step 2 (row 3): a near tie
    return base, top


def _generation_groups(base):
    golden = M.top1(base)
    return [("logits", [RowSpec("row 1", "G", 1, int(golden[1]))]),
            ("decode", [RowSpec(f"decode {j}", "G", 2 + j, int(golden[2 + j])) for j in range(5)])]


def test_generation_first_divergence():
    base, top = _generation_base()
    groups = _generation_groups(base)
    case = make_case(generation=True)

    def flip(got, row):
        a, b = top[row, 0], top[row, 1]
        got[row - 1, a], got[row - 1, b] = base[row, b], base[row, a]

    got = base[1:7].copy()
    g = grade_case(case, groups, [got[:1], got[1:]], {"G": base}, PROFILES["fp32"])
    assert g.status == "pass" and g.first_divergence is None
    flip(got, 3)  # the near-tie step: a flipped argmax there is not a divergence
    g = grade_case(case, groups, [got[:1], got[1:]], {"G": base}, PROFILES["fp32"])
    assert g.status == "pass" and g.first_divergence is None, g.message
    flip(got, 5)  # decided: decode 3, step 4 of the concatenated rows
    flip(got, 6)
    g = grade_case(case, groups, [got[:1], got[1:]], {"G": base}, PROFILES["fp32"])
    assert g.status == "fail" and g.first_divergence == 4
    assert "generation diverges at step 4 (decode 3)" in g.message
    # not a generation case: no first_divergence
    g = grade_case(make_case(), groups, [got[:1], got[1:]], {"G": base}, PROFILES["fp32"])
    assert g.first_divergence is None and g.status == "fail"


def test_generation_check_when_rows_pass():
    """Rows equal to the oracle but a golden token that is not its argmax: a case-level failure."""
    base, _ = _generation_base()
    groups = _generation_groups(base)
    specs = list(groups[1][1])
    wrong = (specs[1].golden_token + 1) % V
    groups = [groups[0], ("decode", [specs[0], dataclasses.replace(specs[1], golden_token=wrong)] + specs[2:])]
    g = grade_case(make_case(generation=True), groups, [base[1:2], base[2:7]], {"G": base}, PROFILES["exact-f64"])
    assert all(r.status == "pass" for r in g.rows)
    assert g.status == "fail" and g.check == "generation" and g.first_divergence == 2


def test_kl_mean_case_check(bases):
    A = bases["A"]
    got = A + np.random.default_rng(9).normal(0.0, 1e-4, A.shape)
    p = with_overrides("fp32", {"kl_mean": 1e-12})
    g = grade(bases, [got], p)
    assert all(r.status == "pass" for r in g.rows)
    assert g.status == "fail" and g.check == "kl_mean" and g.message.startswith("kl_mean ")
    assert g.summary["kl_mean"] > 1e-12 and g.summary["kl_max"] >= g.summary["kl_p99"] >= g.summary["kl_mean"]


def test_moe_near_tie_note(bases):
    A = bases["A"]
    bad = A + 0.5
    g = grade(bases, [bad], "fp32", case=make_case(moe_min_margin=2e-4))
    assert g.status == "fail" and "MoE router near-tie" in g.message and "2.0e-04" in g.message
    assert "MoE" not in grade(bases, [bad], "fp32", case=make_case(moe_min_margin=0.3)).message
    assert "MoE" not in grade(bases, [A], "fp32", case=make_case(moe_min_margin=2e-4)).message


def test_results_are_json_serialisable(bases):
    A = bases["A"]
    got = A.copy()
    got[1, 1] = np.nan
    groups = [("logits", [RowSpec(f"row {i}", "A", i) for i in range(3)]), ("decode", [RowSpec("decode 0", "A", 3)])]
    for g in (grade(bases, [A[:1]], "fp32", groups=[("logits", [RowSpec("only", "A", 0)])]),
              grade(bases, [got[:3], None], "fp32", groups=groups),
              grade(bases, [A[:3, :-1], A[3:4]], "q4", groups=groups),
              grade(bases, [A], "exact-f64")):
        text = json.dumps(g.to_json(), allow_nan=False)
        back = json.loads(text)
        assert set(back) == {"status", "check", "message", "rows", "summary", "first_divergence"}
        for r in back["rows"]:
            assert set(r["metrics"]) == set(METRIC_KEYS)
            assert r["check"] in (None, *CHECKS)
            assert all(v is None or isinstance(v, (int, float)) for v in r["metrics"].values())
            assert len(r["top_ref"]) == 5
    g = grade(bases, [A[:1]], "fp32", groups=[("logits", [RowSpec("only", "A", 0)])])
    assert isinstance(g.rows[0].metrics["identity_nearest"], int)
    single = grade({"one": A[:1]}, [A[:1]], "fp32", groups=[("logits", [RowSpec("row 0", "one", 0)])])
    assert single.status == "pass" and single.rows[0].metrics["identity_ratio"] is None  # no neighbour


def test_unknown_base_is_a_harness_error(bases):
    with pytest.raises(KeyError, match="no oracle logits for base 'Z'"):
        grade(bases, [bases["A"][:1]], "fp32", groups=[("logits", [RowSpec("row 0", "Z", 0)])])


# =============================================================================================
# calibration on the real oracle (tiny preset, fixed 40-token base)


@pytest.fixture(scope="module")
def oracle_rows(tmp_path_factory):
    from refimpl.model import Gemma4, KVCache
    from refimpl.synth import write_checkpoint

    path = write_checkpoint("e2b-mini", 0, tmp_path_factory.mktemp("grading") / "e2b", dtype="f32")
    ids = np.concatenate([[2], np.random.default_rng(21).integers(3, 512, 39)])
    m64 = Gemma4(path)
    full = m64.forward(ids, rows="all")
    cache = KVCache()
    chunked = np.concatenate([m64.forward(ids[:13], cache=cache, rows="all"),
                              m64.forward(ids[13:31], cache=cache, rows="all")]
                             + [m64.forward(ids[t:t + 1], cache=cache, rows="all") for t in range(31, 40)])
    f32 = Gemma4(path, dtype="float32").forward(ids, rows="all")
    return {"full": full, "chunked": chunked, "f32": f32}


def test_oracle_against_itself_passes_exact_f64(oracle_rows):
    base = {"A": oracle_rows["full"]}
    assert not np.array_equal(oracle_rows["chunked"], oracle_rows["full"])  # rounding differs ...
    g = grade(base, [oracle_rows["chunked"]], "exact-f64")
    assert g.status == "pass", g.message  # ... by float64 rounding only
    assert g.summary["max_abs"] < 1e-11


def test_oracle_in_float32_passes_fp32_not_exact(oracle_rows):
    base = {"A": oracle_rows["full"]}
    g = grade(base, [oracle_rows["f32"]], "fp32")
    assert g.status == "pass", g.message
    assert g.summary["nmse_max"] < 1e-8
    assert min(r.metrics["identity_ratio"] for r in g.rows) > 1e3
    assert grade(base, [oracle_rows["f32"]], "exact-f64").check == "max_abs"
    for name in ("fp16-kv", "bf16", "q8", "q4"):
        assert grade(base, [oracle_rows["f32"]], name).status == "pass"


def test_a_base_is_scanned_once_for_the_cases_that_grade_against_it(monkeypatch):
    """The finite columns of a base's oracle rows (a pass over all of them) are found once for every case graded
    against that array, again for a new array, and the cases grade as they did alone (issue 55: repeated work)."""
    rng = np.random.default_rng(5)
    scans: list[tuple] = []
    isfinite = np.isfinite

    def counted(x, *args, **kwargs):
        if np.shape(x) == (24, V):
            scans.append(np.shape(x))
        return isfinite(x, *args, **kwargs)

    def grade_three(bases, target: np.ndarray) -> list[str]:
        grades = []
        for first in (0, 9, 18):  # three cases of 4 rows, each against the array bases() gives
            got = target[first : first + 4] + 1e-13
            grades.append(json.dumps(grade_case(make_case(), full_groups("A", 4, first), [got], {"A": bases()},
                                                PROFILES["exact-f64"]).to_json(), sort_keys=True))
        return grades

    base = 30.0 * np.tanh(rng.normal(0.0, 4.0, (24, V)) / 30.0)
    alone = grade_three(base.copy, base)  # each case against its own copy of the base
    monkeypatch.setattr(np, "isfinite", counted)
    shared = grade_three(lambda: base, base)
    assert len(scans) == 1 and shared == alone
    assert json.loads(shared[0])["status"] == "pass"
    other = base.copy()
    shifted = grade_three(lambda: other, np.roll(base, 1, axis=0))  # a new array, scanned again; rows shifted
    assert len(scans) == 2 and [json.loads(g)["status"] for g in shifted] == ["fail"] * 3
