"""Reports of a conformance run: JSON (schema v1), JUnit XML, the console summary and progress bar.

* ``to_json(result)`` / ``write_json(result, path)``: the versioned JSON report, described by
  ``conformance/schemas/report-v1.json``; ``validate(instance, schema)`` checks a document against
  the (small) subset of JSON Schema that file uses, without any dependency.
* ``write_junit(result, path)``: JUnit XML, one ``<testsuite>`` per fixture set, one ``<testcase>``
  per case (classname ``<set>/<kind>``), ``<failure>`` for fail and xpass, ``<error>`` for error,
  ``<skipped>`` for not-claimed, skipped and xfail.
* ``ProgressBar``: the progress callback for ``runner.run`` (a carriage-return bar on a terminal,
  one plain line per finished case otherwise).
* ``console_summary(result)``: the text printed at the end of ``conformance check``.

Non-finite numbers cannot be written in JSON; the report writes them as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import socket
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, TextIO

from .runner import FAILING, STATUSES, CaseResult, RunResult

SCHEMA = "gemma4-conformance/report"
SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "report-v1.json"

# the console table's columns, in order
COLUMNS = ("pass", "fail", "error", "xfail", "xpass", "skipped", "not-claimed")
ABBREV = {"not-claimed": "n/c"}
# feature tags that only repeat the entry point (shown in the entry-point table instead)
MAX_LISTED = 10  # failing case ids listed after the first failure's details
ENTRY_TAGS = {"full", "last", "plain", "seq_id", "embeddings", "prefill", "multi"}


# ----------------------------------------------------------------------------------------------
# text from backends and sets

# control characters (C0 but tab and newline, DEL, C1), lone surrogates and the XML non-characters:
# a terminal acts on them (ESC starts an escape sequence, C1 0x9b too) and XML 1.0 cannot hold them
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def printable(text: str) -> str:
    """``text`` with every control character written as a visible escape (ESC as ``\\x1b``, NUL as
    ``\\x00``): safe for a terminal and for XML. Tabs and newlines stay. Text from a backend or a set
    (exception messages, an engine's stderr, case ids) goes through this before it reaches the console
    or JUnit; the JSON report keeps it as it was (JSON escapes control characters itself)."""
    return _UNPRINTABLE.sub(_escape, str(text))


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


# ----------------------------------------------------------------------------------------------
# JSON


def _clean(x: Any) -> Any:
    """JSON-safe copy: non-finite floats as strings, tuples as lists, numpy scalars as Python."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return _clean(x.item())
        if isinstance(x, np.ndarray):
            return _clean(x.tolist())
    except ImportError:  # pragma: no cover
        pass
    return str(x)


def profile_json(profile: Any) -> dict[str, Any]:
    if hasattr(profile, "to_json"):
        return _clean(profile.to_json())
    if is_dataclass(profile):
        return _clean(asdict(profile))
    return _clean(dict(profile))


def _matrix(cases: list[CaseResult], key) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for c in cases:
        for k in key(c):
            row = out.setdefault(k, {s: 0 for s in STATUSES})
            row[c.status] += 1
    return out


def summary_json(result: RunResult) -> dict[str, Any]:
    cases = result.cases
    by_entry_feature: dict[str, dict[str, dict[str, int]]] = {}
    for c in cases:
        for f in c.features or ["(none)"]:
            cell = by_entry_feature.setdefault(c.entry, {}).setdefault(f, {s: 0 for s in STATUSES})
            cell[c.status] += 1
    return {
        "total": len(cases),
        "by_status": result.counts(),
        "by_set": _matrix(cases, lambda c: [c.set]),
        "by_entry": _matrix(cases, lambda c: [c.entry]),
        "by_feature": _matrix(cases, lambda c: list(c.features)),
        "by_entry_feature": by_entry_feature,
    }


def _versions() -> dict[str, Any]:
    from . import __version__

    out: dict[str, Any] = {"conformance": __version__, "python": platform.python_version(),
                           "platform": platform.platform()}
    try:
        import refimpl

        out["refimpl"] = refimpl.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import numpy

        out["numpy"] = numpy.__version__
    except Exception:  # noqa: BLE001
        pass
    return out


def to_json(result: RunResult, *, exit_code: int | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """The JSON report (a dict) of a run; see conformance/schemas/report-v1.json and docs/conformance.md."""
    return _clean({
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "harness": _versions(),
        "command": list(argv) if argv is not None else None,
        "backend": result.backend,
        "profile": profile_json(result.profile),
        "fixture_sets": [s.to_json() for s in result.sets],
        "select": result.select,
        "started": result.started.isoformat().replace("+00:00", "Z"),
        "finished": result.finished.isoformat().replace("+00:00", "Z"),
        "duration": result.duration,
        "exit_code": result.exit_code if exit_code is None else exit_code,
        "interrupted": result.interrupted,
        "summary": summary_json(result),
        "expectations": result.expectations,
        "cases": [c.to_json() for c in result.cases],
    })


def write_json(result: RunResult, path: str | Path, **kw) -> Path:
    """Write the JSON report to ``path`` (``-``: standard output)."""
    text = json.dumps(to_json(result, **kw), indent=1, allow_nan=False) + "\n"
    return write_output(path, text)


def write_output(path: str | Path, text: str) -> Path:
    """``text`` into the file ``path``, or onto standard output for ``-``."""
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return Path("-")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


# -- a validator for the subset of JSON Schema used by report-v1.json --------------------------
#
# Supported keywords: type (string or list), properties, required, additionalProperties (bool or
# schema), items, enum, const, minimum, pattern, anyOf, $ref (local "#/$defs/NAME"), and the
# annotations title / description / $schema / $id (ignored).

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_KNOWN = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "minimum",
          "pattern", "anyOf", "$ref", "title", "description", "$schema", "$id", "$defs"}


def validate(instance: Any, schema: dict[str, Any] | None = None, *, max_errors: int = 50) -> list[str]:
    """Problems of ``instance`` against ``schema`` (default: the report v1 schema); empty when valid."""
    root = load_schema() if schema is None else schema
    errors: list[str] = []
    _validate(instance, root, root, "$", errors, max_errors)
    return errors


def _resolve(ref: str, root: dict) -> dict:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref are supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _validate(v: Any, s: dict, root: dict, at: str, errors: list[str], cap: int) -> None:
    if len(errors) >= cap:
        return
    unknown = set(s) - _KNOWN
    if unknown:
        raise ValueError(f"schema at {at} uses unsupported keyword(s) {sorted(unknown)}")
    if "$ref" in s:
        _validate(v, _resolve(s["$ref"], root), root, at, errors, cap)
    if "anyOf" in s:
        for sub in s["anyOf"]:
            trial: list[str] = []
            _validate(v, sub, root, at, trial, cap)
            if not trial:
                break
        else:
            errors.append(f"{at}: {_short(v)} matches none of the allowed forms")
            return
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_TYPES[t](v) for t in types):
            errors.append(f"{at}: expected {' or '.join(types)}, got {_short(v)}")
            return
    if "const" in s and v != s["const"]:
        errors.append(f"{at}: expected {s['const']!r}, got {_short(v)}")
    if "enum" in s and v not in s["enum"]:
        errors.append(f"{at}: {_short(v)} is not one of {s['enum']}")
    if "minimum" in s and _TYPES["number"](v) and v < s["minimum"]:
        errors.append(f"{at}: {v} is below the minimum {s['minimum']}")
    if "pattern" in s and isinstance(v, str) and not re.search(s["pattern"], v):
        errors.append(f"{at}: {v!r} does not match {s['pattern']!r}")
    if isinstance(v, dict):
        props = s.get("properties", {})
        for k in s.get("required", []):
            if k not in v:
                errors.append(f"{at}: missing required property {k!r}")
        extra = s.get("additionalProperties", True)
        for k, val in v.items():
            if k in props:
                _validate(val, props[k], root, f"{at}.{k}", errors, cap)
            elif extra is False:
                errors.append(f"{at}: unexpected property {k!r}")
            elif isinstance(extra, dict):
                _validate(val, extra, root, f"{at}.{k}", errors, cap)
    if isinstance(v, list) and "items" in s:
        for i, item in enumerate(v):
            _validate(item, s["items"], root, f"{at}[{i}]", errors, cap)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# ----------------------------------------------------------------------------------------------
# JUnit XML

_KEY_METRICS = ("max_abs", "nmse", "kl_max", "kl_mean", "top1_rate")


def _fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def junit_tree(result: RunResult) -> ET.ElementTree:
    """JUnit XML: <testsuites> with one <testsuite> per fixture set."""
    root = ET.Element("testsuites", name="gemma4-conformance")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    timestamp = result.started.strftime("%Y-%m-%dT%H:%M:%S")
    host = socket.gethostname()
    for info in result.sets:
        cases = [c for c in result.cases if c.set == info.name]
        counts = {
            "tests": len(cases),
            "failures": sum(c.status in ("fail", "xpass") for c in cases),
            "errors": sum(c.status == "error" for c in cases),
            "skipped": sum(c.status in ("not-claimed", "skipped", "xfail") for c in cases),
        }
        for k in totals:
            totals[k] += counts[k]
        suite = ET.SubElement(root, "testsuite", name=info.name, timestamp=timestamp, hostname=host,
                              time=f"{sum(c.duration for c in cases):.3f}", **{k: str(v) for k, v in counts.items()})
        props = ET.SubElement(suite, "properties")
        stop = result.interrupted
        for k, v in (("backend", result.backend.get("name")), ("profile", getattr(result.profile, "name", "")),
                     ("fixture_set_version", info.version), ("fixture_set_path", info.path),
                     ("manifest_sha256", info.manifest_sha256), ("select", result.select or ""),
                     *((("interrupted", f"{stop['message']} ({stop['cases_not_run']} cases not run)"),)
                       if stop else ())):
            ET.SubElement(props, "property", name=k, value=str(v))
        for c in cases:
            tc = ET.SubElement(suite, "testcase", classname=f"{c.set}/{c.kind}", name=c.id, time=f"{c.duration:.3f}")
            cprops = [("status", c.status), ("entry", c.entry), ("features", ",".join(c.features))]
            if c.check:
                cprops.append(("check", c.check))
            cprops += [(k, _fmt(c.summary[k])) for k in _KEY_METRICS if k in c.summary]
            if c.first_divergence is not None:
                cprops.append(("first_divergence", str(c.first_divergence)))
            pe = ET.SubElement(tc, "properties")
            for k, v in cprops:
                ET.SubElement(pe, "property", name=k, value=str(v))
            msg = _one_line(c.message)
            if c.status == "fail":
                el = ET.SubElement(tc, "failure", message=msg, type=c.check or "fail")
                el.text = _failure_text(c)
            elif c.status == "xpass":
                el = ET.SubElement(tc, "failure", message=f"[XPASS] {msg}", type="xpass")
                el.text = c.message
            elif c.status == "error":
                err = c.error or {}
                el = ET.SubElement(tc, "error", message=msg, type=err.get("type") or c.check or "error")
                el.text = err.get("traceback") or c.message
            elif c.status == "xfail":
                ET.SubElement(tc, "skipped", message=f"[XFAIL] {msg}", type="xfail")
            elif c.status == "skipped":
                ET.SubElement(tc, "skipped", message=msg, type="skipped")
            elif c.status == "not-claimed":
                ET.SubElement(tc, "skipped", message=f"not claimed: {msg}", type="not-claimed")
    for k, v in totals.items():
        root.set(k, str(v))
    root.set("time", f"{result.duration:.3f}")
    for el in root.iter():  # text from backends and sets: XML 1.0 cannot hold control characters
        el.text = None if el.text is None else printable(el.text)
        for k, v in el.attrib.items():
            el.set(k, printable(v))
    return ET.ElementTree(root)


def write_junit(result: RunResult, path: str | Path) -> Path:
    """Write the JUnit XML to ``path`` (``-``: standard output)."""
    tree = junit_tree(result)
    ET.indent(tree, space=" ")
    text = ET.tostring(tree.getroot(), encoding="unicode", xml_declaration=False)
    return write_output(path, "<?xml version='1.0' encoding='utf-8'?>\n" + text + "\n")


def _one_line(s: str, limit: int = 500) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _failure_text(c: CaseResult) -> str:
    lines = [c.message]
    row = c.first_failing_row
    if row is not None:
        lines.append(f"first failing row: {row.get('label')} (position {row.get('position')}), "
                     f"check {row.get('check')}")
        lines.append("metrics: " + ", ".join(f"{k}={_fmt(v)}" for k, v in (row.get("metrics") or {}).items()))
        lines.append(f"oracle top: {row.get('top_ref')}  backend top: {row.get('top_got')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# console


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
    out = ["  ".join([title.ljust(w0)] + [h.rjust(w) for h, w in zip(heads, widths)])]
    out.append("  ".join(["-" * w0] + ["-" * w for w in widths]))
    for n in names:
        vals = [rows[n].get(c, 0) for c in cols] + [sum(rows[n].values())]
        cells = [(str(v) if v else ".").rjust(w) for v, w in zip(vals, widths)]
        out.append("  ".join([n.ljust(w0)] + cells))
    return out


def _tokens(ids: list[int], pieces: list[str] | None) -> str:
    if not ids:
        return "-"
    if pieces:
        return "  ".join(f"{i} {p!r}" for i, p in zip(ids, pieces))
    return "  ".join(str(i) for i in ids)


def failure_details(c: CaseResult) -> list[str]:
    """Lines describing one non-passing case: its first failing row, metrics and top tokens."""
    out = [f"{c.status.upper()}: {c.id}", f"  entry {c.entry}; features {', '.join(c.features) or '-'}"]
    if c.check:
        out.append(f"  check: {c.check}")
    out.append(f"  {_one_line(c.message, 400)}")
    if c.status == "error" and c.error:
        tb = (c.error.get("traceback") or "").rstrip().splitlines()[-4:]
        out += ["  | " + line for line in tb]
    row = c.first_failing_row
    if row is not None:
        out.append(f"  first failing row: {row.get('label')} (position {row.get('position')})"
                   f", check {row.get('check')}")
        metrics = row.get("metrics") or {}
        if metrics:
            out.append("  metrics: " + ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))
        out.append(f"  oracle  top-{len(row.get('top_ref') or [])}: {_tokens(row.get('top_ref') or [], row.get('top_ref_pieces'))}")
        out.append(f"  backend top-{len(row.get('top_got') or [])}: {_tokens(row.get('top_got') or [], row.get('top_got_pieces'))}")
    if c.first_divergence is not None:
        out.append(f"  generation diverges at step {c.first_divergence}")
    if c.executed:
        out.append("  backend executed: " + _one_line(json.dumps(_clean(c.executed), sort_keys=True), 300))
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
    sets = ", ".join(f"{s.name} {s.version}" for s in used)
    unused = len(result.sets) - len(used)
    if unused:
        sets += f" ({unused} other set{'s' if unused > 1 else ''} with no selected case)"
    lines.append(f"backend {b.get('name')} | profile {prof} | fixture sets: {sets}")
    if result.select:
        lines.append(f"selected with -k {result.select!r}")
    for s in result.sets:
        for w in s.warnings:
            lines.append(f"warning: {w}")
    if len({c.set for c in result.cases}) > 1:
        lines.append("")
        lines += _table("fixture set", _matrix(result.cases, lambda c: [c.set]))
    lines.append("")
    lines += _table("entry point", _matrix(result.cases, lambda c: [c.entry]))
    lines.append("")
    lines += _table("feature", _matrix(result.cases, lambda c: [f for f in c.features if f not in ENTRY_TAGS]))
    first = result.first_failure()
    if first is not None:
        lines.append("")
        lines += failure_details(first)
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
            lines += failure_details(c)
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
    counts = result.counts()
    lines.append("")
    parts = [f"{counts[s]} {s}" for s in ("pass", "fail", "error", "xfail", "xpass", "skipped", "not-claimed")
             if counts[s]]
    lines.append(f"{len(result.cases)} cases: " + ", ".join(parts) + f" in {result.duration:.1f}s")
    if result.interrupted is not None:
        stop = result.interrupted
        lines.append(f"the run ended early: {stop['message']}; {stop['cases_not_run']} selected "
                     f"case{'s' if stop['cases_not_run'] != 1 else ''} not run")
    elif result.exit_code == 5:
        lines.append("no case was run: every selected case is not claimed by the backend or skipped")
    lines.append(exit_line(result.exit_code))
    return "\n".join(lines)


def is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except Exception:  # noqa: BLE001
        return False
