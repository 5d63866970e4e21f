"""The records a check run produces: one ``CaseResult`` per case, ``SetInfo`` per fixture set, and the
``RunResult`` with the exit code. The reports (``conformance.report``) read these."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

STATUSES = ("pass", "fail", "error", "not-claimed", "skipped", "xfail", "xpass")


FAILING = ("fail", "error", "xpass")


RAN = ("pass", "fail", "error", "xfail", "xpass")


# progress(done, total, case_id, result): called with result=None before a case runs and with its
# CaseResult after; done counts the cases finished so far.
Progress = Callable[[int, int, str, "CaseResult | None"], None]


@dataclass
class CaseResult:
    id: str
    set: str
    kind: str
    entry: str  # entry point: full | last:plain | last:seq_id | last:embeddings | prefill | multi
    features: list[str]
    status: str  # one of STATUSES
    check: str | None = None
    message: str = ""
    rows: list[dict] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    first_divergence: int | None = None
    executed: dict[str, Any] = field(default_factory=dict)
    duration: float = 0.0  # seconds spent in backend.run
    moe_min_margin: float | None = None
    ties: list[list] = field(default_factory=list)  # [row label, oracle top-2 margin]
    needs: list[str] = field(default_factory=list)  # capabilities the request needs
    missing: list[str] = field(default_factory=list)  # of those, not claimed by the backend
    expectation: dict[str, Any] | None = None  # the expectations entries that applied
    error: dict[str, str] | None = None  # status error: {"type", "message", "traceback"}
    diagnosis: str | None = None  # failed cases: the likely bug classes (conformance.check.diagnosis)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "set": self.set, "kind": self.kind, "entry": self.entry,
            "features": list(self.features), "status": self.status, "check": self.check,
            "message": self.message, "rows": [dict(r) for r in self.rows], "summary": dict(self.summary),
            "first_divergence": self.first_divergence, "executed": self.executed,
            "duration": self.duration, "moe_min_margin": self.moe_min_margin,
            "ties": [list(t) for t in self.ties], "needs": list(self.needs), "missing": list(self.missing),
            "expectation": self.expectation, "error": self.error, "diagnosis": self.diagnosis,
        }

    @property
    def first_failing_row(self) -> dict | None:
        for r in self.rows:
            if r.get("status") == "fail":
                return r
        return None


@dataclass
class SetInfo:
    name: str
    version: str
    path: str
    manifest_sha256: str
    model: dict[str, Any]
    cases_total: int
    cases_selected: int
    warnings: list[str] = field(default_factory=list)  # e.g. a regenerated tokenizer that differs
    profile: str | None = None  # the profile its cases are graded with, where not the run's (Policy.set_profile)

    def label(self) -> str:
        """``name version``, and the set's own profile where it has one."""
        return f"{self.name} {self.version}" + (f" (profile {self.profile})" if self.profile else "")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RunResult:
    backend: dict[str, Any]  # name, capabilities, options
    profile: Any  # conformance.check.profiles.Profile
    sets: list[SetInfo]
    cases: list[CaseResult]
    expectations: dict[str, Any]
    select: str | None
    started: _dt.datetime
    finished: _dt.datetime
    duration: float
    # the run ended early: {"reason": "SIGINT" | "SIGTERM" | "SIGHUP" | "timeout", "case": the case in flight
    # or None, "cases_not_run": int, "message": str}; None when every selected case ran
    interrupted: dict[str, Any] | None = None
    # the run could not start or go on (ABORT_REASONS): {"reason", "exit_code", "message"}; the reports carry the
    # error, so that a CI job shows it rather than "no test results". "unfinished" is what a report written before
    # the run says, should the process end before the verdict (a backend's os._exit, a crash, a kill -9)
    aborted: dict[str, Any] | None = None
    # seconds by phase (conformance.check.runner.PHASES, and "load": the sets read and verified before the run)
    timings: dict[str, float] = field(default_factory=dict)

    def counts(self, cases: Iterable[CaseResult] | None = None) -> dict[str, int]:
        c = {s: 0 for s in STATUSES}
        for r in self.cases if cases is None else cases:
            c[r.status] += 1
        return c

    @property
    def exit_code(self) -> int:
        """0, 1 or 5 by the cases' statuses; 128 + the signal's number when a signal ended the run; the error's
        code (3 fixture integrity, 4 backend, 5 nothing to run) for an aborted run, 1 for an unfinished one."""
        if self.aborted is not None:
            return int(self.aborted["exit_code"])
        stop = self.interrupted
        if stop is not None and stop["reason"] != "timeout":
            return 128 + int(signal.Signals[stop["reason"]])
        c = self.counts()
        if any(c[s] for s in FAILING):
            return 1
        if not any(c[s] for s in RAN):
            return 5
        return 0

    def first_failure(self) -> CaseResult | None:
        """The first case (in run order) that is fail, then error, then xpass."""
        for status in FAILING:
            for r in self.cases:
                if r.status == status:
                    return r
        return None


ABORT_REASONS = {"fixture": 3, "backend": 4, "empty": 5, "unfinished": 1}


@dataclass
class NoProfile:
    """The profile of a run that ended before one was chosen (the backend could not be loaded)."""
    name: str = "(none)"
    description: str = "the run ended before a grading profile was chosen"


def aborted_run(backend: dict[str, Any], profile: Any, sets: list[SetInfo], reason: str, message: str,
                started: _dt.datetime, select: str | None = None) -> RunResult:
    """The record of a run that could not start or go on (``reason`` of ABORT_REASONS): no case, the error."""
    finished = _dt.datetime.now(_dt.timezone.utc)
    return RunResult(backend=backend, profile=profile if profile is not None else NoProfile(), sets=sets, cases=[],
                     expectations={"path": None, "entries": 0, "expired": [], "unused": []}, select=select,
                     started=started, finished=finished,
                     duration=max(0.0, (finished - started).total_seconds()),
                     aborted={"reason": reason, "exit_code": ABORT_REASONS[reason], "message": message})


def entry_point(case) -> str:
    return f"last:{case.entry}" if case.kind == "last" else case.kind


def _finite(x: Any) -> Any:
    """Metrics as plain Python floats (numpy scalars converted); non-finite kept as floats."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x)
    return x


