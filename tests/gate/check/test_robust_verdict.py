"""The gate's verdict cannot be faked by a crashing, hanging or misbehaving backend (issue 15, items 1-8).

Each backend below breaks one promise of the protocol; the tests run ``conformance check`` on a few
cases of the bundled ``e2b-mini`` set and assert the exit code, the case's status and check, the exact
message, and that the JSON report validates against its schema and the JUnit XML is well-formed
(parsed by expat, which rejects control characters). What only a child process survives (``os._exit``,
a hang) runs with ``--isolate``, or as a subprocess of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.results import CaseResult, RunResult
from conformance.cli import main
from conformance.protocol import Response
from conformance.report import junit_tree, printable, validate
from conformance.sets import bundled_set

HERE = __name__
TESTS = Path(__file__).resolve().parents[2]
FULL = "/full/"  # two cases: e2b-mini/full/A/T9 and e2b-mini/full/B/T19
SECOND = 19  # tokens of the second full case: the backends below misbehave there


def _full_second(request) -> bool:
    return request.kind == "full" and len(request.tokens) == SECOND


class _Broken(RefimplBackend):
    def __init__(self):
        super().__init__()
        self.name = type(self).__name__

    def broken(self, request, response):  # overridden
        return response

    def run(self, request):
        response = super().run(request)
        return self.broken(request, response) if _full_second(request) else response


class Exit0(_Broken):
    def broken(self, request, response):
        raise SystemExit(0)


class Exit3(_Broken):
    def broken(self, request, response):
        sys.exit(3)


class ExitOnOpen(RefimplBackend):
    def open(self, model_dir):
        raise SystemExit(0)


class OsExit(_Broken):
    def broken(self, request, response):
        sys.stderr.write("engine log \x1b[2J\x1b]0;title\x07 NUL\x00 end\n")
        sys.stderr.flush()
        os._exit(0)


class Hang(_Broken):
    def broken(self, request, response):
        time.sleep(3600)


class AllNaN(_Broken):
    def broken(self, request, response):
        bad = np.full(np.shape(response.logits), np.nan)
        bad[1] = np.inf  # one row all +inf
        return dataclasses.replace(response, logits=bad)


class Complex(_Broken):
    def broken(self, request, response):
        return dataclasses.replace(response, logits=np.asarray(response.logits) + 1e6j)


class Objects(_Broken):
    def broken(self, request, response):
        return dataclasses.replace(response, logits=np.asarray(response.logits).astype(object))


class Strings(_Broken):
    def broken(self, request, response):
        return dataclasses.replace(response, logits=np.asarray(response.logits).astype(str))


class Float32(_Broken):
    """A legitimate return type: float32 logits are graded (and pass at fp32)."""

    def broken(self, request, response):
        return dataclasses.replace(response, logits=np.asarray(response.logits, dtype=np.float32))


class ControlChars(_Broken):
    def broken(self, request, response):
        raise RuntimeError("bad \x1b[31mred\x1b[0m NUL\x00 BEL\x07 CR\r C1\x9b end")


class ExecutedList(_Broken):
    def broken(self, request, response):
        return Response(response.logits, response.decode_logits, ["path", "full"])


class Slow(RefimplBackend):
    """Every request takes half a second: time to interrupt a run in the middle."""

    def __init__(self):
        super().__init__()
        self.name = "slow"

    def run(self, request):
        time.sleep(0.5)
        return super().run(request)


# ----------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def e2b_set() -> str:
    return str(bundled_set("e2b-mini"))


@pytest.fixture
def child_path(monkeypatch):
    """Child processes (--isolate, subprocess runs) import this module: its folder and tests/ on their PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), str(TESTS),
                                                                 os.environ.get("PYTHONPATH")) if p))


def check(capsys, tmp_path, e2b_set, backend, *extra, select=FULL):
    """``conformance check`` in this process: (exit code, stdout, stderr, JSON report, JUnit root)."""
    js, xml = tmp_path / "report.json", tmp_path / "junit.xml"
    code = main(["check", "--backend", f"{HERE}:{backend}", "--fixtures", e2b_set, "--match", select,
                 "--json", str(js), "--junit-xml", str(xml), *extra])  # the whole summary (-q: the verdict only)
    out, err = capsys.readouterr()
    report = json.loads(js.read_text()) if js.exists() else None
    junit = ET.parse(xml).getroot() if xml.exists() else None
    return code, out, err, report, junit


def by_id(report) -> dict[str, dict]:
    return {c["id"]: c for c in report["cases"]}


def assert_valid(report) -> None:
    assert validate(report) == []


def cli(*argv, **kw) -> list[str]:
    return [sys.executable, "-m", "conformance.cli", *argv]


# ----------------------------------------------------------------------------------------------
# 1. every exception a backend raises is that case's error


@pytest.mark.parametrize("backend, what", [("Exit0", "SystemExit: 0"), ("Exit3", "SystemExit: 3")])
def test_system_exit_in_run_is_the_case_error_and_the_run_goes_on(capsys, tmp_path, e2b_set, backend, what):
    code, out, err, report, junit = check(capsys, tmp_path, e2b_set, backend)
    assert code == 1, out + err
    cases = by_id(report)
    bad = cases["e2b-mini/full/B/T19"]
    assert (bad["status"], bad["check"], bad["message"]) == ("error", None, what)
    assert cases["e2b-mini/full/A/T9"]["status"] == "pass"
    assert report["exit_code"] == 1 and report["interrupted"] is None
    assert_valid(report)
    assert junit.get("errors") == "1"
    assert "exit 1: some cases failed" in out


def test_system_exit_in_open_is_a_backend_error(capsys, tmp_path, e2b_set):
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, "ExitOnOpen")
    assert code == 4, out + err
    assert report["aborted"]["reason"] == "backend" and report["exit_code"] == 4  # the reports say why (issue 42)
    assert "could not open e2b-mini" in report["aborted"]["message"]
    assert_valid(report)
    assert "could not open e2b-mini" in err and "SystemExit: 0" in err


def test_os_exit_under_isolate_is_one_error_and_the_child_restarts(capsys, tmp_path, e2b_set, child_path):
    code, out, err, report, junit = check(capsys, tmp_path, e2b_set, "OsExit", "--isolate",
                                          select="/full/|/last/plain/A/T7/")
    assert code == 1, out + err
    cases = by_id(report)
    bad = cases["e2b-mini/full/B/T19"]
    assert bad["status"] == "error" and bad["message"].startswith(
        "EngineCrash: the engine process died during run: it exited with code 0")
    # the engine's stderr tail is in the message as it was, and printable in the console and the JUnit
    assert "engine log \x1b[2J" in bad["message"]
    assert "\x1b" not in out and "\x00" not in out and "engine log \\x1b[2J\\x1b]0;title\\x07 NUL\\x00 end" in out
    assert "\\x1b[2J" in ET.tostring(junit, encoding="unicode")
    # the cases after the crash ran on a restarted child
    assert cases["e2b-mini/full/A/T9"]["status"] == "pass"
    assert [c["status"] for c in report["cases"] if "/last/" in c["id"]] == ["pass", "pass"]
    assert_valid(report)


def test_isolate_passes_the_oracle_and_keeps_its_options(capsys, tmp_path, e2b_set, child_path):
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, "Float32", "--isolate", "--profile", "fp32",
                                      select="/full/|/prefill/")
    assert code == 0, out + err
    assert {c["status"] for c in report["cases"]} == {"pass"}
    assert report["backend"]["name"] == "Float32"


def test_isolate_of_an_unknown_backend_is_exit_4(capsys, e2b_set):
    code = main(["check", "--backend", "no_such_module_xyz:B", "--isolate", "--fixtures", e2b_set, "-q"])
    _, err = capsys.readouterr()
    assert code == 4
    assert "no module named 'no_such_module_xyz'" in err


# ----------------------------------------------------------------------------------------------
# 2. --case-timeout


def test_a_hang_under_isolate_times_out_and_the_child_restarts(capsys, tmp_path, e2b_set, child_path):
    t = time.monotonic()
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, "Hang", "--isolate", "--case-timeout", "5",
                                      select="/full/|/last/plain/A/T7/")
    assert time.monotonic() - t < 60
    assert code == 1, out + err
    cases = by_id(report)
    bad = cases["e2b-mini/full/B/T19"]
    assert (bad["status"], bad["check"]) == ("error", "timeout")
    assert bad["message"].startswith("EngineTimeout: the engine did not answer run within 5 s (timeout); its "
                                     "process group was killed and it is restarted for the next request")
    assert [c["status"] for c in report["cases"] if "/last/" in c["id"]] == ["pass", "pass"]
    assert report["interrupted"] is None
    assert_valid(report)


def test_a_hang_in_process_times_out_and_ends_the_run(tmp_path, e2b_set, child_path):
    js = tmp_path / "r.json"
    t = time.monotonic()
    proc = subprocess.run(cli("check", "--backend", f"{HERE}:Hang", "--fixtures", e2b_set,
                              "--match", "/full/|/last/plain/A/T7/",
                              "-q", "--case-timeout", "5", "--json", str(js)),
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t < 60
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(js.read_text())
    assert_valid(report)
    assert [(c["id"], c["status"], c["check"]) for c in report["cases"]] == [
        ("e2b-mini/full/A/T9", "pass", None), ("e2b-mini/full/B/T19", "error", "timeout")]
    stop = report["interrupted"]
    assert stop["reason"] == "timeout" and stop["case"] == "e2b-mini/full/B/T19" and stop["cases_not_run"] == 2
    assert stop["message"] == ("case e2b-mini/full/B/T19 did not finish within 5 s: an in-process backend cannot be "
                               "stopped or restarted, so the run ended there (--isolate runs the backend in a child "
                               "process that is killed and restarted)")
    assert "the run ended early: " + stop["message"] + "; 2 selected cases not run" in proc.stdout


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_case_timeout_must_be_a_positive_number(capsys, e2b_set, value):
    code = main(["check", "--backend", "refimpl", "--fixtures", e2b_set, "--case-timeout", value])
    _, err = capsys.readouterr()
    assert code == 2
    assert f"argument --case-timeout: must be a positive number of seconds, got '{value}'" in err


# ----------------------------------------------------------------------------------------------
# 3, 4. non-finite rows and dtypes are graded, never coerced


def test_all_nan_rows_fail_nonfinite_with_their_details(capsys, tmp_path, e2b_set):
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, "AllNaN")
    assert code == 1, out + err
    bad = by_id(report)["e2b-mini/full/B/T19"]
    assert (bad["status"], bad["check"]) == ("fail", "nonfinite")
    # every prefill row and the decode steps, each with its result, then their hidden-state rows
    assert len(bad["rows"]) == 2 * (19 + 3)
    assert all(r["label"].endswith(" hidden") and r["status"] == "pass" for r in bad["rows"][22:])
    first = bad["rows"][0]
    assert first["check"] == "nonfinite" and first["message"].startswith("row 0: 512 non-finite mismatch(es)")
    assert bad["rows"][1]["message"].startswith("row 1: 512 non-finite mismatch(es) (512 where the oracle is "
                                                "finite); first at token 0: +inf")
    assert [r["status"] for r in bad["rows"][19:22]] == ["pass"] * 3  # the decode steps were fine
    assert_valid(report)


def test_all_nan_rows_through_the_protocol_fail_nonfinite(capsys, tmp_path, e2b_set, child_path):
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, "AllNaN", "--isolate")
    assert code == 1, out + err
    bad = by_id(report)["e2b-mini/full/B/T19"]
    assert (bad["status"], bad["check"]) == ("fail", "nonfinite")
    assert len(bad["rows"]) == 2 * 22  # the logits rows and the hidden-state rows (correct: through the protocol too)
    assert [r["status"] for r in bad["rows"][22:]] == ["pass"] * 22


@pytest.mark.parametrize("backend, dtype", [("Complex", "complex128"), ("Objects", "object"), ("Strings", "<U")])
def test_non_real_dtypes_fail_the_structure_check(capsys, tmp_path, e2b_set, backend, dtype):
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, backend, "--profile", "exact-f64")
    assert code == 1, out + err
    bad = by_id(report)["e2b-mini/full/B/T19"]
    assert (bad["status"], bad["check"]) == ("fail", "dtype")
    assert bad["message"].startswith(f"row 0: group 'logits' has dtype {dtype}")
    assert ": logits must be a real floating (or integer) array (+18 more of 22 rows fail: dtype)" in bad["message"]
    assert_valid(report)


def test_float32_logits_are_graded(capsys, tmp_path, e2b_set):
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, "Float32", "--profile", "fp32")
    assert code == 0, out + err


# ----------------------------------------------------------------------------------------------
# 5. control characters never reach the terminal or the XML raw


def test_control_characters_in_an_error_are_escaped(capsys, tmp_path, e2b_set):
    code, out, err, report, junit = check(capsys, tmp_path, e2b_set, "ControlChars", "-v")
    assert code == 1
    raw = "RuntimeError: bad \x1b[31mred\x1b[0m NUL\x00 BEL\x07 CR\r C1\x9b end"
    assert by_id(report)["e2b-mini/full/B/T19"]["message"] == raw  # the JSON keeps it as it was
    for text in (out, err):
        assert not any(c in text for c in "\x1b\x00\x07\r\x9b")
    # the one-line message (whitespace, CR included, folded to spaces)
    assert "  RuntimeError: bad \\x1b[31mred\\x1b[0m NUL\\x00 BEL\\x07 CR C1\\x9b end\n" in out
    error = junit.find(".//testcase[@name='e2b-mini/full/B/T19']/error")
    assert error.get("message") == "RuntimeError: bad \\x1b[31mred\\x1b[0m NUL\\x00 BEL\\x07 CR C1\\x9b end"
    assert "CR\\x0d C1" in error.text  # the traceback keeps the CR, escaped


def test_control_characters_in_case_ids_keep_the_junit_well_formed(tmp_path):
    import datetime as dt

    from conformance.check.profiles import PROFILES
    from conformance.check.results import SetInfo

    cid = "set/\x1b[31mcase\x00\x1f\ud800\ufffe"
    now = dt.datetime.now(dt.timezone.utc)
    case = CaseResult(id=cid, set="s\x07", kind="full", entry="full", features=["f\x0b"], status="fail",
                      check="max_abs", message="got \x08")
    result = RunResult(backend={"name": "b\x1b"}, profile=PROFILES["fp32"],
                       sets=[SetInfo("s\x07", "1", "/p", "0" * 64, {}, 1, 1)], cases=[case], expectations={},
                       select=None, started=now, finished=now, duration=0.0)
    path = tmp_path / "j.xml"
    path.write_text(ET.tostring(junit_tree(result).getroot(), encoding="unicode"), encoding="utf-8")
    root = ET.parse(path).getroot()  # expat: not well-formed XML would raise
    assert root.find(".//testcase").get("name") == "set/\\x1b[31mcase\\x00\\x1f\\ud800\\ufffe"
    assert printable("tab\tand\nnewline stay") == "tab\tand\nnewline stay"


# ----------------------------------------------------------------------------------------------
# 6. an interrupted run reports what it finished


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_writes_the_finished_cases(tmp_path, e2b_set, child_path, sig, code):
    js, xml = tmp_path / "r.json", tmp_path / "j.xml"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(cli("check", "--backend", f"{HERE}:Slow", "--fixtures", e2b_set, "--json", str(js),
                                "--junit-xml", str(xml)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    finished = 0
    for line in proc.stderr:  # one line per finished case (stderr is not a terminal)
        finished += line.startswith("[")
        if finished == 3:
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, out + err
    report = json.loads(js.read_text())
    assert_valid(report)
    assert report["exit_code"] == code
    stop = report["interrupted"]
    assert stop["reason"] == sig.name
    # the case in flight (if the signal came during one, not between two) is not reported
    assert stop["case"] is None or stop["case"] not in {c["id"] for c in report["cases"]}
    assert len(report["cases"]) >= 3 and {c["status"] for c in report["cases"]} == {"pass"}
    assert stop["cases_not_run"] == 52 - len(report["cases"])
    assert ET.parse(xml).getroot().get("tests") == str(len(report["cases"]))
    assert f"exit {code}: interrupted by {sig.name}" in out
    assert list(tmp.iterdir()) == []  # the materialised checkpoint and the backend's files are gone


# ----------------------------------------------------------------------------------------------
# 7. output paths


def test_report_paths_are_checked_before_the_run(capsys, tmp_path, e2b_set):
    code = main(["check", "--backend", "refimpl", "--fixtures", e2b_set, "--json", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == (f"conformance: error: --json: {tmp_path} is a directory; give a file name (or - for standard "
                   "output)\n")
    missing = tmp_path / "no" / "r.xml"
    code = main(["check", "--backend", "refimpl", "--fixtures", e2b_set, "--junit-xml", str(missing)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == (f"conformance: error: --junit-xml: the directory {missing.parent} does not exist (create it "
                   "first, or give - for standard output)\n")
    assert not missing.parent.exists()
    code = main(["check", "--backend", "refimpl", "--fixtures", e2b_set, "--json", "-", "--junit-xml", "-"])
    assert code == 2
    assert capsys.readouterr().err == ("conformance: error: only one of --json, --junit-xml, --summary-md and --html "
                                       "can go to standard output (-)\n")


@pytest.mark.parametrize("flag", ["--json", "--junit-xml"])
def test_dash_is_standard_output(capsys, tmp_path, e2b_set, flag):
    code = main(["check", "--backend", "refimpl", "--fixtures", e2b_set, "--match", FULL, "-q", flag, "-"])
    out, err = capsys.readouterr()
    assert code == 0
    assert not (tmp_path / "-").exists() and not Path("-").exists()
    if flag == "--json":
        report = json.loads(out)
        assert_valid(report)
        assert len(report["cases"]) == 2
    else:
        assert ET.fromstring(out.encode()).get("tests") == "2"
    assert "exit 0: all selected cases passed" in err  # the summary moves to stderr


# ----------------------------------------------------------------------------------------------
# 8. a closed pipe and a malformed executed record


def test_a_failing_run_into_a_closed_pipe_keeps_its_exit_code(e2b_set, child_path):
    proc = subprocess.Popen(cli("check", "--backend", f"{HERE}:AllNaN", "--fixtures", e2b_set, "--match", FULL, "-q"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the pager quit before the summary came
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1, err
    assert "Traceback" not in err


def test_executed_must_be_a_dict(capsys, tmp_path, e2b_set):
    code, out, err, report, _ = check(capsys, tmp_path, e2b_set, "ExecutedList")
    assert code == 1
    bad = by_id(report)["e2b-mini/full/B/T19"]
    assert (bad["status"], bad["check"], bad["message"]) == (
        "error", "response", "the response could not be graded: Response.executed must be a dict, got list")
    assert_valid(report)


def test_a_closed_pipe_is_never_exit_0_for_list(e2b_set):
    proc = subprocess.Popen(cli("list", "cases", "--fixtures", e2b_set), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err
