"""A Markdown scoreboard from ``conformance check --json`` reports: one column per run.

    conformance scoreboard reports/*.json [--out board.md | --into docs/backends.md] [--title T]

For every run (one JSON report): the backend, its options, the profile, the counts by status and
the command. Then, per fixture set, per entry point and per feature, ``passed/graded`` with the worst ``max_abs`` and
the worst per-row KL over the graded cases (cases not claimed or skipped are not graded). Last, for
every case that did not simply pass, where it deviates: the case, its status, the failing check and
row, and the reason the expectations file gives for it.

``--into FILE`` replaces the text between the lines ``<!-- scoreboard:begin -->`` and
``<!-- scoreboard:end -->`` of an existing page (its title becomes a second-level heading there), so
a hand-written page can carry a generated scoreboard. Only report files are read; nothing is re-run, so the scoreboard
says exactly what the reports say.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = ["ScoreboardError", "load_report", "render", "embed"]

BEGIN = "<!-- scoreboard:begin -->"
END = "<!-- scoreboard:end -->"

REPORT_SCHEMA = "gemma4-conformance/report"
GRADED = ("pass", "fail", "error", "xfail", "xpass")
ENTRY_ORDER = ("full", "last:plain", "last:seq_id", "last:embeddings", "prefill", "multi")


class ScoreboardError(Exception):
    """A report cannot be read (a usage error: exit code 2)."""


@dataclass
class Tally:
    """The graded cases of one run that share an entry point or a feature."""

    graded: int = 0
    passed: int = 0
    xfail: int = 0
    not_graded: int = 0
    worst_max_abs: float | None = None
    worst_kl: float | None = None

    def add(self, case: dict[str, Any]) -> None:
        status = case.get("status")
        if status not in GRADED:
            self.not_graded += 1
            return
        self.graded += 1
        self.passed += status == "pass"
        self.xfail += status == "xfail"
        summary = case.get("summary") or {}
        self.worst_max_abs = _max(self.worst_max_abs, summary.get("max_abs"))
        self.worst_kl = _max(self.worst_kl, summary.get("kl_max"))

    def cell(self) -> str:
        if self.graded == 0:
            return "not claimed" if self.not_graded else ""
        text = f"{self.passed}/{self.graded}"
        if self.xfail:
            text += f" (+{self.xfail} xfail)"
        if self.passed + self.xfail < self.graded:
            text = f"**{text}**"
        if self.worst_max_abs is not None:
            text += f" · {self.worst_max_abs:.1e}"
        if self.worst_kl is not None:
            text += f" / {self.worst_kl:.0e}"
        return text


@dataclass
class Run:
    path: Path
    report: dict[str, Any]
    by_set: dict[str, Tally] = field(default_factory=dict)
    by_entry: dict[str, Tally] = field(default_factory=dict)
    by_feature: dict[str, Tally] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return str(self.report["backend"].get("name", "?"))


def _max(a: float | None, b: Any) -> float | None:
    if not isinstance(b, (int, float)) or b != b:  # missing or NaN: the status already says it
        return a
    return float(b) if a is None else max(a, float(b))


def load_report(path: str | Path) -> Run:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ScoreboardError(f"{p}: cannot read the report ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ScoreboardError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
        raise ScoreboardError(f"{p}: not a conformance report (schema {REPORT_SCHEMA!r} expected; "
                              f"write one with conformance check --json FILE)")
    if data.get("schema_version") != 1:
        raise ScoreboardError(f"{p}: report schema_version {data.get('schema_version')!r} is not supported "
                              f"(this version reads 1)")
    problems = [k for k in ("backend", "summary", "cases") if not isinstance(data.get(k), (dict, list))]
    if not problems and not isinstance(data["summary"].get("by_status"), dict):
        problems.append("summary.by_status")
    if problems:
        raise ScoreboardError(f"{p}: the report lacks {', '.join(problems)} (is it a complete report of "
                              f"conformance check --json?)")
    run = Run(p, data)
    for case in data.get("cases", []):
        run.by_set.setdefault(case.get("set", "?"), Tally()).add(case)
        run.by_entry.setdefault(case.get("entry", "?"), Tally()).add(case)
        for feature in case.get("features", []):
            run.by_feature.setdefault(feature, Tally()).add(case)
    return run


def _profile_name(report: dict[str, Any]) -> str:
    profile = report.get("profile")
    return str(profile.get("name")) if isinstance(profile, dict) else str(profile)


def _escape(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in rows]
    return lines


def _command(argv: list[str]) -> list[str]:
    """The command of a run without its output options (where the reports went is not part of it)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--json", "--junit-xml"):
            skip = True
        elif arg not in ("-q", "--quiet") and not arg.startswith(("--json=", "--junit-xml=")):
            out.append(arg)
    return out


def _runs_table(runs: list[Run]) -> list[str]:
    rows = []
    for i, run in enumerate(runs, 1):
        r = run.report
        counts = r["summary"]["by_status"]
        options = ", ".join(f"{k}={v}" for k, v in sorted(r["backend"].get("options", {}).items())) or "(defaults)"
        exp = (r.get("expectations") or {}).get("path")
        rows.append([
            f"R{i}", run.label, options, _profile_name(r), Path(exp).name if exp else "none",
            str(counts.get("pass", 0)), str(counts.get("xfail", 0)),
            str(counts.get("fail", 0) + counts.get("xpass", 0)),
            str(counts.get("error", 0)), str(counts.get("not-claimed", 0) + counts.get("skipped", 0)),
            f"{r.get('duration', 0):.0f} s", f"exit {r.get('exit_code')}",
            "`conformance " + shlex.join(_command(r.get("command", []))) + "`",
        ])
    return _table(["run", "backend", "options", "profile", "expectations", "pass", "xfail", "fail",
                   "error", "not run", "time", "result", "command"], rows)


def _grid(runs: list[Run], attr: str, order: Iterable[str]) -> list[str]:
    keys: list[str] = [k for k in order if any(k in getattr(r, attr) for r in runs)]
    for run in runs:
        keys += [k for k in getattr(run, attr) if k not in keys]
    rows = [[k] + [getattr(run, attr).get(k, Tally()).cell() for run in runs] for k in keys]
    head = {"by_set": "set", "by_entry": "entry point", "by_feature": "feature"}[attr]
    return _table([head] + [f"R{i}" for i in range(1, len(runs) + 1)], rows)


def _where(case: dict[str, Any]) -> str:
    """``check at row`` of a case's first failing row (or the case-level check)."""
    rows = [r for r in case.get("rows", []) if r.get("status") not in (None, "pass")]
    check = case.get("check") or (rows[0].get("check") if rows else None)
    where = f" at {rows[0].get('label')}" if rows else ""
    return f"{check or case.get('status')}{where}"


def _short(text: str, limit: int = 400) -> str:
    text = _escape(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _deviations(runs: list[Run]) -> list[str]:
    """Per run: cases grouped by the expectations entry that explains them (its reason once), then every
    case no entry explains, with its message."""
    lines: list[str] = []
    for i, run in enumerate(runs, 1):
        explained: dict[tuple[str, str], list[str]] = {}
        unexplained: list[str] = []
        for c in run.report.get("cases", []):
            exp = c.get("expectation") or {}
            status = c.get("status")
            if status in ("pass", "not-claimed") and not exp.get("tolerance"):
                continue
            item = f"`{c['id']}` ({status}: {_where(c)})" if status != "pass" else f"`{c['id']}`"
            if status in ("xfail", "skipped") and (exp.get("known_failure") or exp.get("skip")):
                entry = exp.get("known_failure") or exp["skip"]
                explained.setdefault((entry["action"], entry["reason"]), []).append(item)
            elif status == "pass" and exp.get("tolerance"):
                limits = ", ".join(f"{k}={v:g}" for k, v in exp["tolerance"].items())
                reason = "; ".join(exp.get("tolerance_reasons", []))
                explained.setdefault((f"tolerance ({limits})", reason), []).append(item)
            elif status == "skipped":
                continue  # skipped by -k-independent means without an entry cannot happen; nothing to say
            else:
                unexplained.append(f"- `{c['id']}`: {status} ({_where(c)}): {_short(c.get('message', ''))}")
        if not explained and not unexplained:
            continue
        lines += ["", f"**R{i} {run.label}**", ""]
        for (action, reason), items in explained.items():
            lines.append(f"- {len(items)} case{'s' if len(items) != 1 else ''}, {action}: {_escape(reason)} "
                         f"Cases: {', '.join(items)}.")
        if unexplained:
            lines += [f"- {len(unexplained)} case{'s' if len(unexplained) != 1 else ''} with no expectation:"]
            lines += ["  " + u for u in unexplained]
    return lines or ["", "Every graded case passed in every run."]


def render(runs: list[Run], title: str = "Conformance scoreboard") -> str:
    if not runs:
        raise ScoreboardError("no report given")
    lines = [f"# {title}", "",
             "Generated by `conformance scoreboard` from the JSON reports of `conformance check`. A cell reads "
             "`passed/graded · worst max_abs / worst per-row KL` over the graded cases; **bold** when some "
             "graded case failed or errored; `not claimed` when the backend does not serve it.", "",
             "## Runs", ""]
    lines += _runs_table(runs)
    lines += ["", "## By fixture set (checkpoint)", ""] + _grid(runs, "by_set", ())
    lines += ["", "## By entry point", ""] + _grid(runs, "by_entry", ENTRY_ORDER)
    lines += ["", "## By feature", ""] + _grid(runs, "by_feature", ())
    lines += ["", "## Deviations"] + _deviations(runs)
    return "\n".join(lines) + "\n"


def embed(page: str, board: str, where: str = "the page") -> str:
    """``page`` with the text between its BEGIN and END marker lines replaced by ``board``."""
    lines = page.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ScoreboardError(f"{where} must have exactly one line {BEGIN} followed by one line {END} "
                              f"(found {len(starts)} and {len(ends)})")
    # one heading level down: the page has its own title
    body = "".join("#" + line if line.startswith("#") else line for line in board.splitlines(keepends=True))
    return "".join(lines[:starts[0] + 1]) + body + "".join(lines[ends[0]:])
