"""Traces, ``conformance explain`` and the check's diagnosis line (issue: where does it go wrong).

* The numpy engine's traces agree with the oracle's at every point, within the float64 rounding the check
  allows (the rounding-scaled exact-f64 profile of the case), over every entry point, image and audio
  prompts and decode; both return the same points.
* A checkpoint with one weight of one layer scaled by 1.01 in the backend's copy: explain names that layer
  and sub-block (attention through q_norm, feed-forward through gate_proj, the per-layer-input block through
  its gate).
* The traces survive the subprocess protocol; a backend without traces is compared on logits and told so.
* ``conformance explain`` on mutants names the point where their code changed; the diagnosis line of
  ``conformance check`` names their bug class among at most three (``conformance.explain.mutants``, the full
  list in docs/bug-classes.md); ``-v`` lists every failing row.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.policy import case_profile
from conformance.check.profiles import PROFILES
from conformance.check.requests import build_request, response_groups, trace_groups
from conformance.check.session import Checkpoints, Session
from conformance.check.traces import compare_traces, point_errors
from conformance.cli import main
from conformance.explain import explain, row_roles
from conformance.explain.mutants import locate
from conformance.protocol.trace import point_names, split_point
from conformance.selftest.backend import NumpyEngineBackend
from conformance.selftest.mutants import mutant
from conformance.sets.bundled import bundled_sets
from conformance.sets.integrity import load_set

SETS = {p.name: p for p in bundled_sets()}


class NoTraces(RefimplBackend):
    """The oracle without the traces capability (a backend that serves none)."""

    def __init__(self):
        super().__init__()
        self.capabilities = dataclasses.replace(self.capabilities, traces=False)


@pytest.fixture(scope="module")
def opened():
    """{set name: (fs, oracle backend and context, numpy-engine backend and context)}, opened lazily."""
    tmp = tempfile.TemporaryDirectory()
    checkpoints = Checkpoints(tmp.name)
    cache = {}

    def get(name: str):
        if name not in cache:
            fs = load_set(SETS[name])
            o, e = Session(RefimplBackend(), checkpoints), Session(NumpyEngineBackend(), checkpoints)
            cache[name] = fs, (o.backend, o.enter(fs)), (e.backend, e.enter(fs))
        return cache[name]

    yield get
    tmp.cleanup()


def traced(backend, ctx, case):
    request = build_request(case, ctx.bases, ctx.embed, ctx.media, ctx.drafter)
    return backend.run(dataclasses.replace(request, trace=True))


@pytest.mark.parametrize("name", ["e2b-mini", "26b-a4b-mini", "e2b-vision-mini", "e2b-audio-mini", "12b-mini"])
def test_numpy_engine_traces_match_the_oracle(opened, name):
    fs, (oracle, octx), (engine, ectx) = opened(name)
    cases = [c for c in fs.cases if c.kind != "mtp"][::7]
    kinds = set()
    for case in cases:
        ref, got = traced(oracle, octx, case), traced(engine, ectx, case)
        floor = case_profile(PROFILES["exact-f64"], octx, case).nmse
        rt, gt = trace_groups(case, ref), trace_groups(case, got)
        assert len(rt) == len(gt)
        for r, g in zip(rt, gt, strict=True):
            assert set(r) == set(g)  # the same points
            assert "embed" in r and "final_norm" in r and "layers.0.attn_out" in r
            for point in r:
                assert np.asarray(g[point]).shape == np.asarray(r[point]).shape, point
                assert point_errors(point, g[point], r[point]).max() <= floor, (case.id, point)
        kinds.add(case.kind)
    assert {"full", "last", "prefill"} <= kinds or name in ("e2b-vision-mini", "e2b-audio-mini", "12b-mini")


def test_trace_vocabulary_covers_the_oracle(opened):
    fs, (oracle, octx), _ = opened("26b-a4b-mini")
    got = traced(oracle, octx, fs.cases[0]).trace
    names = set(point_names(len(octx.text_config.layers)))
    assert set(got) <= names
    assert any(p.endswith("router.experts") for p in got)
    with pytest.raises(ValueError, match="not a trace point"):
        split_point("layers.2.mlp_out")


def _perturbed_copy(model_dir: Path, out: Path, suffix: str, factor: float = 1.01) -> Path:
    """A copy of the checkpoint at ``model_dir`` whose one tensor ending in ``suffix`` is scaled by ``factor``."""
    shutil.copytree(model_dir, out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        hit = [n for n in tensors if n.endswith(suffix)]
        if hit:
            tensors[hit[0]] = (tensors[hit[0]] * factor).astype(tensors[hit[0]].dtype)
            save_file(tensors, f)
            return out
    raise AssertionError(f"no tensor ends in {suffix}")


@pytest.mark.parametrize("tensor,point", [("layers.2.self_attn.q_norm.weight", "layers.2.attn_out"),
                                          ("layers.3.mlp.gate_proj.weight", "layers.3.ffn_out"),
                                          ("layers.1.per_layer_input_gate.weight", "layers.1.ple_add")])
def test_a_perturbed_layer_is_named(opened, tmp_path, tensor, point):
    fs, (oracle, octx), _ = opened("e2b-mini")
    engine = NumpyEngineBackend()
    engine.open(_perturbed_copy(Path(octx.model_dir), tmp_path / "perturbed", tensor))
    case = next(c for c in fs.cases if c.id == "e2b-mini/prefill/A/T19/rows-middle+last")
    ref, got = traced(oracle, octx, case), traced(engine, octx, case)
    labels, roles = row_roles(case, octx.media)
    rt, rl = trace_groups(case, ref), response_groups(case, ref)
    gt, gl = trace_groups(case, got), response_groups(case, got)
    comparison = compare_traces(gt, rt, gl, rl, labels, roles, PROFILES["fp32"].nmse)
    first = comparison.first_divergence
    assert first is not None and first["point"] == point
    assert first["rows"] and set(first["rows"]) <= set(labels)
    assert first["traced"] == "returned rows"
    before = [p for p in comparison.points if p.name == "embed" or (p.layer is not None and p.layer < first["layer"])]
    assert before and all(p.worst <= PROFILES["exact-f64"].nmse for p in before)


def test_explain_a_mutant_from_its_report(tmp_path, capsys):
    report, out = tmp_path / "r.json", tmp_path / "explain.json"
    backend = "conformance.selftest.mutants:PruneHiddenNotPle"
    fixtures = ["--fixtures", str(SETS["all-features"])]
    assert main(["check", "--backend", backend, *fixtures, "-q", "--profile", "fp32", "--json", str(report),
                 "-k", "rows-middle"]) == 1
    capsys.readouterr()
    code = main(["explain", "--backend", backend, "--from", str(report), "--profile", "fp32", "-q", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    data = json.loads(out.read_text())
    assert data["schema"] == "gemma4-conformance-explain/1" and data["profile"] == "fp32"
    failed = [c["id"] for c in json.loads(report.read_text())["cases"] if c["status"] == "fail"]
    assert sorted(c["id"] for c in data["cases"]) == sorted(failed)  # the report's failed cases, no other
    for c in data["cases"]:
        assert c["status"] == "diverges"
        assert c["first_divergence"]["point"] == "layers.5.ple_add"  # the first KV-shared layer: the pruning point
        assert c["first_divergence"]["layer"] == 5
    assert "first leaves the floor at layer 5, per-layer-input block (layers.5.ple_add)" in text


def test_explain_the_oracle_and_a_backend_without_traces(capsys):
    fixtures = ["--fixtures", str(SETS["e2b-mini"]), "--match", "full/A/T9$"]
    assert main(["explain", "--backend", "refimpl", *fixtures, "-q"]) == 0
    assert "within: every compared point is within the floor" in capsys.readouterr().out
    assert main(["explain", "--backend", "test_explain:NoTraces", *fixtures]) == 0
    captured = capsys.readouterr()
    assert "serves no traces (capability traces)" in captured.err
    assert "only its logits were compared" in captured.out


def test_traces_cross_the_subprocess_protocol():
    fs = load_set(SETS["e2b-mini"])
    with tempfile.TemporaryDirectory() as tmp:
        got = explain(_subprocess_backend(), [fs], PROFILES["exact-f64"], select="multi/A-T3|full/A/T9$", workdir=tmp)
    assert len(got) == 2
    for r in got:
        assert r.status == "within" and len(r.served) == 42 and r.comparison.missing == []
        assert r.comparison.rows[-1].endswith("decode 2")  # decode rows crossed too


def _subprocess_backend():
    from conformance.registry import load_backend
    return load_backend("refimpl-subprocess")


@pytest.mark.parametrize("option,message", [
    (["--from", "/nonexistent/report.json"], "--from: cannot read the report"),
    (["--plot", "-"], "--plot needs a file name"),
    (["--profile", "nope"], "unknown profile 'nope'"),
])
def test_explain_usage_errors(capsys, option, message):
    assert main(["explain", "--backend", "refimpl", "-k", "x", *option]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_explain_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "e.png"
    code = main(["explain", "--backend", "conformance.selftest.mutants:SoftcapTwice",
                 "--fixtures", str(SETS["e2b-mini"]), "--match", "full/A/T9$", "-q", "--plot", str(png)])
    assert code == 1 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# one mutant per pattern of the diagnosis (the full zoo: python -m conformance.explain.mutants, docs/bug-classes.md)
@pytest.mark.parametrize("name", ["shift-interior-row", "softcap-dropped-single-row", "softcap-twice",
                                  "prune-hidden-not-ple", "seq-state-leak", "chunk-local-positions",
                                  "embeddings-scaled-twice", "rope-ordinary-partial", "ple-placeholder-row",
                                  "audio-logit-cap-missing", "patch-order-chw", "hidden-pre-norm",
                                  "mtp-position-p-minus-1"])
def test_mutants_are_diagnosed_and_located(name):
    sets = {}
    m = mutant(name)
    for s in (m.kill_sets[:1] or ("all-features",)):
        sets[s] = load_set(SETS[s])
    finding = locate(m, sets)
    assert finding.case is not None
    assert finding.diagnosis_names_class, finding.diagnosis
    assert finding.located in (None, True), (finding.expected_point, finding.found_point)
    assert (finding.located is None) == (m.where is None)


def test_verbose_check_lists_every_failing_row(capsys):
    code = main(["check", "--backend", "conformance.selftest.mutants:SoftcapDroppedSingleRow", "--fixtures",
                 str(SETS["e2b-mini"]), "--match", "full/A/T9$", "-q", "-v"])
    out = capsys.readouterr().out
    assert code == 1
    assert "failing rows (3 of 24):" in out  # 12 logits rows and their 12 hidden rows; the 3 decode rows fail
    for j, position in enumerate((9, 10, 11)):
        assert f"    decode {j} (position {position}): max_abs; max_abs=" in out
    assert "diagnosis: logits beyond the final softcap on 2 row(s) (|logit| up to 34.79 > cap 30)" in out
    assert "Likely B2 (the head in the single-row path" in out


class PerturbedEngine(NumpyEngineBackend):
    """numpy-engine on its own copy of the checkpoint, layer 3's ``mlp.gate_proj.weight`` scaled by 1.01."""

    def open(self, model_dir):
        self._copy = tempfile.TemporaryDirectory()
        super().open(_perturbed_copy(Path(model_dir), Path(self._copy.name) / "ckpt", "layers.3.mlp.gate_proj.weight"))


def test_explain_names_the_perturbed_layer(tmp_path, capsys):
    out = tmp_path / "e.json"
    code = main(["explain", "--backend", "test_explain:PerturbedEngine", "--fixtures", str(SETS["e2b-mini"]),
                 "--match", "full/A/T9$|last/plain/A/T19/pos18", "--profile", "fp32", "-q", "--json", str(out)])
    assert code == 1
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 2
    for c in cases:
        assert (c["first_divergence"]["layer"], c["first_divergence"]["point"]) == (3, "layers.3.ffn_out")
        growth = c["comparison"]["growth"]
        assert growth[0]["point"] == "layers.3.ffn_out" and growth[-1]["point"] == "logits"
    assert "first leaves the floor at layer 3, feed-forward block (layers.3.ffn_out)" in capsys.readouterr().out
