"""The PLE-fold trap (issue 57; docs/bug-classes.md, "The PLE-fold trap").

llama.cpp's PLE simplification folds the per-layer context's scale s = H^-1/2 into its RMSNorm's eps
(RMSNorm(s y; eps) = RMSNorm(y; eps / s^2)) and the 2^-1/2 into the norm weight and sqrt(P). Folded with the eps
kept, or with eps / s, the result differs only where the context is near eps. The preset ``e2b-ple-eps-mini`` (the
e2b-mini weights, the embedding rows of a band of ordinary ids a thousandth of the others) puts it there. Here:
the checkpoint does (measured on it, not assumed), both wrong folds pass every other bundled PLE set at fp32 and
die on the new one, and the fold done right passes at exact-f64 on both.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from conformance import selftest as st
from conformance.selftest.mutants import CLOSENESS, MUTANTS, PLE_EPS_SET, REWRITES
from conformance.sets import bundled_sets, load_set
from refimpl.model import Gemma4
from refimpl.synth import PRESETS, write_checkpoint

WRONG = [m for m in MUTANTS if m.name in ("ple-fold-eps-kept", "ple-fold-eps-over-s")]


def _ple_sets() -> list:
    """The bundled sets of a synthetic checkpoint with PLE, stored as logits, from the float weights (the sets of
    quantised checkpoints need a backend that reads their format): where a PLE fold could show."""
    out = []
    for path in bundled_sets():
        model = json.loads((path / "manifest.json").read_text())["model"]
        preset = PRESETS.get(model.get("preset"), {})
        if model.get("kind") == "synthetic" and preset.get("hidden_size_per_layer_input", 0) > 0 \
                and not model.get("quantisation"):
            out.append(path)
    return out


def test_the_quiet_rows_put_the_per_layer_context_near_eps(tmp_path):
    """On the preset's checkpoint: the quiet ids' per-layer context (before its norm) has a mean square within a
    decade of eps, every other id's at least 1e4 eps; the random bases draw quiet ids."""
    write_checkpoint(PLE_EPS_SET, 0, tmp_path / "m")
    model = Gemma4(tmp_path / "m")
    cfg, w = model.cfg, model.weights
    quiet = PRESETS[PLE_EPS_SET]["quiet_rows"]
    E = np.asarray(w["embed_tokens.weight"], dtype=np.float64)
    H, L, P = cfg.hidden_size, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
    ctx = (E * H**0.5) @ np.asarray(w["per_layer_model_projection.weight"], dtype=np.float64).T * H**-0.5
    mean_sq = (ctx.reshape(len(E), L, P) ** 2).mean(axis=-1)  # [V, L]
    ids = np.arange(len(E))
    inside = (ids >= quiet["first"]) & (ids < quiet["stop"])
    eps = cfg.rms_norm_eps
    assert 0.1 * eps < np.median(mean_sq[inside]) < 10 * eps
    assert mean_sq[~inside].min() > 1e4 * eps
    fs = load_set(next(p for p in bundled_sets() if p.name == PLE_EPS_SET))
    drawn = np.concatenate([np.asarray(fs.bases()[b]) for b in fs.bases()])
    assert np.count_nonzero((drawn >= quiet["first"]) & (drawn < quiet["stop"])) >= 10


def test_the_wrong_folds_pass_every_other_ple_set_and_die_on_the_quiet_rows():
    """The reason the set exists: at fp32 (the self-test's profile) both wrong folds pass every text case of every
    other bundled PLE set; one image prompt of e2b-vision-mini and one video prompt of e2b-vision-mini-video, whose
    soft tokens' per-layer context is ~500 eps and more, fail them by a hair (the image one max_abs 0.022-0.025
    against fp32's 0.02, measured); the new set kills them on most of its cases, by closeness. The suite's
    longest test (about 80 s on two cores): both wrong folds over every case of the other PLE sets, 300 and more,
    because "passes everywhere else" is the claim, and a sample would not show it."""
    others = [p for p in _ple_sets() if p.name != PLE_EPS_SET]
    assert {"e2b-mini", "e4b-mini", "all-features"} <= {p.name for p in others}
    everywhere = [dataclasses.replace(m, kill_sets=()) for m in WRONG]
    result = st.run_selftest(others, everywhere, profiles=("fp32",))
    assert result.valid and result.cases > 300
    for m in result.mutants:
        assert m.verdict.cases_run == result.cases
        failing = [case for case, _ in m.verdict.failing]
        assert len(failing) <= 3 and all(c.startswith(("e2b-vision-mini/", "e2b-vision-mini-video/"))
                                         and ("/I" in c or "/V" in c) for c in failing), failing
    quiet = next(p for p in bundled_sets() if p.name == PLE_EPS_SET)
    result = st.run_selftest([quiet], WRONG, profiles=("fp32",))
    assert result.exit_code == 0, result.problems()
    for m in result.mutants:
        assert m.killed and m.matching and m.caught_by[1] in CLOSENESS
        assert set(m.verdict.checks) <= CLOSENESS | {"identity"}  # (a row so far off it is nearest another)
        assert m.verdict.failing_cases > m.verdict.cases_run // 2


def test_the_right_fold_passes_at_exact_f64_where_the_wrong_ones_die():
    """The control of the trap: the fold done right (eps / s^2) is a rewrite, not a bug: it passes at exact-f64 on
    the new set and on e2b-mini, beside the wrong folds killed, and the self-test's table says so."""
    (right, reason), = REWRITES.values()
    sets = [p for p in bundled_sets() if p.name in (PLE_EPS_SET, "e2b-mini")]
    result = st.run_selftest(sets, WRONG, rewrites=[(right, reason)])
    assert result.exit_code == 0, result.problems()
    rw = next(m for m in result.mutants if m.rewrite is not None)
    assert rw.name == "ple-fold-right" and not rw.verdicts["exact-f64"].killed
    assert rw.verdicts["exact-f64"].cases_run == result.cases
    assert result.survivors("fp32") == []  # a rewrite is not a survivor
    table = st.format_table(result, breaks_width=None)
    assert "(rewrite) ple-fold-right" in table and "exact-f64: passes" in table
    assert "the rewrites pass at exact-f64: ple-fold-right" in st.console_summary(result)


def test_a_rewrite_that_fails_is_a_problem():
    """Graded like the control: a 'rewrite' that is not the same function (the eps kept) fails the self-test."""
    wrong = WRONG[0]
    sets = [p for p in bundled_sets() if p.name == PLE_EPS_SET]
    result = st.run_selftest(sets, [], rewrites=[(wrong, "not the same function")], select=r"/full/")
    (m,) = result.mutants
    assert m.rewrite is not None and m.verdicts["exact-f64"].killed
    assert result.exit_code == 1
    (problem,) = result.problems()
    assert problem.startswith("rewrite 'ple-fold-eps-kept' (the same function: ") and "exact-f64" in problem
    assert "FAILED" in st.format_table(result)

