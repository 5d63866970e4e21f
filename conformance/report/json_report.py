"""The versioned JSON report of a check run (``to_json`` / ``write_json``), described by
``conformance/report/schemas/report-v1.json``; ``validate(instance, schema)`` checks a document against the
(small) subset of JSON Schema that file uses, without any dependency.

Non-finite numbers cannot be written in JSON; the report writes them as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``.
"""

from __future__ import annotations

import json
import math
import platform
import re
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy

import refimpl

from .. import __version__
from ..check.results import STATUSES, CaseResult, RunResult

SCHEMA = "gemma4-conformance/report"


SCHEMA_VERSION = 1


SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "report-v1.json"


def clean(x: Any) -> Any:
    """JSON-safe copy: non-finite floats as strings, tuples as lists, numpy scalars as Python."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
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
    if isinstance(x, numpy.generic):
        return clean(x.item())
    if isinstance(x, numpy.ndarray):
        return clean(x.tolist())
    return str(x)


def profile_json(profile: Any) -> dict[str, Any]:
    if hasattr(profile, "to_json"):
        return clean(profile.to_json())
    if is_dataclass(profile):
        return clean(asdict(profile))
    return clean(dict(profile))


def matrix(cases: list[CaseResult], key) -> dict[str, dict[str, int]]:
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
        "by_set": matrix(cases, lambda c: [c.set]),
        "by_entry": matrix(cases, lambda c: [c.entry]),
        "by_feature": matrix(cases, lambda c: list(c.features)),
        "by_entry_feature": by_entry_feature,
    }


def versions() -> dict[str, Any]:
    """Versions of the harness, the oracle, Python, NumPy and the platform, as a report records them."""
    return {"conformance": __version__, "python": platform.python_version(), "platform": platform.platform(),
            "refimpl": refimpl.__version__, "numpy": numpy.__version__}


def to_json(result: RunResult, *, exit_code: int | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """The JSON report (a dict) of a run; see conformance/report/schemas/report-v1.json and docs/conformance.md."""
    return clean({
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "harness": versions(),
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
        "aborted": result.aborted,
        "timings": result.timings,
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


