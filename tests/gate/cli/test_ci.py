"""The pieces of a CI job (issue: the gate in a real CI pipeline).

* JUnit XML of a failing run validates against the common JUnit schema (tests/data/junit.xsd: the rules of the
  Jenkins xunit plugin's junit-10.xsd) with a validator (xmlschema) and is read by junitparser; timestamps carry
  their UTC offset; a set that -k leaves out has no suite; --junit-properties brings back case properties
  (and leaves the schema).
* --summary-md and $GITHUB_STEP_SUMMARY: the verdict, the tables, the first failing case with its diagnosis.
* -k takes pytest-style expressions over case ids and feature tags, --match a regular expression; --version;
  colour only on a terminal, never with NO_COLOR; -q prints the verdict line alone; `list --fixtures DIR cases`.
* The CI examples' commands run green (scripts/run-ci-examples.py).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.check.select import CaseFilter, SelectError
from conformance.cli import main
from conformance.report.console import colorize, use_color
from conformance.sets.bundled import bundled_sets
from conformance.sets.integrity import load_set

REPO = Path(__file__).resolve().parents[3]
SETS = {p.name: p for p in bundled_sets()}
XSD = Path(__file__).resolve().parents[2] / "data" / "junit.xsd"
SHIFT = "conformance.selftest.mutants:ShiftInteriorRow"


def _check(capsys, *argv) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    """A failing run (a shifted interior row) over two sets, of which -k selects one: its JUnit, JSON, summary."""
    tmp = tmp_path_factory.mktemp("ci")
    paths = {k: tmp / f"r.{k}" for k in ("xml", "json", "md")}
    code = main(["check", "--backend", SHIFT, "--fixtures", str(SETS["e2b-mini"]), str(SETS["e4b-mini"]),
                 "-k", "e2b-mini and last", "-q", "--junit-xml", str(paths["xml"]), "--json", str(paths["json"]),
                 "--summary-md", str(paths["md"])])
    return code, paths


def test_junit_of_a_failing_run_validates_and_parses(failing_run):
    xmlschema = pytest.importorskip("xmlschema")
    junitparser = pytest.importorskip("junitparser")
    code, paths = failing_run
    assert code == 1
    schema = xmlschema.XMLSchema(str(XSD))
    schema.validate(str(paths["xml"]))  # raises with the element and the rule broken
    xml = junitparser.JUnitXml.fromfile(str(paths["xml"]))
    suites = list(xml)
    report = json.loads(paths["json"].read_text())
    selected = [c for c in report["cases"]]
    assert [s.name for s in suites] == ["e2b-mini"]  # e4b-mini: no case selected, no empty suite
    (suite,) = suites
    assert suite.tests == len(selected) and suite.failures == sum(c["status"] == "fail" for c in selected) > 0
    stamp = dt.datetime.fromisoformat(suite.timestamp)
    assert stamp.utcoffset() is not None  # ISO 8601 with the offset
    failed = [case for case in suite if any(isinstance(r, junitparser.Failure) for r in case.result)]
    assert len(failed) == suite.failures
    text = failed[0].result[0].text
    assert "diagnosis: a shifted row" in text and "Likely B1" in text
    assert "status fail; entry last:" in failed[0].system_out  # the case's record, where the schema allows it


def test_junit_case_properties_are_an_option_outside_the_schema(tmp_path, capsys):
    xmlschema = pytest.importorskip("xmlschema")
    path = tmp_path / "r.xml"
    code, _, _ = _check(capsys, "--backend", "refimpl", "--fixtures", str(SETS["e2b-mini"]), "-k", "full", "-q",
                        "--junit-xml", str(path), "--junit-properties")
    assert code == 0
    errors = list(xmlschema.XMLSchema(str(XSD)).iter_errors(str(path)))
    assert errors and "properties" in str(errors[0])


def test_the_markdown_summary_and_the_github_job_summary(failing_run, tmp_path, capsys, monkeypatch):
    code, paths = failing_run
    md = paths["md"].read_text()
    assert md.startswith("## ❌ Gemma 4 conformance: `mutant/shift-interior-row`")
    assert "**exit 1: some cases failed**" in md and "selected with `-k 'e2b-mini and last'`" in md
    assert "| entry point |" in md and "<summary>per feature</summary>" in md
    assert "#### FAIL: `e2b-mini/last/" in md and "- **diagnosis:** a shifted row" in md
    assert "- oracle top-5:" in md and "- backend top-5:" in md
    step = tmp_path / "step.md"
    step.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    assert _check(capsys, "--backend", "refimpl", "--fixtures", str(SETS["e2b-mini"]), "-k", "full", "-q")[0] == 0
    text = step.read_text()
    assert text.startswith("earlier step\n## ✅ Gemma 4 conformance: `refimpl`")  # appended, not replaced


@pytest.mark.parametrize("expression, expected", [
    ("last and not embeddings", lambda c: "last" in c.id.lower() and "embeddings" not in c.id),
    ("/last/ and not embeddings", lambda c: c.kind == "last" and c.entry != "embeddings"),
    ("last:plain or last:seq_id", lambda c: c.kind == "last" and c.entry in ("plain", "seq_id")),
    ("(chunked or ubatch) and not decode", lambda c: False),  # every bundled case decodes
    ("e2b-mini and interior", lambda c: "interior" in c.features),
    ("T19 and pos9", lambda c: "/T19/" in c.id and c.id.endswith("pos9")),
])
def test_k_is_a_pytest_style_expression(expression, expected):
    fs = load_set(SETS["e2b-mini"])
    chosen = CaseFilter(expression)
    got = {c.id for c in fs.cases if chosen(c, "e2b-mini")}
    assert got == {c.id for c in fs.cases if expected(c)}


def test_match_keeps_the_regular_expression(capsys):
    code, out, err = _check(capsys, "--backend", "refimpl", "--fixtures", str(SETS["e2b-mini"]),
                            "--match", r"^e2b-mini/(full/A/T9|multi/A-T9)$", "-q")
    assert code == 0 and "(2 cases: 2 pass in" in out
    code, out, err = _check(capsys, "--backend", "refimpl", "--fixtures", str(SETS["e2b-mini"]), "-k", "full|multi")
    assert code == 2 and "looks like a regular expression" in err and "--match" in err
    with pytest.raises(SelectError, match=r"unexpected 'b'"):
        CaseFilter("a b")


def test_version(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("conformance ") and "JSON report schema v1" in line and line.count("\n") == 1


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    class Pipe:
        def isatty(self):
            return False

    for var in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(var, raising=False)
    assert use_color(Tty()) and not use_color(Pipe())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert use_color(Pipe())
    painted = colorize("FAIL: x\n  diagnosis: y\nplain\nexit 0: all selected cases passed")
    assert painted.splitlines()[0].startswith("\x1b[31;1m") and painted.splitlines()[2] == "plain"
    assert painted.splitlines()[3].startswith("\x1b[32;1m")


def test_quiet_prints_the_verdict_line_alone(capsys):
    code, out, err = _check(capsys, "--backend", SHIFT, "--fixtures", str(SETS["e2b-mini"]), "-k", "last", "-q")
    assert code == 1 and out.count("\n") == 1
    assert out.startswith("exit 1: some cases failed (") and " fail in " in out
    assert err == ""  # no progress either


def test_list_takes_its_word_back_from_fixtures(capsys):
    assert main(["list", "--fixtures", str(SETS["e2b-mini"]), "cases", "-k", "full"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [line for line in out.splitlines() if line.startswith("e2b-mini/full/")] and out
    assert main(["list", "--fixtures", str(SETS["e2b-mini"])]) == 2
    assert "list: say what to list: backends, cases, profiles" in capsys.readouterr().err


def test_the_ci_examples_run_green():
    """scripts/run-ci-examples.py: the commands of the GitHub Actions, GitLab CI and Docker examples, in fresh
    clones of the committed HEAD (one set's full-forward cases, to stay short). About 60 s on two cores: each
    example's steps (a virtual environment, the install, the gate) run as its CI job runs them."""
    pytest.importorskip("yaml")
    proc = subprocess.run([sys.executable, str(REPO / "scripts/run-ci-examples.py"), "--args",
                           "--match ^e2b-mini/full/"], capture_output=True, text=True, timeout=1200,
                          env={k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"})
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    for name in ("github-actions", "gitlab-ci", "docker"):
        assert f"=== {name}: green" in proc.stdout, tail
    assert "the job summary:" in proc.stdout
