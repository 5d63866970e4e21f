"""What a new user hits (issue 42): each defect found by trying the gate as a new engine author would, with the
test that failed before the fix.

1. a truncated .tar set: exit 3 and one line, as verify, not a traceback;
2. degenerate output (zeros, a constant, one row repeated, one response for every case) is named as such, not
   as a shifted row (B1);
3. an unwritable report path (/sys, /proc) is refused before any case runs, and no pass line precedes exit 2;
5. an in-process backend calling os._exit(3) cannot make the run exit 3 ("fixture integrity"): the case is an
   error; a backend that kills the process leaves a JSON report that says the run did not finish;
6. a backend that fails at start (or cannot open the set) gets a JSON report and JUnit XML with the error;
8. the pytest plugin's diagnosis is the CLI's for the same run (a chunked-prefill position bug: B4).
Also the frictions: a bundled set by name, the hint of an uninstalled checkout, exit-4 messages wrapped once,
shipped expectations for sets not in the run. (Defect 4, explain --plot without matplotlib, is in
test_html_report.py; defect 7, prompts beyond the context, in test_context_limit.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.check.expectations import Expectations, named_sets, parse
from conformance.cli import main
from conformance.report import validate

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[2]
ROOT = TESTS.parent


def run(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def check(capsys, *argv):
    return run(capsys, "check", "-q", *argv)


# -- 1. a truncated archive -------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_a_truncated_tar_set_is_a_fixture_error_of_one_line(tmp_path, capsys, e2b_mini, keep):
    whole = tmp_path / "whole.tar"
    with tarfile.open(whole, "w") as tar:
        tar.add(e2b_mini, arcname="e2b-mini")
    data = whole.read_bytes()
    cut = tmp_path / "trunc.tar"
    cut.write_bytes(data[:int(len(data) * keep) // 512 * 512 + 100])  # mid-member, past the first headers
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", cut)
    assert code == 3
    assert err.startswith(f"conformance: error: fixture integrity: {cut}: ") and err.count("\n") == 1
    assert "Traceback" not in err and out == ""
    assert run(capsys, "verify", cut)[0] == 3  # verify says the same of it


# -- 2. degenerate output ---------------------------------------------------------------------------------


def _diagnoses(capsys, tmp_path, backend, e2b_mini, k="full or multi or last"):
    report = tmp_path / f"{backend.split(':')[-1]}.json"
    code, _, _ = check(capsys, "--backend", backend, "--fixtures", e2b_mini, "-k", k, "--json", report)
    assert code == 1
    return {c["id"]: c["diagnosis"] for c in json.loads(report.read_text())["cases"] if c["status"] == "fail"}


@pytest.mark.parametrize("backend, says", [
    ("Zeros", "every failing row is constant (every logit 0;"),
    ("Constant", "every failing row is constant (every logit one value, |2.5|;"),
    ("RepeatedRow", "of the returned rows are one row repeated"),
    ("Canned", "the same logits in every failed case of this set"),
])
def test_degenerate_output_is_named_as_such_not_as_a_shifted_row(tmp_path, capsys, e2b_mini, backend, says):
    found = _diagnoses(capsys, tmp_path, f"new_user_backends:{backend}", e2b_mini)
    assert found
    for case, diagnosis in found.items():
        assert diagnosis.startswith("degenerate output: "), (case, diagnosis)
        assert "Likely B1" not in diagnosis and "shifted" not in diagnosis
    assert any(says in d for d in found.values()), found


def test_a_real_shift_is_still_b1_and_never_degenerate(tmp_path, capsys, e2b_mini):
    found = _diagnoses(capsys, tmp_path, "conformance.selftest.mutants:ShiftInteriorRow", e2b_mini, k="last")
    assert found and all("Likely B1" in d and "degenerate" not in d for d in found.values())


# -- 3. unwritable report paths ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--junit-xml", "--summary-md", "--html"])
@pytest.mark.parametrize("path", ["/sys/r.json", "/proc/version"])
def test_an_unwritable_report_path_is_refused_before_any_case_runs(capsys, e2b_mini, flag, path):
    if not Path(path).parent.exists():
        pytest.skip(f"{Path(path).parent} is not mounted here")
    code, out, err = run(capsys, "check", "--backend", "new_user_backends:ExitsThree", "--fixtures", e2b_mini,
                         flag, path)
    # the backend would end the process at its first case: refused before that, with one line, nothing on stdout
    assert code == 2 and out == ""
    assert err.startswith(f"conformance: error: {flag}: {path} cannot be written (") and err.count("\n") == 1


def test_the_probe_leaves_no_file_behind_and_keeps_an_existing_one(tmp_path, capsys, e2b_mini):
    old = tmp_path / "old.json"
    old.write_text("previous report")
    code, _, _ = check(capsys, "--backend", "refimpl", "--fixtures", "/nonexistent-set", "--json", old,
                       "--junit-xml", tmp_path / "new.xml")
    assert code == 2  # the fixture argument is a usage error: after the probe, before any report is written
    assert old.read_text() == "previous report" and not (tmp_path / "new.xml").exists()


def test_a_report_that_cannot_be_written_at_the_end_never_follows_a_pass_line(tmp_path, capsys, e2b_mini,
                                                                              monkeypatch):
    import conformance.cli.reports as reports

    def full_disk(result, path, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reports, "write_json", full_disk)
    code, out, err = run(capsys, "check", "--backend", "refimpl", "--fixtures", e2b_mini, "-k", "full",
                         "--json", tmp_path / "r.json")
    assert code == 2
    assert "cannot write the JSON report" in err and "No space left on device" in err
    assert "exit 0" not in out and "all selected cases passed" not in out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("exit 2: usage error: a report could not be written (2 cases: 2 pass in ")


# -- 5. a backend that ends the process --------------------------------------------------------------------


def test_os_exit_in_an_in_process_backend_cannot_become_the_run_exit_status(tmp_path, capsys, e2b_mini):
    report = tmp_path / "r.json"
    code, _, _ = check(capsys, "--backend", "new_user_backends:ExitsThree", "--fixtures", e2b_mini, "-k", "full",
                       "--json", report)
    assert code == 1  # an engine failure, not 3 ("fixture integrity")
    cases = json.loads(report.read_text())["cases"]
    assert cases and all(c["status"] == "error" for c in cases)
    assert "the backend called os._exit(3)" in cases[0]["message"]
    assert os._exit.__module__ == "posix"  # the guard is gone after the run


def _cli(tmp_path, *argv, env=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "conformance.cli", *map(str, argv)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)


def test_a_killed_run_leaves_reports_that_say_it_did_not_finish(tmp_path, e2b_mini):
    done = _cli(tmp_path, "check", "-q", "--backend", "new_user_backends:Killed", "--fixtures", e2b_mini, "-k", "full",
                "--json", "r.json", "--junit-xml", "r.xml")
    assert done.returncode == -9
    doc = json.loads((tmp_path / "r.json").read_text())
    assert validate(doc) == []
    assert doc["aborted"]["reason"] == "unfinished" and doc["exit_code"] == 1 and doc["cases"] == []
    assert "the run did not finish" in doc["aborted"]["message"]
    error = ET.parse(tmp_path / "r.xml").getroot().find("testsuite/testcase/error")
    assert error is not None and "the run did not finish" in error.get("message")


# -- 6. a backend that fails at start ------------------------------------------------------------------------


@pytest.mark.parametrize("backend, says", [
    ("new_user_backends:FailsAtStart", "backend 'new_user_backends:FailsAtStart': subprocess backend: cannot start"),
    ("new_user_backends:FailsToOpen", "could not open e2b-mini"),
    ("no_such_module:Engine", "no module named 'no_such_module'"),
])
def test_a_backend_that_fails_at_start_gets_both_reports_with_the_error(tmp_path, capsys, e2b_mini, backend, says):
    code, out, err = check(capsys, "--backend", backend, "--fixtures", e2b_mini, "--json", tmp_path / "r.json",
                           "--junit-xml", tmp_path / "r.xml", "--summary-md", tmp_path / "r.md")
    assert code == 4
    assert err.splitlines()[0].startswith("conformance: error: ") and says in err.splitlines()[0]
    assert "raised BackendError" not in err  # wrapped once
    doc = json.loads((tmp_path / "r.json").read_text())
    assert validate(doc) == []
    assert doc["exit_code"] == 4 and doc["aborted"]["reason"] == "backend" and says in doc["aborted"]["message"]
    root = ET.parse(tmp_path / "r.xml").getroot()
    assert root.get("errors") == "1" and root.get("tests") == "1"
    assert says in root.find("testsuite/testcase/error").get("message")
    assert says in (tmp_path / "r.md").read_text()


def test_a_broken_set_gets_the_reports_too(tmp_path, capsys, e2b_mini):
    cut = tmp_path / "trunc.tar"
    with tarfile.open(tmp_path / "whole.tar", "w") as tar:
        tar.add(e2b_mini, arcname="e2b-mini")
    cut.write_bytes((tmp_path / "whole.tar").read_bytes()[:20000])
    code, _, _ = check(capsys, "--backend", "refimpl", "--fixtures", cut, "--json", tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert code == 3 and doc["exit_code"] == 3 and doc["aborted"]["reason"] == "fixture" and validate(doc) == []


# -- 8. the pytest plugin's diagnosis ---------------------------------------------------------------------


CHUNK_BUG = "conformance.selftest.mutants:ChunkLocalPositions"


def test_the_pytest_plugin_diagnoses_as_the_cli_does(tmp_path, capsys, pytester, e2b_mini):
    cli = _diagnoses(capsys, tmp_path, CHUNK_BUG, e2b_mini, k="prefill or full")
    assert cli and all("B4" in d for d in cli.values())
    ini = pytester.makeini("[pytest]\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-c", str(ini), "--rootdir", str(pytester.path),
                                "--conformance-backend", CHUNK_BUG, "--conformance-fixtures", str(e2b_mini),
                                "--conformance-json", str(tmp_path / "plugin.json"), "-k", "prefill or full")
    assert result.ret == 1
    plugin = json.loads((tmp_path / "plugin.json").read_text())
    got = {c["id"]: c["diagnosis"] for c in plugin["cases"] if c["status"] == "fail"}
    assert got == cli
    assert "Likely traps 1-12" not in result.stdout.str()


# -- frictions ----------------------------------------------------------------------------------------------


def test_fixtures_takes_a_bundled_set_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    code, out, err = run(capsys, "list", "cases", "--fixtures", "e2b-mini")
    assert code == 0 and out.splitlines()[0].startswith("e2b-mini/")
    code, _, err = run(capsys, "list", "cases", "--fixtures", "e2b-mni")
    assert code == 2 and "no such directory: e2b-mni (nor a bundled set's name: " in err and "e2b-mini" in err


def test_an_uninstalled_checkout_says_why_no_backend_is_registered(tmp_path):
    # a plain checkout, nothing installed: the package from its source tree, no entry points
    code = ("import sys, importlib.metadata as m\n"
            "m.entry_points = lambda **kw: []\n"
            "def missing(name): raise m.PackageNotFoundError(name)\n"
            "m.distribution = missing\n"
            "from conformance.cli import main\n"
            "sys.exit(main(['check', '--backend', 'refimpl']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 4
    assert "registered backends: (none) (gemma4-conformance is not installed" in done.stderr
    assert "pip install -e ." in done.stderr


def test_shipped_entries_for_sets_not_in_the_run_are_not_reported():
    doc = {"entries": [
        {"match": r"^(?:12b\-mini/last/embeddings/I0/T71/pos38)$", "action": "known-failure", "reason": "vision mask"},
        {"match": r"^e2b\-mini/full/Z/", "action": "known-failure", "reason": "stale"},
        {"match": r"/nowhere/", "action": "skip", "reason": "no set named"},
    ]}
    for shipped, unused in ((True, [1, 2]), (False, [0, 1, 2])):
        exp = parse(doc, path="x.json")
        exp.shipped = shipped
        exp.observe(["e2b-mini/full/A/T9", "e2b-mini/multi/A-T3"])
        assert [e.index for e in exp.unused] == unused
        assert exp.report()["for_other_sets"] == (1 if shipped else 0)
    assert named_sets(r"^(e2b-mini|e4b-mini)/last", ["e2b-mini", "e4b-mini", "e2b-vision-mini"]) == {"e2b-mini",
                                                                                                   "e4b-mini"}
    assert isinstance(Expectations(), Expectations)


def test_where_the_time_went_is_in_the_json_and_on_the_console(tmp_path, capsys, e2b_mini):
    """Issue 55: the run's time by phase. The requests' share is the cases' durations; the phases of the run
    (all but loading the sets, which comes before the run's clock starts) fit in its duration."""
    report = tmp_path / "r.json"
    code, out, _ = run(capsys, "check", "--backend", "refimpl", "--fixtures", e2b_mini, "--match", "/full/",
                       "--json", report)
    assert code == 0
    r = json.loads(report.read_text())
    validate(r)
    t = r["timings"]
    assert set(t) == {"load", "checkpoint", "rebuild", "open", "backend", "grade"}
    assert all(isinstance(v, float) and v >= 0 for v in t.values())
    assert abs(t["backend"] - sum(c["duration"] for c in r["cases"])) < 1e-6
    assert sum(v for k, v in t.items() if k != "load") <= r["duration"] + 1e-3  # the sets load before its clock
    (line,) = [x for x in out.splitlines() if x.startswith("time: ")]
    assert line.startswith(f"time: {t['backend']:.1f}s in the backend's requests, ")
    for label in ("grading", "rebuilding the oracle's rows", "loading the sets", "opening the backend", "checkpoints"):
        assert label in line
