"""What a person reads: the progress bar of a run (``ProgressBar``) and the console summary at its end
(``console_summary``: tables per entry point and per feature, the first failure's rows, metrics and top
tokens, the counts and the exit line)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import TextIO

from ..check.results import FAILING, CaseResult, RunResult
from .json_report import clean, matrix
from .junit import fmt, one_line
from .text import printable

# the console table's columns, in order
COLUMNS = ("pass", "fail", "error", "xfail", "xpass", "skipped", "not-claimed")


ABBREV = {"not-claimed": "n/c"}


# feature tags that only repeat the entry point (shown in the entry-point table instead)
MAX_LISTED = 10  # failing case ids listed after the first failure's details


ENTRY_TAGS = {"full", "last", "plain", "seq_id", "embeddings", "prefill", "multi"}


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressBar:
    """Progress callback for ``runner.run``: ``bar(done, total, case_id, result)``.

    On a terminal: one line redrawn with a carriage return (bar, count, elapsed time, current case);
    otherwise one plain line per finished case. ``close()`` clears the bar.
    """

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.t0 = time.monotonic()
        self._drawn = False

    def __call__(self, done: int, total: int, case_id: str, result: CaseResult | None = None) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns
            bar_w = 24
            filled = int(bar_w * done / total) if total else bar_w
            head = f"[{'#' * filled}{'.' * (bar_w - filled)}] {done}/{total} {_hms(elapsed)} "
            room = max(width - len(head) - 1, 10)
            case_id = printable(case_id)
            cid = case_id if len(case_id) <= room else "..." + case_id[-(room - 3):]
            self.stream.write("\r" + (head + cid).ljust(width - 1))
            self.stream.flush()
            self._drawn = True
        elif result is not None:
            w = len(str(total))
            extra = f" [{result.check}]" if result.check and result.status != "pass" else ""
            self.stream.write(printable(f"[{done:>{w}}/{total}] {result.status:<11} {case_id}{extra} "
                                        f"({result.duration:.2f}s)") + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """A plain line (e.g. 'generating base A'), printed above the bar."""
        if not self.enabled:
            return
        if self.tty and self._drawn:
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (width - 1) + "\r")
        self.stream.write(printable(text) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn:
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (width - 1) + "\r")
            self.stream.flush()
            self._drawn = False


def _table(title: str, rows: dict[str, dict[str, int]]) -> list[str]:
    if not rows:
        return []
    names = list(rows)
    w0 = max(len(title), *(len(n) for n in names))
    cols = [c for c in COLUMNS if any(rows[n].get(c, 0) for n in names)] or ["pass"]
    heads = [ABBREV.get(c, c) for c in cols] + ["total"]
    widths = [max(len(h), 5) for h in heads]
    out = ["  ".join([title.ljust(w0)] + [h.rjust(w) for h, w in zip(heads, widths, strict=True)])]
    out.append("  ".join(["-" * w0] + ["-" * w for w in widths]))
    for n in names:
        vals = [rows[n].get(c, 0) for c in cols] + [sum(rows[n].values())]
        cells = [(str(v) if v else ".").rjust(w) for v, w in zip(vals, widths, strict=True)]
        out.append("  ".join([n.ljust(w0)] + cells))
    return out


def _tokens(ids: list[int], pieces: list[str] | None) -> str:
    if not ids:
        return "-"
    if pieces:
        return "  ".join(f"{i} {p!r}" for i, p in zip(ids, pieces, strict=False))
    return "  ".join(str(i) for i in ids)


ROW_METRICS = ("max_abs", "nmse", "kl", "got_max_abs")  # the columns of -v's failing-row list


def failing_rows(c: CaseResult) -> list[str]:
    """Every failing row of a case, one line each: label, position, check and the main metrics."""
    bad = [r for r in c.rows if r.get("status") == "fail"]
    if not bad:
        return []
    out = [f"  failing rows ({len(bad)} of {len(c.rows)}):"]
    for r in bad:
        m = r.get("metrics") or {}
        shown = ", ".join(f"{k}={fmt(m[k])}" for k in ROW_METRICS if m.get(k) is not None)
        out.append(f"    {r.get('label')} (position {r.get('position')}): "
                   f"{r.get('check')}" + (f"; {shown}" if shown else ""))
    return out


def failure_details(c: CaseResult, verbose: bool = False) -> list[str]:
    """Lines describing one non-passing case: its diagnosis, its first failing row, metrics and top tokens
    (``verbose``: every failing row too)."""
    out = [f"{c.status.upper()}: {c.id}", f"  entry {c.entry}; features {', '.join(c.features) or '-'}"]
    if c.check:
        out.append(f"  check: {c.check}")
    out.append(f"  {one_line(c.message, 400)}")
    if c.diagnosis:
        out.append(f"  diagnosis: {one_line(c.diagnosis, 500)}")
    if c.status == "error" and c.error:
        tb = (c.error.get("traceback") or "").rstrip().splitlines()[-4:]
        out += ["  | " + line for line in tb]
    row = c.first_failing_row
    if row is not None:
        out.append(f"  first failing row: {row.get('label')} (position {row.get('position')})"
                   f", check {row.get('check')}")
        metrics = row.get("metrics") or {}
        if metrics:
            out.append("  metrics: " + ", ".join(f"{k}={fmt(v)}" for k, v in metrics.items()))
        out.append(f"  oracle  top-{len(row.get('top_ref') or [])}: "
                   f"{_tokens(row.get('top_ref') or [], row.get('top_ref_pieces'))}")
        out.append(f"  backend top-{len(row.get('top_got') or [])}: "
                   f"{_tokens(row.get('top_got') or [], row.get('top_got_pieces'))}")
    if verbose:
        out += failing_rows(c)
    if c.first_divergence is not None:
        out.append(f"  generation diverges at step {c.first_divergence}")
    if c.executed:
        out.append("  backend executed: " + one_line(json.dumps(clean(c.executed), sort_keys=True), 300))
    return out


def exit_line(code: int, counts: dict[str, int] | None = None) -> str:
    meaning = {0: "all selected cases passed", 1: "some cases failed", 2: "usage error",
               3: "fixture integrity error", 4: "backend error", 5: "no case was run",
               129: "interrupted by SIGHUP", 130: "interrupted by SIGINT", 143: "interrupted by SIGTERM"}.get(code, "")
    return f"exit {code}: {meaning}" if meaning else f"exit {code}"


def console_summary(result: RunResult, *, verbose: bool = False) -> str:
    """The end-of-run summary: tables per entry point and per feature, the first failure, counts."""
    lines: list[str] = []
    b = result.backend
    prof = getattr(result.profile, "name", "?")
    used = [s for s in result.sets if s.cases_selected]
    sets = ", ".join(s.label() for s in used)
    unused = len(result.sets) - len(used)
    if unused:
        sets += f" ({unused} other set{'s' if unused > 1 else ''} with no selected case)"
    lines.append(f"backend {b.get('name')} | profile {prof} | fixture sets: {sets}")
    if result.select:
        lines.append(f"selected with {result.select}")
    for s in result.sets:
        for w in s.warnings:
            lines.append(f"warning: {w}")
    if len({c.set for c in result.cases}) > 1:
        lines.append("")
        lines += _table("fixture set", matrix(result.cases, lambda c: [c.set]))
    lines.append("")
    lines += _table("entry point", matrix(result.cases, lambda c: [c.entry]))
    lines.append("")
    lines += _table("feature", matrix(result.cases, lambda c: [f for f in c.features if f not in ENTRY_TAGS]))
    first = result.first_failure()
    if first is not None:
        lines.append("")
        lines += failure_details(first, verbose)
        others = [c for c in result.cases if c.status in FAILING and c is not first]
        if others and not verbose:
            lines.append("")
            lines.append(f"{len(others)} more failing case(s) (-v shows each; the JSON report has every row):")
            for c in others[:MAX_LISTED]:
                lines.append(f"  {c.status:<5} {c.id}" + (f"  [{c.check}]" if c.check else ""))
            if len(others) > MAX_LISTED:
                lines.append(f"  ... and {len(others) - MAX_LISTED} more")
    if verbose:
        others = [c for c in result.cases if c.status in FAILING and c is not first]
        for c in others:
            lines.append("")
            lines += failure_details(c, verbose)
    exp = result.expectations or {}
    if exp.get("expired"):
        lines.append("")
        lines.append(f"expectations: {len(exp['expired'])} expired entr{'y' if len(exp['expired']) == 1 else 'ies'} "
                     "(no longer applied; renew or remove):")
        for e in exp["expired"]:
            lines.append(f"  entry {e['index']} ({e['action']}, match {e['match']!r}) expired {e.get('expires')}: "
                         f"{e['reason']}")
    if exp.get("unused"):
        lines.append("")
        lines.append(f"expectations: {len(exp['unused'])} entr{'y' if len(exp['unused']) == 1 else 'ies'} "
                     "matched no case:")
        for e in exp["unused"]:
            lines.append(f"  entry {e['index']} ({e['action']}, match {e['match']!r}): {e['reason']}")
    lines.append("")
    if result.timings:
        lines.append(timings_line(result))
    lines.append(counts_line(result))
    if result.interrupted is not None:
        stop = result.interrupted
        lines.append(f"the run ended early: {stop['message']}; {stop['cases_not_run']} selected "
                     f"case{'s' if stop['cases_not_run'] != 1 else ''} not run")
    elif result.exit_code == 5:
        lines.append("no case was run: every selected case is not claimed by the backend or skipped")
    lines.append(exit_line(result.exit_code))
    return "\n".join(lines)


PHASE_NAMES = {"load": "loading the sets", "checkpoint": "checkpoints", "rebuild": "rebuilding the oracle's rows",
               "open": "opening the backend", "grade": "grading"}


def timings_line(result: RunResult) -> str:
    """Where the run's time went: in the backend's requests, and outside them by phase (RunResult.timings)."""
    t = result.timings
    inside = t.get("backend", 0.0)
    phases = {k: t[k] for k in PHASE_NAMES if t.get(k, 0.0) > 0}
    other = max(0.0, result.duration - sum(v for k, v in t.items() if k != "load"))
    outside = sum(phases.values()) + other
    parts = [f"{PHASE_NAMES[k]} {v:.1f}s" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])]
    return (f"time: {inside:.1f}s in the backend's requests, {outside:.1f}s outside them ("
            + ", ".join(parts + [f"other {other:.1f}s"]) + ")")


def counts_line(result: RunResult) -> str:
    """"606 cases: 600 pass, 6 fail in 19.8s"."""
    counts = result.counts()
    parts = [f"{counts[s]} {s}" for s in ("pass", "fail", "error", "xfail", "xpass", "skipped", "not-claimed")
             if counts[s]]
    return f"{len(result.cases)} cases: " + ", ".join(parts) + f" in {result.duration:.1f}s"


def verdict_line(result: RunResult) -> str:
    """The one line of ``-q``: the exit status, what it means, the counts, and a run that ended early."""
    stop = result.interrupted
    early = "" if stop is None else (f"; the run ended early: {stop['message']}; {stop['cases_not_run']} selected "
                                     f"case{'s' if stop['cases_not_run'] != 1 else ''} not run")
    return f"{exit_line(result.exit_code)} ({counts_line(result)}){early}"


# ANSI colours of the summary's own line openings (applied after ``printable``, so that text from backends
# and sets can never carry an escape sequence of its own)
_RED, _GREEN, _YELLOW, _RESET = "\x1b[31;1m", "\x1b[32;1m", "\x1b[33m", "\x1b[0m"
_PAINT = ((("FAIL: ", "ERROR: ", "XPASS: "), _RED), (("  diagnosis: ",), _YELLOW), (("exit 0",), _GREEN),
          (("exit ",), _RED))


def colorize(text: str) -> str:
    """The summary with its verdict lines coloured: failing cases' headers and a failing exit line red, the
    diagnosis yellow, a passing exit line green."""
    out = []
    for line in text.split("\n"):
        for openings, colour in _PAINT:
            if line.startswith(openings):
                line = colour + line + _RESET
                break
        out.append(line)
    return "\n".join(out)


def use_color(stream: TextIO) -> bool:
    """Colour on a terminal, unless NO_COLOR is set (https://no-color.org) or TERM is dumb; FORCE_COLOR (non-empty)
    asks for it anywhere, e.g. in a CI log that renders ANSI colours."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return is_tty(stream) and os.environ.get("TERM") != "dumb"


def is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except Exception:  # noqa: BLE001 - a closed or odd stream is not a terminal
        return False


