"""`conformance scoreboard`: the Markdown table built from check reports says what the reports say."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.cli import main
from conformance.report.scoreboard import load_report, render

HERE = __name__  # importable by this name: pytest put tests/ on sys.path
SELECT = "^e4b-mini/(full/|last/plain/A/T7/|prefill/A/T19/chunks)"


class ShiftedFullBackend(RefimplBackend):
    """Answers every full forward one row late (row i holds row i+1's logits)."""

    def __init__(self):
        super().__init__()
        self.name = "shifted-full"

    def run(self, request):
        resp = super().run(request)
        if request.kind == "full":
            resp.logits = np.roll(np.asarray(resp.logits), -1, axis=0)
        return resp




@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scoreboard")
    exp = tmp / "exp.json"
    exp.write_text(json.dumps({"entries": [
        {"match": "/full/B/", "action": "known-failure", "reason": "rows shifted on purpose"}]}))
    tol = tmp / "tol.json"
    tol.write_text(json.dumps({"entries": [
        {"match": "/full/", "action": "tolerance", "reason": "float32 head", "tolerance": {"max_abs": 0.01}}]}))
    paths = []
    for name, argv in [("oracle", ["--backend", "refimpl"]),
                       ("float32", ["--backend", "refimpl-float32", "--expectations", str(tol)]),
                       ("shifted", ["--backend", f"{HERE}:ShiftedFullBackend", "--profile", "exact-f64",
                                    "--expectations", str(exp)])]:
        out = tmp / f"{name}.json"
        main(["check", *argv, "--match", SELECT, "-q", "--json", str(out)])
        paths.append(out)
    return paths


def test_cells_count_what_the_report_counts(reports):
    oracle = load_report(reports[0])
    report = json.loads(reports[0].read_text())
    assert oracle.by_entry["full"].graded == report["summary"]["by_entry"]["full"]["pass"] == 2
    worst = max(c["summary"]["max_abs"] for c in report["cases"] if c["entry"] == "full")
    assert oracle.by_entry["full"].worst_max_abs == worst
    assert oracle.by_entry["full"].cell().startswith("2/2 · ")


def test_failures_are_bold_and_explained(reports, capsys):
    assert main(["scoreboard", *map(str, reports), "--title", "T"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# T\n")
    full_row = next(line for line in text.splitlines() if line.startswith("| full |"))
    cells = [c.strip() for c in full_row.strip("|").split("|")]
    assert cells[1].startswith("2/2 · ")
    assert cells[3].startswith("**0/2 (+1 xfail)**")  # /full/A/ fails, /full/B/ is the known failure
    assert "- 1 case with no expectation:\n  - `e4b-mini/full/A/T9`: fail (identity at row 0): " in text
    assert ("- 1 case, known-failure: rows shifted on purpose Cases: `e4b-mini/full/B/T19` (xfail: identity at row "
            "0).") in text
    assert "| R3 | shifted-full |" in text
    assert ("- 2 cases, tolerance (max_abs=0.01): float32 head Cases: `e4b-mini/full/A/T9`, "
            "`e4b-mini/full/B/T19`.") in text


def test_scoreboard_writes_a_file(reports, tmp_path, capsys):
    out = tmp_path / "docs" / "board.md"
    assert main(["scoreboard", str(reports[0]), "--out", str(out)]) == 0
    assert out.read_text() == render([load_report(reports[0])])


@pytest.mark.parametrize("content, needle", [
    ("not json", "not valid JSON"),
    ('{"schema": "something-else"}', "not a conformance report"),
    ('{"schema": "gemma4-conformance/report", "schema_version": 9}', "schema_version 9 is not supported"),
    ('{"schema": "gemma4-conformance/report", "schema_version": 1, "backend": {}, "cases": []}',
     "the report lacks summary"),
])
def test_bad_reports_are_usage_errors(tmp_path, capsys, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["scoreboard", str(bad)]) == 2
    assert needle in capsys.readouterr().err


def test_into_replaces_only_the_marked_block(reports, tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nbefore\n<!-- scoreboard:begin -->\nold table\n<!-- scoreboard:end -->\nafter\n")
    assert main(["scoreboard", str(reports[0]), "--into", str(page), "--title", "Board"]) == 0
    text = page.read_text()
    assert text.startswith("# Page\n\nbefore\n<!-- scoreboard:begin -->\n## Board\n")
    assert "old table" not in text and "### Runs" in text
    assert text.endswith("<!-- scoreboard:end -->\nafter\n")
    page.write_text("# no markers\n")
    assert main(["scoreboard", str(reports[0]), "--into", str(page)]) == 2
    assert "must have exactly one line <!-- scoreboard:begin -->" in capsys.readouterr().err


def test_unwritable_output_is_a_usage_error(reports, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["scoreboard", str(reports[0]), "--out", str(blocker / "board.md")]) == 2
    assert "--out" in capsys.readouterr().err


def test_commands_are_shell_quoted(reports):
    text = render([load_report(p) for p in reports])
    escaped = SELECT.replace("|", "\\|")  # a table cell escapes '|'; rendered, the command pastes as is
    assert f"--match '{escaped}'" in text  # the regex is shell-quoted, the report paths are left out
    assert "--json" not in text.split("## Runs")[1].split("## By")[0]
