"""The self-test's faces: its table (one row a mutant: which check at which case caught it, per profile), the
console summary and the JSON document (schema ``gemma4-conformance/selftest``)."""


from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from ..report.json_report import clean, versions, write_output
from .results import CONTROL_PROFILE, SCHEMA, SCHEMA_VERSION, MutantResult, SelftestResult

__all__ = ["MISMATCH_MARK", "EQUIVALENT_MARK", "table_rows", "format_table", "console_summary", "to_json", "write_json"]


# ----------------------------------------------------------------------------------------------
# output

#: the mark after a check that does not match the mutant's bug
MISMATCH_MARK = " (!)"
#: the primary-profile cell of an equivalent mutant that no float profile can see
EQUIVALENT_MARK = "equivalent*"


def _cell_profile(m: MutantResult, profile: str) -> str:
    if m.error is not None:
        return "-"
    if m.rewrite is not None:  # (not a bug: it passes or fails)
        return "passes" if m.survives(profile) else f"FAILED ({m.verdicts[profile].failing_cases})"
    return "survives" if m.survives(profile) else f"killed ({m.verdicts[profile].failing_cases})"


def _counted(result: SelftestResult) -> str:
    """'N mutant(s)', and the rewrites beside them when there are some."""
    rewrites = sum(m.rewrite is not None for m in result.mutants)
    return f"{len(result.mutants) - rewrites} mutant(s)" + (f" and {rewrites} rewrite(s)" if rewrites else "")


def table_rows(result: SelftestResult, breaks_width: int | None = 48) -> list[list[str]]:
    """The table as rows of cells (a header row first). A 'breaks' text longer than ``breaks_width``
    is wrapped onto continuation rows (the other cells empty); None: never wrapped."""
    primary = result.primary
    others = result.profiles[1:]
    head = ["mutant", "bug class", "breaks", primary, "check", "first case", "failing"] + others
    rows = [head]
    c = result.control
    v = c.verdict
    ctl_status = "ERROR" if c.error else ("pass" if c.passed else "FAILED")
    rows.append([f"(control) {c.backend}", "-", f"nothing (graded at {c.profile})", ctl_status,
                 (v.check or "-") if v.killed else "-", v.first_case or "-",
                 f"{v.failing_cases}/{v.cases_run}"] + ["-"] * len(others))

    def add(cells: list[str]) -> None:
        text = cells[2]
        if breaks_width is None or len(text) <= breaks_width:
            rows.append(cells)
            return
        parts = textwrap.wrap(text, breaks_width, break_long_words=True) or [text]
        rows.append(cells[:2] + [parts[0]] + cells[3:])
        rows.extend(["", ""] + [p] + [""] * (len(cells) - 3) for p in parts[1:])

    for m in result.mutants:
        mv = m.verdict
        if m.error is not None:
            add([m.name, m.bug_class, m.breaks, "ERROR", "-", "-", "-"] + ["-"] * len(others))
            continue
        if m.rewrite is not None:  # the same function: must pass at exact-f64
            rv = m.verdicts[CONTROL_PROFILE]
            add([f"(rewrite) {m.name}", m.bug_class, m.breaks, "FAILED" if rv.killed else "passes",
                 f"{CONTROL_PROFILE}: {rv.check}" if rv.killed else f"{CONTROL_PROFILE}: passes",
                 rv.first_case or "-", f"{rv.failing_cases}/{rv.cases_run}"] + [_cell_profile(m, p) for p in others])
            continue
        if m.equivalent is not None:
            ev = m.verdicts[CONTROL_PROFILE]
            status = "killed" if m.killed else EQUIVALENT_MARK
            check = f"{CONTROL_PROFILE}: {ev.check}" if ev.killed else f"{CONTROL_PROFILE}: survives"
            add([m.name, m.bug_class, m.breaks, status, check, ev.first_case or "-",
                 f"{ev.failing_cases}/{ev.cases_run}"] + [_cell_profile(m, p) for p in others])
            continue
        case, check = m.caught_by
        check_cell = "-" if not m.killed else (check or "-") + ("" if m.matching else MISMATCH_MARK)
        add([m.name, m.bug_class, m.breaks, "killed" if m.killed else "SURVIVED", check_cell,
             case or "-", f"{mv.failing_cases}/{mv.cases_run}"] + [_cell_profile(m, p) for p in others])
    return rows


def format_table(result: SelftestResult, breaks_width: int | None = 48) -> str:
    rows = table_rows(result, breaks_width)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {6}  # the failing column
    lines = []
    for n, r in enumerate(rows):
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def console_summary(result: SelftestResult, breaks_width: int | None = 48) -> str:
    """The text ``conformance selftest`` prints: header, table, verdict, exit line."""
    sets = ", ".join(f"{s['name']} {s['version']}" for s in result.sets if s["cases_selected"])
    primary = result.primary
    lines = [f"self-test: {_counted(result)} of {result.control.backend}, graded at {primary} "
             f"(verdict) and {', '.join(result.profiles[1:]) or 'no other profile'} (information); "
             f"{result.cases} case(s) from {sets or 'no set'}"]
    if result.select:
        lines.append(f"selected with {result.select}")
    if result.control.note:
        lines.append(f"note: {result.control.note}")
    lines.append("")
    lines.append(format_table(result, breaks_width))
    if any(m.killed and not m.matching and m.equivalent is None and m.rewrite is None for m in result.mutants):
        lines.append(f"{MISMATCH_MARK.strip()} killed, but not by a check that matches the bug")
    for m in result.mutants:
        if m.equivalent is not None:
            lines.append(f"* {m.name}: equivalent at float precision, graded at {CONTROL_PROFILE} (its row shows "
                         f"that verdict): {m.equivalent}")
        if m.rewrite is not None:
            lines.append(f"* (rewrite) {m.name}: not a bug, graded at {CONTROL_PROFILE}, where it must pass: "
                         f"{m.rewrite}")
    lines.append("")
    if result.valid:
        for p in result.profiles[1:]:
            surv = result.survivors(p)
            lines.append(f"would survive at {p}: " + (", ".join(surv) if surv else "none")
                         + f" ({len(surv)} of {sum(m.rewrite is None for m in result.mutants)})")

    problems = result.problems()
    if not problems:
        eq = [m.name for m in result.mutants if m.equivalent is not None]
        rw = [m.name for m in result.mutants if m.rewrite is not None]
        lines.append(f"every mutant killed at {primary} by a matching check"
                     + (f" (equivalent ones at {CONTROL_PROFILE}: {', '.join(eq)})" if eq else "")
                     + (f"; the rewrites pass at {CONTROL_PROFILE}: {', '.join(rw)}" if rw else "")
                     + f"; the control passes at {result.control.profile}")
    else:
        head = "SELF-TEST INVALID" if not result.valid else "SELF-TEST FAILED"
        lines.append(f"{head}:")
        lines += [f"  - {p}" for p in problems]
    lines.append(f"{_counted(result)} x {result.cases} case(s) in {result.duration:.1f}s")
    code = result.exit_code
    lines.append(f"exit {code}: " + ("self-test passed" if code == 0 else
                                      "self-test invalid (the control fails)" if not result.valid else
                                      "self-test failed"))
    return "\n".join(lines)


def to_json(result: SelftestResult, *, argv: list[str] | None = None) -> dict[str, Any]:
    return clean({
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "harness": versions(),
        "command": list(argv) if argv is not None else None,
        "profiles": list(result.profiles),
        "primary_profile": result.primary,
        "fixture_sets": result.sets,
        "select": result.select,
        "cases": result.cases,
        "started": result.started.isoformat().replace("+00:00", "Z"),
        "finished": result.finished.isoformat().replace("+00:00", "Z"),
        "duration": result.duration,
        "valid": result.valid,
        "control": result.control.to_json(),
        "mutants": [m.to_json() for m in result.mutants],
        "survivors": {p: result.survivors(p) for p in result.profiles},
        "problems": result.problems(),
        "exit_code": result.exit_code,
    })


def write_json(result: SelftestResult, path: str | Path, **kw) -> Path:
    """Write the self-test table as JSON to ``path`` (``-``: standard output)."""
    return write_output(path, json.dumps(to_json(result, **kw), indent=1, allow_nan=False) + "\n")
