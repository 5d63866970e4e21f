"""The pytest plugin (conformance/pytest_plugin.py) run through pytest's ``pytester``: a failing case shows what
the CLI's console summary shows, ``--conformance-json`` writes the report of ``conformance check --json``, the
node ids pytest prints rerun one case, and ``-k`` reads the items' feature tags, kind and entry point.

The runs are in-process (``runpytest``) on the bundled set e2b-mini, with the self-test's NumPy engine and
one of its mutants (a row shifted on the interior last-logits entry points); the other plugin tests (options,
usage errors, expectations, a raising backend) are in test_refimpl_backend.py and test_set_checkpoint.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conformance.report import validate
from conformance.sets import load_set

pytest_plugins = ["pytester"]

SHIFTED = "conformance.selftest.mutants:ShiftInteriorRow"
FAILING = "e2b-mini/last/plain/A/T9/pos4"  # an interior last_pos: the mutant returns row 5


@pytest.fixture(scope="module")
def cases(e2b_mini):
    return load_set(e2b_mini).cases


def _run(pytester, *args):
    # the test directory is the rootdir (pytest would otherwise take this project's, an ancestor of the
    # --conformance-fixtures value) and its configuration, not this project's
    ini = pytester.makeini("[pytest]\n")
    return pytester.runpytest("-p", "no:cacheprovider", "-c", str(ini), "--rootdir", str(pytester.path), *args)


def _collected(pytester, *args) -> list[str]:
    """The node ids ``pytest --collect-only -q`` prints."""
    result = _run(pytester, "--collect-only", "-q", *args)
    return [line for line in result.outlines if "::" in line]


def test_node_ids_name_the_manifest_and_rerun_one_case(pytester, e2b_mini, cases):
    # a set outside the rootdir: its items' node ids are the absolute path of its manifest and the case id
    base = ["--conformance-backend", SHIFTED, "--conformance-fixtures", str(e2b_mini)]
    ids = _collected(pytester, *base)
    manifest = (e2b_mini / "manifest.json").as_posix()
    assert ids == [f"{manifest}::{c.id}" for c in cases]
    nodeid = f"{manifest}::{FAILING}"
    assert nodeid in ids
    # pytest "<node id>" runs exactly that case, and no other case of the set
    result = _run(pytester, *base, "-rf", nodeid)
    result.assert_outcomes(failed=1)
    assert result.ret == 1
    out = result.stdout.str()
    assert f"FAILED {nodeid}" in out  # (the outcomes above: exactly one test ran, and it failed)
    # the failure: the one-line verdict, then the details of `conformance check -v`'s summary
    assert (f"{FAILING}: fail [identity]: row 4: identity: the returned row is nearest to oracle row 5" in out)
    assert f"FAIL: {FAILING}" in out
    assert "  check: identity" in out
    assert "  diagnosis: a shifted row: row 4 is nearest oracle row 5. Likely B1 (a row shifted or misindexed)" in out
    assert "  first failing row: row 4 (position 4), check identity" in out
    assert "  metrics: max_abs=" in out and "identity_nearest=5" in out and "kl=" in out
    assert "  oracle  top-5: " in out and "  backend top-5: " in out
    # counted in the FAILURES section: on CI (the CI variable set) pytest's short summary repeats the whole report
    failures = out[out.index("= FAILURES ="):out.index("short test summary info")].splitlines()
    top = [line for line in failures if "top-5: " in line]
    assert len(top) == 2 and all(len(line.split("  ")) >= 6 for line in top)  # five tokens with their pieces
    assert "  failing rows (2 of 8):" in out
    assert "    row 4 (position 4): identity; max_abs=" in out
    assert "    row 4 hidden (position 4): hidden_identity; " in out
    assert '  backend executed: {"decode_ubatches": 3, ' in out and '"output_row": 5' in out


def test_node_ids_of_a_set_under_the_rootdir_and_directory_arguments(pytester, e2b_mini, cases):
    shutil.copytree(e2b_mini, pytester.path / "sets" / "e2b-mini")
    shutil.copytree(e2b_mini, pytester.path / "other" / "e2b-mini")
    base = ["--conformance-backend", "numpy-engine", "--conformance-fixtures", "sets", "--conformance-fixtures",
            "other"]
    ids = _collected(pytester, *base)
    # two sets of the same name in different directories: the paths keep their node ids apart (no argument:
    # pytest walks the rootdir, so the walk reaches both manifests, "other" first, and nothing is added twice)
    assert ids == ([f"other/e2b-mini/manifest.json::{c.id}" for c in cases]
                   + [f"sets/e2b-mini/manifest.json::{c.id}" for c in cases])
    # a node id of one set: only that case, the other set is not added
    result = _run(pytester, *base, "-v", f"other/e2b-mini/manifest.json::{cases[0].id}")
    result.assert_outcomes(passed=1)
    assert f"other/e2b-mini/manifest.json::{cases[0].id} PASSED" in result.stdout.str()
    # a set's directory as the argument: that set's cases only
    assert _collected(pytester, *base, "sets/e2b-mini") == ids[len(cases):]
    # the session's other tests, with every set added
    pytester.makepyfile(test_mine="def test_mine():\n    pass\n")
    # (the sets in the order given, after the session's own tests)
    mine = _collected(pytester, *base, "test_mine.py")
    assert mine == ["test_mine.py::test_mine"] + ids[len(cases):] + ids[:len(cases)]
    # --conformance-only deselects the other tests, also when a node id chooses the case
    assert _collected(pytester, *base, "--conformance-only", "test_mine.py",
                      f"sets/e2b-mini/manifest.json::{cases[1].id}") == [f"sets/e2b-mini/manifest.json::{cases[1].id}"]


def test_k_selects_by_feature_kind_and_entry(pytester, e2b_mini, cases):
    base = ["--conformance-backend", "numpy-engine", "--conformance-fixtures", str(e2b_mini)]

    def chosen(expr: str) -> set[str]:
        return {line.split("::", 1)[1] for line in _collected(pytester, *base, "-k", expr)}

    last = {c.id for c in cases if c.kind == "last" and c.entry != "embeddings"}
    assert len(last) == 17 and all("/embeddings/" not in i for i in last)
    got = chosen("last and not embeddings")
    # every last-logits case but the embeddings entry's; pytest's -k also matches a word as a substring of the
    # id, so it takes the prefill cases whose id holds "last" too (rows-last, none-then-last-17+3)
    assert last <= got and not any(c.entry == "embeddings" and c.kind == "last" and c.id in got for c in cases)
    assert all(c.kind == "prefill" and "last" in c.id for c in cases if c.id in got - last)
    # the exact forms: the entry points as keywords, or the kind as a segment of the id
    assert chosen("last:plain or last:seq_id") == last
    assert chosen("/last/ and not embeddings") == last
    # feature tags, the set's name
    assert chosen("interior and ubatch") == {c.id for c in cases if {"interior", "ubatch"} <= set(c.features)}
    assert chosen("e2b-mini and multi and not multi-row") == {c.id for c in cases if c.kind == "multi"}
    assert chosen("generation") == {c.id for c in cases if "generation" in c.features}


def test_json_report(pytester, e2b_mini, cases):
    chosen = [c for c in cases if "T9" in c.id and c.kind in ("full", "last")]
    result = _run(pytester, "--conformance-backend", SHIFTED, "--conformance-fixtures", str(e2b_mini),
                  "--conformance-profile", "fp32", "--conformance-json", "out/report.json", "-k", "T9 and (full or "
                                                                                                  "last)")
    by_status = {}
    for c in chosen:  # the mutant shifts the interior rows of the last-logits entry points (pos4; not pos8)
        by_status.setdefault("fail" if c.kind == "last" and c.id.endswith("/pos4") else "pass", []).append(c.id)
    result.assert_outcomes(passed=len(by_status["pass"]), failed=len(by_status["fail"]))
    path = pytester.path / "out" / "report.json"
    assert f"conformance: JSON report written to {path}" in result.stdout.str()
    report = json.loads(path.read_text())
    assert validate(report) == []
    assert report["schema"] == "gemma4-conformance/report" and report["schema_version"] == 1
    assert report["backend"]["name"] == "mutant/shift-interior-row"
    assert report["profile"]["name"] == "fp32"
    assert report["select"] == "-k 'T9 and (full or last)'"
    assert report["exit_code"] == 1 and report["interrupted"] is None
    assert report["command"][0] == "pytest" and "--conformance-json" in report["command"]
    [s] = report["fixture_sets"]
    assert (s["name"], s["cases_total"], s["cases_selected"]) == ("e2b-mini", len(cases), len(chosen))
    assert [c["id"] for c in report["cases"]] == [c.id for c in chosen]
    statuses = {c["id"]: c["status"] for c in report["cases"]}
    assert {s: sorted(i for i in statuses if statuses[i] == s) for s in ("pass", "fail")} == \
        {s: sorted(ids) for s, ids in by_status.items()}
    failed = [c for c in report["cases"] if c["status"] == "fail"]
    assert all(c["check"] == "identity" and "Likely B1" in c["diagnosis"] for c in failed)
    assert report["summary"]["by_status"]["fail"] == len(failed)
