"""Expectations file: what a backend's maintainers declare about their backend, with reasons.

One file per backend, JSON (or TOML when the name ends in ``.toml``)::

    {
      "schema": "gemma4-conformance/expectations",     # optional
      "schema_version": 1,                            # optional
      "backend": "my-engine",                         # optional, informational
      "entries": [
        {"match": "/last/embeddings/", "action": "skip",
         "reason": "embeddings input not wired yet", "issue": "https://...", "expires": "2026-12-31"},
        {"match": "^e2b-mini/prefill/.*ubatch", "action": "known-failure", "reason": "..."},
        {"match": "^26b-a4b-mini/", "action": "tolerance", "reason": "bf16 router",
         "tolerance": {"kl_max": 1e-3, "max_abs": 0.05}}
      ]
    }

Each entry matches case ids with ``re.search(match, case_id)``. ``action`` is one of

``skip``           the case is not run (status ``skipped``);
``known-failure``  the case is run; a failure (or an error) becomes ``xfail``, a pass becomes ``xpass``
                   (which fails the run, so stale entries get removed);
``tolerance``      the case is graded with the profile's fields replaced by ``tolerance``.

``reason`` is required and non-empty. ``expires`` (an ISO date, ``YYYY-MM-DD``) is optional: the entry
applies up to and including that day; afterwards it no longer applies and is reported as expired.
``issue`` (a link or id) is optional. When several entries match a case: the first active ``skip``
wins, the first active ``known-failure`` applies, and ``tolerance`` overrides are merged in file order
(a later entry overrides the same field of an earlier one).

Every problem in the file is an ``ExpectationsError`` (exit code 2) naming the entry index and field.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..sets import bundled_sets
from .profiles import TOLERANCE_FIELDS

ACTIONS = ("skip", "known-failure", "tolerance")
SCHEMA = "gemma4-conformance/expectations"
TOP_FIELDS = {"schema", "schema_version", "backend", "description", "entries"}
ENTRY_FIELDS = {"match", "action", "reason", "expires", "issue", "tolerance"}


class ExpectationsError(Exception):
    """The expectations file is malformed (a usage error: exit code 2)."""


@dataclass
class Entry:
    index: int  # 0-based position in "entries"
    match: str
    action: str
    reason: str
    expires: _dt.date | None = None
    issue: str | None = None
    tolerance: dict[str, float] = field(default_factory=dict)
    pattern: re.Pattern = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    matched: list[str] = field(default_factory=list, repr=False, compare=False)

    def expired(self, today: _dt.date) -> bool:
        return self.expires is not None and today > self.expires

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "match": self.match, "action": self.action, "reason": self.reason}
        if self.expires is not None:
            d["expires"] = self.expires.isoformat()
        if self.issue:
            d["issue"] = self.issue
        if self.tolerance:
            d["tolerance"] = dict(self.tolerance)
        return d


@dataclass
class Decision:
    """What the expectations say about one case."""

    skip: Entry | None = None
    known_failure: Entry | None = None
    tolerance: dict[str, float] = field(default_factory=dict)
    tolerance_entries: list[Entry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any] | None:
        if not (self.skip or self.known_failure or self.tolerance):
            return None
        d: dict[str, Any] = {}
        if self.skip:
            d["skip"] = self.skip.to_json()
        if self.known_failure:
            d["known_failure"] = self.known_failure.to_json()
        if self.tolerance:
            d["tolerance"] = dict(self.tolerance)
            d["tolerance_entries"] = [e.index for e in self.tolerance_entries]
            d["tolerance_reasons"] = [e.reason for e in self.tolerance_entries]
        return d


@dataclass
class Expectations:
    entries: list[Entry] = field(default_factory=list)
    path: str | None = None
    backend: str | None = None
    today: _dt.date = field(default_factory=_dt.date.today)
    # the file a backend ships for its configuration: it covers every bundled set, so an entry for a set that is
    # not in the run is not reported as matching no case
    shipped: bool = False
    seen_sets: set[str] = field(default_factory=set)  # the sets of the observed cases (a case id's first part)

    @property
    def active(self) -> list[Entry]:
        return [e for e in self.entries if not e.expired(self.today)]

    @property
    def expired(self) -> list[Entry]:
        return [e for e in self.entries if e.expired(self.today)]

    def observe(self, case_ids: Iterable[str]) -> None:
        """Record which cases each entry matches (for the 'unused' report); call once per fixture set."""
        for cid in case_ids:
            self.seen_sets.add(cid.split("/", 1)[0])
            for e in self.entries:
                if e.pattern.search(cid):
                    e.matched.append(cid)

    def decide(self, case_id: str) -> Decision:
        d = Decision()
        for e in self.active:
            if not e.pattern.search(case_id):
                continue
            if e.action == "skip" and d.skip is None:
                d.skip = e
            elif e.action == "known-failure" and d.known_failure is None:
                d.known_failure = e
            elif e.action == "tolerance":
                d.tolerance.update(e.tolerance)
                d.tolerance_entries.append(e)
        return d

    @property
    def unused(self) -> list[Entry]:
        """Active entries that matched no case of the fixture sets observed (of a shipped file: not counting
        the entries for sets not in the run)."""
        return [e for e in self.active if not e.matched and not self.for_other_sets(e)]

    def for_other_sets(self, e: Entry) -> bool:
        """Whether the entry of a shipped file names bundled sets only, none of them in the run."""
        if not self.shipped:
            return False
        named = named_sets(e.match, set(bundled_names()) | self.seen_sets)
        return bool(named) and not named & self.seen_sets

    def report(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "backend": self.backend,
            "today": self.today.isoformat(),
            "entries": len(self.entries),
            "expired": [e.to_json() for e in self.expired],
            "unused": [e.to_json() for e in self.unused],
            "for_other_sets": sum(not e.matched and self.for_other_sets(e) for e in self.active),
        }


def bundled_names() -> list[str]:
    """The names of the bundled fixture sets (their directories' names)."""
    try:
        return [Path(p).name for p in bundled_sets()]
    except Exception:  # noqa: BLE001 - no bundle installed: no names
        return []


def named_sets(match: str, names: Iterable[str]) -> set[str]:
    """The set names among ``names`` that the regular expression ``match`` spells out, as whole words
    (``^(?:e2b\\-mini/full/B/T19|e4b\\-mini/...)$`` names e2b-mini and e4b-mini)."""
    text = match.replace("\\", "")
    return {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)}


def empty() -> Expectations:
    return Expectations()


# ----------------------------------------------------------------------------------------------
# parsing


def _tolerance_fields() -> tuple[str, ...]:
    """Overridable profile fields (conformance.check.profiles.TOLERANCE_FIELDS)."""
    return tuple(TOLERANCE_FIELDS)


def _parse_date(value: Any, where: str) -> _dt.date:
    if isinstance(value, _dt.datetime):
        return value.date()
    if isinstance(value, _dt.date):
        return value
    if not isinstance(value, str):
        raise ExpectationsError(f"{where}: 'expires' must be an ISO date string YYYY-MM-DD, got {value!r}")
    try:
        return _dt.date.fromisoformat(value.strip())
    except ValueError:
        raise ExpectationsError(f"{where}: 'expires' is not a valid ISO date (YYYY-MM-DD): {value!r}") from None


def _top_level(data: Any, src: str) -> tuple[str | None, list]:
    """(backend, entries) of a document whose top level is checked: known fields, schema, version, types."""
    if not isinstance(data, dict):
        raise ExpectationsError(f"{src}: the top level must be an object with an 'entries' list")
    unknown = sorted(set(data) - TOP_FIELDS)
    if unknown:
        raise ExpectationsError(
            f"{src}: unknown top-level field(s) {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(sorted(TOP_FIELDS))}"
        )
    if "schema" in data and data["schema"] != SCHEMA:
        raise ExpectationsError(f"{src}: 'schema' must be {SCHEMA!r}, got {data['schema']!r}")
    if "schema_version" in data and data["schema_version"] != 1:
        raise ExpectationsError(f"{src}: unsupported 'schema_version' {data['schema_version']!r} (this harness reads "
                                "1)")
    backend = data.get("backend")
    if backend is not None and not isinstance(backend, str):
        raise ExpectationsError(f"{src}: 'backend' must be a string")
    raw = data.get("entries")
    if raw is None:
        raise ExpectationsError(f"{src}: missing 'entries' (a list of entries)")
    if not isinstance(raw, list):
        raise ExpectationsError(f"{src}: 'entries' must be a list")
    return backend, raw


def _tolerance(e: dict, action: str, where: str) -> dict[str, float]:
    """The profile fields an entry of action 'tolerance' overrides, each checked; {} for another action."""
    if action != "tolerance":
        if "tolerance" in e:
            raise ExpectationsError(f"{where}: field 'tolerance' is only allowed with action 'tolerance'")
        return {}
    tol = e.get("tolerance")
    if not isinstance(tol, dict) or not tol:
        raise ExpectationsError(
            f"{where}: 'tolerance' is required for action 'tolerance' (an object of profile fields)"
        )
    tol_fields, tolerance = _tolerance_fields(), {}
    for k, v in tol.items():
        if k not in tol_fields:
            raise ExpectationsError(
                f"{where}: field 'tolerance.{k}' is not a profile threshold; one of {', '.join(tol_fields)}"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ExpectationsError(f"{where}: field 'tolerance.{k}' must be a number, got {v!r}")
        if k == "topk":
            if float(v) != int(v) or v < 1:
                raise ExpectationsError(f"{where}: field 'tolerance.topk' must be a positive integer, got {v!r}")
            tolerance[k] = int(v)
        elif not v >= 0:
            raise ExpectationsError(f"{where}: field 'tolerance.{k}' must be >= 0, got {v!r}")
        else:
            tolerance[k] = float(v)
    return tolerance


def _entry(i: int, e: Any, src: str) -> Entry:
    """Entry ``i`` of the document, every field checked."""
    where = f"{src}: entry {i}"
    if not isinstance(e, dict):
        raise ExpectationsError(f"{where}: must be an object")
    unknown = sorted(set(e) - ENTRY_FIELDS)
    if unknown:
        raise ExpectationsError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(ENTRY_FIELDS))}"
        )
    match = e.get("match")
    if not isinstance(match, str) or not match:
        raise ExpectationsError(f"{where}: 'match' is required (a regular expression over case ids)")
    try:
        pattern = re.compile(match)
    except re.error as err:
        raise ExpectationsError(f"{where}: 'match' is not a valid regular expression ({err}): {match!r}") from None
    action = e.get("action")
    if action not in ACTIONS:
        if action is None:
            raise ExpectationsError(f"{where}: 'action' is required; one of {', '.join(ACTIONS)}")
        raise ExpectationsError(f"{where}: unknown 'action' {action!r}; one of {', '.join(ACTIONS)}")
    reason = e.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise ExpectationsError(f"{where}: 'reason' is required and must be a non-empty string")
    expires = _parse_date(e["expires"], where) if e.get("expires") is not None else None
    issue = e.get("issue")
    if issue is not None and not isinstance(issue, str):
        raise ExpectationsError(f"{where}: 'issue' must be a string")
    return Entry(i, match, action, reason.strip(), expires, issue, _tolerance(e, action, where), pattern)


def parse(data: Any, *, path: str | None = None, today: _dt.date | None = None) -> Expectations:
    """Validate a decoded expectations document and build ``Expectations``."""
    src = path or "expectations"
    backend, raw = _top_level(data, src)
    entries = [_entry(i, e, src) for i, e in enumerate(raw)]
    return Expectations(entries, path, backend, today or _dt.date.today())


def load(path: str | Path, *, today: _dt.date | None = None) -> Expectations:
    """Read and validate an expectations file (JSON, or TOML for ``*.toml``)."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise ExpectationsError(f"{p}: cannot read the expectations file ({e.strerror or e})") from None
    if p.suffix.lower() == ".toml":
        try:
            data = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ExpectationsError(f"{p}: not valid TOML ({e})") from None
    else:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ExpectationsError(f"{p}: not valid JSON ({e})") from None
    return parse(data, path=str(p), today=today)
