"""``conformance loss`` (conformance/loss): the quantisation loss on the same rows, a quantised set against the
unquantised set of the same model, and an engine against both.

The bundled GGUF set (e2b-256-mini-q4km: llama.cpp's own Q4_K_M file of the e2b-256-mini preset, seed 0) and the
bundled e2b-256-mini set hold the same cases on the same prompts. The per-row numbers are checked against a plain
formula on the sets' stored logits (log-softmax by numpy's logaddexp, not the gate's metrics); the oracle backend
under the quantised set's convention is the quantised oracle itself, so its loss against the reference is the
quantisation's and its loss against the quantised oracle is rounding; thresholds make it a verdict with the usual
exit codes."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.cli import main
from conformance.loss import LossError, Thresholds, loss_run, pair_cases
from conformance.sets import bundled_set, load_set
from conformance.sets.case import row_groups

Q, REF = "e2b-256-mini-q4km", "e2b-256-mini"


@pytest.fixture(scope="module")
def sets():
    return load_set(bundled_set(Q)), load_set(bundled_set(REF))


@pytest.fixture(scope="module")
def oracle_only(sets):
    return loss_run(*sets)


def _plain(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(KL, same top-1, delta_p) per row by the textbook formulas."""
    lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    lq = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    t = np.argmax(ref, axis=-1)
    rows = np.arange(len(ref))
    return kl, np.argmax(ref, axis=-1) == np.argmax(got, axis=-1), np.abs(np.exp(lq[rows, t]) - np.exp(lp[rows, t]))


def test_the_quantisation_loss_is_the_plain_formula_on_the_stored_rows(sets, oracle_only):
    """Every case of the quantised set is compared; each case's KL mean / p99 / max, same top-1 %, delta_p RMS and
    max_abs equal the plain formulas on the two sets' stored logits (to 1e-12 relative), and the total is the
    same over every row of every case."""
    q, ref = sets
    qlog, rlog = q.base_logits(), ref.base_logits()
    assert [c.id for c in oracle_only.cases] == [c.id for c in q.cases if c.kind != "mtp"]
    assert oracle_only.backend is None and all(c.engine == "none" for c in oracle_only.cases)
    all_kl, all_top, all_dp = [], [], []
    for got in oracle_only.cases:
        case = next(c for c in q.cases if c.id == got.id)
        specs = [s for _, g in row_groups(case) for s in g]
        a = np.stack([rlog[s.base][s.position] for s in specs])
        b = np.stack([qlog[s.base][s.position] for s in specs])
        kl, top, dp = _plain(a, b)
        ma = np.max(np.abs(a - b), axis=-1)
        loss = got.loss["quantisation"]
        assert loss["rows"] == got.rows == len(specs)
        assert loss["kl_mean"] == pytest.approx(np.mean(kl), rel=1e-9)
        assert loss["kl_max"] == pytest.approx(np.max(kl), rel=1e-9)
        assert loss["top1_same_pct"] == pytest.approx(100 * np.mean(top))
        assert loss["dp_rms"] == pytest.approx(np.sqrt(np.mean(dp ** 2)), rel=1e-9)
        assert loss["max_abs"] == pytest.approx(np.max(ma), rel=1e-12)
        all_kl += list(kl)
        all_top += list(top)
        all_dp += list(dp)
    total = oracle_only.total["quantisation"]
    assert total["rows"] == len(all_kl) and total["kl_mean"] == pytest.approx(np.mean(all_kl), rel=1e-9)
    assert total["kl_p99"] == pytest.approx(np.percentile(all_kl, 99), rel=1e-9)
    assert total["dp_rms"] == pytest.approx(np.sqrt(np.mean(np.square(all_dp))), rel=1e-9)
    assert total["top1_same_pct"] == pytest.approx(100 * np.mean(all_top))
    assert total["kl_mean"] > 1e-3  # Q4_K_M on random weights costs something
    assert set(oracle_only.total) == {"quantisation"} and oracle_only.exit_code == 0


def test_a_set_against_itself_loses_nothing(sets):
    q, _ = sets
    run = loss_run(q, q)
    t = run.total["quantisation"]
    assert (t["kl_max"], t["top1_same_pct"], t["dp_rms"], t["max_abs"]) == (0.0, 100.0, 0.0, 0.0)


def test_the_quantised_oracle_as_the_engine(sets, oracle_only):
    """The oracle backend under the quantised set's convention computes the quantised oracle: its rows are the
    quantised oracle's to rounding (engine-vs-quantised), so against the reference it loses what the quantisation
    does (engine-vs-reference equals quantisation); the cases needing the embeddings entry are answered too."""
    q, ref = sets
    run = loss_run(q, ref, RefimplBackend(activations=q.activations))
    assert {c.engine for c in run.cases} == {"ok"} and run.backend == RefimplBackend(activations=q.activations).name
    assert run.total["engine-vs-quantised"]["max_abs"] < 1e-9
    for key in ("kl_mean", "kl_p99", "kl_max", "dp_rms", "max_abs"):
        assert run.total["engine-vs-reference"][key] == pytest.approx(oracle_only.total["quantisation"][key],
                                                                      rel=1e-7)


def test_a_backend_that_does_not_follow_the_convention_claims_nothing(sets):
    q, ref = sets
    run = loss_run(q, ref, RefimplBackend())
    assert {c.engine for c in run.cases} == {"not-claimed"}
    assert run.cases[0].message == ("needs activation_conventions=ggml-cpu/x86/f16-kv/gelu-table (not claimed by "
                                    "the backend)")
    assert set(run.total) == {"quantisation"}


def test_sets_that_do_not_pair_are_refused(sets):
    q, _ = sets
    vision = load_set(bundled_set("e2b-vision-mini"))
    with pytest.raises(LossError, match=r"^the reference set e2b-vision-mini does not hold \d+ of the 52 cases of "
                                        r"e2b-256-mini-q4km \(first: e2b-256-mini-q4km/"):
        pair_cases(q, vision)
    assert pair_cases(q, q)[1] == {b: len(t) for b, t in q.bases().items()}


def test_thresholds_make_a_verdict(sets, oracle_only, tmp_path, capsys):
    """No threshold: information, exit 0. A limit the measured loss keeps: pass, exit 0. One it exceeds: fail,
    exit 1, the breach named in the console, the JSON and the Markdown."""
    kl = oracle_only.total["quantisation"]["kl_mean"]
    assert Thresholds(max_kl=kl * 2).breaches(oracle_only.total["quantisation"]) == []
    argv = ["loss", "--fixtures", str(bundled_set(Q)), "--reference", str(bundled_set(REF)), "-q"]
    assert main([*argv, "--json", str(tmp_path / "info.json")]) == 0
    info = json.loads((tmp_path / "info.json").read_text())
    assert (info["schema"], info["verdict"], info["exit_code"]) == ("gemma4-conformance-loss", "info", 0)
    assert info["reference"]["name"] == REF and info["quantised"]["activations"] == "ggml-cpu/x86/f16-kv/gelu-table"
    assert main([*argv, "--max-kl", f"{2 * kl}", "--min-top1", "90"]) == 0
    assert "pass: every comparison against the reference keeps within the thresholds" in capsys.readouterr().out
    code = main([*argv, "--max-kl", f"{kl / 2}", "--json", str(tmp_path / "f.json"), "--summary-md",
                 str(tmp_path / "f.md")])
    out = capsys.readouterr().out
    assert code == 1
    breach = f"quantisation: kl_mean {kl:.4g} > {kl / 2:g}"
    assert f"fail: {breach}" in out and f"**fail: {breach}**" in (tmp_path / "f.md").read_text()
    report = json.loads((tmp_path / "f.json").read_text())
    assert report["verdict"] == "fail" and report["breaches"]["quantisation"] == [breach.split(": ", 1)[1]]


def test_usage_errors_are_one_line(tmp_path, capsys):
    argv = ["loss", "--fixtures", str(bundled_set(Q)), "--reference", str(bundled_set("e2b-vision-mini")), "-q"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("conformance: error: the reference set e2b-vision-mini does not hold")
    assert main(["loss", "--fixtures", str(bundled_set(Q)), "--reference", str(bundled_set(REF)),
                 "--backend-option", "dtype=float32"]) == 2
    assert capsys.readouterr().err.strip() == "conformance: error: --backend-option needs --backend"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the plot extra)")
def test_the_plot_is_written(tmp_path, capsys):
    out = tmp_path / "loss.png"
    assert main(["loss", "--fixtures", str(bundled_set(Q)), "--reference", str(bundled_set(REF)), "-q",
                 "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
