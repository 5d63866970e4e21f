"""The Markdown summary of a check run (``conformance check --summary-md FILE``, and the job summary of a
GitHub Actions run, ``$GITHUB_STEP_SUMMARY``): the verdict, per-entry-point and per-feature tables, and
the first failing cases with their first failing row, metrics, top tokens and diagnosis."""

from __future__ import annotations

from pathlib import Path

from ..check.results import FAILING, CaseResult, RunResult
from .console import ENTRY_TAGS, counts_line, exit_line
from .json_report import matrix, write_output
from .junit import fmt, one_line
from .text import printable

__all__ = ["append_summary", "markdown_summary", "write_summary"]

COLUMNS = ("pass", "fail", "error", "xfail", "xpass", "skipped", "not-claimed")
MAX_CASES = 10  # failing cases detailed in the summary (the JSON report has every one)
ICON = {0: "✅", 1: "❌", 5: "⚠️"}


def _cell(text: str, limit: int = 300) -> str:
    """Text from backends and sets, safe inside a Markdown table cell or list item."""
    return printable(one_line(text, limit)).replace("|", "\\|").replace("`", "'")


def _table(title: str, rows: dict[str, dict[str, int]]) -> list[str]:
    if not rows:
        return []
    cols = [c for c in COLUMNS if any(r.get(c, 0) for r in rows.values())] or ["pass"]
    out = [f"| {title} | " + " | ".join(cols) + " | total |", "|---|" + "---:|" * (len(cols) + 1)]
    for name, r in rows.items():
        failing = any(r.get(s, 0) for s in FAILING)
        label = f"**{_cell(name)}**" if failing else _cell(name)
        out.append(f"| {label} | " + " | ".join(str(r.get(c, 0) or "·") for c in cols) + f" | {sum(r.values())} |")
    return out


def _case(c: CaseResult) -> list[str]:
    out = [f"#### {c.status.upper()}: `{_cell(c.id)}`", "",
           f"- entry `{c.entry}`; check `{c.check or '-'}`", f"- {_cell(c.message)}"]
    if c.diagnosis:
        out.append(f"- **diagnosis:** {_cell(c.diagnosis, 800)}")
    row = c.first_failing_row
    if row is not None:
        m = row.get("metrics") or {}
        shown = ", ".join(f"{k} {fmt(m[k])}" for k in ("max_abs", "nmse", "kl", "top1_agree", "got_max_abs")
                          if m.get(k) is not None)
        out.append(f"- first failing row: {_cell(str(row.get('label')))} (position {row.get('position')}): {shown}")
        for who, key in (("oracle", "top_ref"), ("backend", "top_got")):
            ids, pieces = row.get(key) or [], row.get(f"{key}_pieces")
            if pieces:  # pieces may be fewer than ids in a hand-edited report: the ids beyond are not shown
                toks = ", ".join(f"{i} {p!r}" for i, p in zip(ids, pieces, strict=False))
            else:
                toks = ", ".join(map(str, ids))
            out.append(f"- {who} top-{len(ids)}: {_cell(toks)}")
    return out + [""]


def markdown_summary(result: RunResult) -> str:
    """The run as Markdown, for a CI job's summary page."""
    code = result.exit_code
    b = result.backend
    used = [s for s in result.sets if s.cases_selected]
    lines = [f"## {ICON.get(code, '❌')} Gemma 4 conformance: `{_cell(str(b.get('name')))}`", "",
             f"**{exit_line(code)}** ({counts_line(result)}); profile `{getattr(result.profile, 'name', '?')}`; "
             f"fixture sets: {', '.join(s.label() for s in used) or 'none'}"
             + (f"; selected with `{_cell(result.select)}`" if result.select else ""), ""]
    if result.aborted is not None:
        what = "did not finish" if result.aborted["reason"] == "unfinished" else "could not start or go on"
        return "\n".join(lines + [f"> The run {what}: {_cell(result.aborted['message'], 2000)}"]) + "\n"
    if result.interrupted is not None:
        lines += [f"> The run ended early: {_cell(result.interrupted['message'])}.", ""]
    if len(used) > 1:
        lines += _table("fixture set", matrix(result.cases, lambda c: [c.set])) + [""]
    lines += _table("entry point", matrix(result.cases, lambda c: [c.entry])) + [""]
    feature = matrix(result.cases, lambda c: [f for f in c.features if f not in ENTRY_TAGS])
    if feature:
        lines += ["<details><summary>per feature</summary>", ""] + _table("feature", feature) + ["", "</details>", ""]
    failing = [c for s in FAILING for c in result.cases if c.status == s]
    if failing:
        lines += [f"### First failing cases ({min(len(failing), MAX_CASES)} of {len(failing)})", ""]
        for c in failing[:MAX_CASES]:
            lines += _case(c)
        lines.append("The JSON report has every row of every case; `conformance explain --from REPORT.json` names the "
                     "layer where each failing case first leaves the oracle.")
    return "\n".join(lines).rstrip() + "\n"


def write_summary(result: RunResult, path: str | Path) -> Path:
    """Write the summary to ``path`` (``-``: standard output)."""
    return write_output(path, markdown_summary(result))


def append_summary(result: RunResult, path: str | Path) -> Path:
    """Append the summary to ``path`` (a job summary file collects the summaries of several steps)."""
    path = Path(path)
    with path.open("a", encoding="utf-8") as f:
        f.write(markdown_summary(result))
    return path
