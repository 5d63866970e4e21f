"""JUnit XML of a check run: one ``<testsuite>`` per fixture set with selected cases, one ``<testcase>`` per
case (classname ``<set>/<kind>``), ``<failure>`` for fail and xpass, ``<error>`` for error, ``<skipped>``
for not-claimed, skipped and xfail. Text from backends and sets is made printable (XML 1.0 holds no control
characters).

It follows the common JUnit schema that Jenkins, GitLab and the test-report actions read (the Jenkins xunit
plugin's ``junit-10.xsd``, which pytest's ``xunit2`` family also targets): properties only on a
``<testsuite>``, a case's record (status, entry point, features, check, key metrics) in its ``<system-out>``,
counts (``tests``, ``failures``, ``errors``, ``skipped``) on each suite and all but ``skipped`` on the root,
timestamps in ISO 8601 with their UTC offset. ``case_properties=True`` (``--junit-properties``) also writes
each case's record as ``<properties>`` inside its ``<testcase>``, as before: richer, outside that schema."""

from __future__ import annotations

import socket
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ..check.results import CaseResult, RunResult
from .json_report import write_output
from .text import printable

_KEY_METRICS = ("max_abs", "nmse", "kl_max", "kl_mean", "top1_rate")


def fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def junit_tree(result: RunResult, case_properties: bool = False) -> ET.ElementTree:
    """JUnit XML: <testsuites> with one <testsuite> per fixture set that had selected cases."""
    root = ET.Element("testsuites", name="gemma4-conformance")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    timestamp = result.started.isoformat(timespec="seconds")  # with its UTC offset: "2026-12-02T05:09:00+00:00"
    host = socket.gethostname()
    for info in result.sets:
        cases = [c for c in result.cases if c.set == info.name]
        if not cases:  # a set -k left out, or one the run did not reach: no empty suite
            continue
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
            cprops += [(k, fmt(c.summary[k])) for k in _KEY_METRICS if k in c.summary]
            if c.first_divergence is not None:
                cprops.append(("first_divergence", str(c.first_divergence)))
            if case_properties:
                pe = ET.SubElement(tc, "properties")
                for k, v in cprops:
                    ET.SubElement(pe, "property", name=k, value=str(v))
            msg = one_line(c.message)
            if c.status == "fail":
                el = ET.SubElement(tc, "failure", message=msg, type=c.check or "fail")
                el.text = _failure_text(c)
            elif c.status == "xpass":
                el = ET.SubElement(tc, "failure", message=f"[XPASS] {msg}", type="xpass")
                el.text = c.message
            elif c.status == "error":
                err = c.error or {}
                el = ET.SubElement(tc, "error", message=msg, type=err.get("type") or c.check or "error")
                el.text = c.message + ("\n" + err["traceback"] if err.get("traceback") else "")
            elif c.status == "xfail":
                ET.SubElement(tc, "skipped", message=f"[XFAIL] {msg}", type="xfail")
            elif c.status == "skipped":
                ET.SubElement(tc, "skipped", message=msg, type="skipped")
            elif c.status == "not-claimed":
                ET.SubElement(tc, "skipped", message=f"not claimed: {msg}", type="not-claimed")
            ET.SubElement(tc, "system-out").text = "; ".join(f"{k} {v}" for k, v in cprops)
    if result.aborted is not None:
        _aborted_suite(root, result, timestamp, host)
        totals["tests"] += 1
        totals["errors"] += 1
    for k in ("tests", "failures", "errors"):  # the schema has no "skipped" on <testsuites>
        root.set(k, str(totals[k]))
    root.set("time", f"{result.duration:.3f}")
    for el in root.iter():  # text from backends and sets: XML 1.0 cannot hold control characters
        el.text = None if el.text is None else printable(el.text)
        for k, v in el.attrib.items():
            el.set(k, printable(v))
    return ET.ElementTree(root)


def _aborted_suite(root: ET.Element, result: RunResult, timestamp: str, host: str) -> None:
    """A run that could not start or go on (or did not finish): one suite with one <error> test case, so
    that a CI job shows the error rather than "no test results"."""
    stop = result.aborted
    suite = ET.SubElement(root, "testsuite", name="gemma4-conformance", timestamp=timestamp, hostname=host,
                          time=f"{result.duration:.3f}", tests="1", failures="0", errors="1", skipped="0")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="backend", value=str(result.backend.get("name")))
    ET.SubElement(props, "property", name="exit_code", value=str(stop["exit_code"]))
    tc = ET.SubElement(suite, "testcase", classname="gemma4-conformance/run", name=f"run ({stop['reason']})",
                       time=f"{result.duration:.3f}")
    el = ET.SubElement(tc, "error", message=one_line(stop["message"]), type=stop["reason"])
    el.text = f"exit {stop['exit_code']}: {stop['message']}"


def write_junit(result: RunResult, path: str | Path, case_properties: bool = False) -> Path:
    """Write the JUnit XML to ``path`` (``-``: standard output)."""
    tree = junit_tree(result, case_properties)
    ET.indent(tree, space=" ")
    text = ET.tostring(tree.getroot(), encoding="unicode", xml_declaration=False)
    return write_output(path, "<?xml version='1.0' encoding='utf-8'?>\n" + text + "\n")


def one_line(s: str, limit: int = 500) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _failure_text(c: CaseResult) -> str:
    lines = [c.message]
    if c.diagnosis:
        lines.append(f"diagnosis: {c.diagnosis}")
    row = c.first_failing_row
    if row is not None:
        lines.append(f"first failing row: {row.get('label')} (position {row.get('position')}), "
                     f"check {row.get('check')}")
        lines.append("metrics: " + ", ".join(f"{k}={fmt(v)}" for k, v in (row.get("metrics") or {}).items()))
        lines.append(f"oracle top: {row.get('top_ref')}  backend top: {row.get('top_got')}")
    return "\n".join(lines)


