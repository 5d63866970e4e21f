"""The self-test's records (conformance/selftest/run.py runs it): one ``Verdict`` per mutant and profile, the
control's result, each mutant's, and the whole run's ``SelftestResult`` with its exit code; the schema names of
its JSON (conformance/selftest/output.py writes it)."""


from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Callable

from ..check.results import FAILING, CaseResult

__all__ = ["SCHEMA", "SCHEMA_VERSION", "DEFAULT_PROFILES", "CONTROL_PROFILE", "CONTROL_BACKEND", "Progress", "Verdict",
           "ControlResult", "MutantResult", "SelftestResult"]

SCHEMA = "gemma4-conformance/selftest"
SCHEMA_VERSION = 1
#: the profiles every mutant is graded with; the first is the primary one (the self-test's verdict)
DEFAULT_PROFILES = ("fp32", "bf16", "q8")
#: the profile the control (the unmutated engine, float64) must pass
CONTROL_PROFILE = "exact-f64"
CONTROL_BACKEND = "numpy-engine"

# progress(done, total, label, result): result is None before a case runs, its CaseResult (graded
# with the primary profile, or the control profile for the control) after it, and a ControlResult /
# MutantResult when a backend has finished all its cases. label is "<backend>: <case id>" or the
# backend's name. done counts the case runs finished so far; total = (1 + mutants) x cases.
Progress = Callable[[int, int, str, Any], None]


# ----------------------------------------------------------------------------------------------
# results


def _short(s: str, limit: int = 200) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _check_of(c: CaseResult) -> str:
    """The check a failing case is attributed to: its grading check, or 'error' when the backend raised."""
    return c.check or ("error" if c.status == "error" else c.status)


@dataclass
class Verdict:
    """One backend under one profile, over every selected case."""

    profile: str
    cases_run: int = 0
    not_run: int = 0  # not claimed by the backend (or skipped)
    failing_cases: int = 0
    first_case: str | None = None  # the first failing case, in fixture order
    check: str | None = None  # its check
    status: str | None = None  # its status (fail, error)
    message: str = ""  # its message
    checks: dict[str, int] = field(default_factory=dict)  # check -> failing cases
    failing: list[tuple[str, str]] = field(default_factory=list)  # (case id, check), fixture order

    @property
    def killed(self) -> bool:
        return self.failing_cases > 0

    def add(self, c: CaseResult) -> None:
        if c.status in ("not-claimed", "skipped"):
            self.not_run += 1
            return
        self.cases_run += 1
        if c.status not in FAILING:
            return
        self.failing_cases += 1
        chk = _check_of(c)
        self.checks[chk] = self.checks.get(chk, 0) + 1
        self.failing.append((c.id, chk))
        if self.first_case is None:
            self.first_case, self.check, self.status = c.id, chk, c.status
            self.message = c.message

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "killed": self.killed, "cases_run": self.cases_run,
                "not_run": self.not_run, "failing_cases": self.failing_cases, "first_case": self.first_case,
                "check": self.check, "status": self.status, "message": self.message, "checks": dict(self.checks)}


@dataclass
class ControlResult:
    backend: str
    profile: str
    verdict: Verdict
    duration: float = 0.0
    error: str | None = None  # could not be built or opened
    note: str | None = None  # e.g. the stand-in used when numpy-engine is not installed

    @property
    def passed(self) -> bool:
        return self.error is None and not self.verdict.killed and self.verdict.cases_run > 0

    def problem(self) -> str | None:
        if self.error is not None:
            return f"the control backend {self.backend!r} could not run: {self.error}"
        v = self.verdict
        if v.cases_run == 0:
            return f"the control backend {self.backend!r} ran no case (every selected case not claimed)"
        if v.killed:
            return (f"the unmutated control backend {self.backend!r} failed {v.failing_cases} of {v.cases_run} "
                    f"case(s) at {self.profile} (first: {v.first_case} [{v.check}]: {_short(v.message, 300)}); "
                    "a mutant killed by a case the correct engine fails proves nothing, so the mutants were "
                    "not run. Fix the engine or the fixtures first (conformance check --backend "
                    f"{self.backend} --profile {self.profile})")
        return None

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "profile": self.profile, "passed": self.passed,
                "cases_run": self.verdict.cases_run, "not_run": self.verdict.not_run,
                "failing_cases": self.verdict.failing_cases, "first_case": self.verdict.first_case,
                "check": self.verdict.check, "message": self.verdict.message, "checks": dict(self.verdict.checks),
                "duration": self.duration, "error": self.error, "note": self.note}


@dataclass
class MutantResult:
    name: str
    breaks: str
    bug_class: str
    expected_checks: frozenset[str] | None
    verdicts: dict[str, Verdict]  # profile name -> verdict, primary first
    primary: str
    duration: float = 0.0  # seconds for the mutant (run + grading)
    run_calls: int = 0  # backend.run calls made (one per case that ran)
    error: str | None = None  # the mutant could not be built or opened
    equivalent: str | None = None  # why no float profile can see this bug (graded at exact-f64 too)
    rewrite: str | None = None  # not a bug: a rewrite of the engine that computes the same function (why), which
    # must pass at exact-f64 (the PLE fold done right: a gate that failed it would fail a correct engine)
    kill_sets: tuple[str, ...] = ()  # the only fixture sets that can kill it (empty: any)
    sets_run: tuple[str, ...] = ()  # the fixture sets it ran cases of

    # -- the primary profile -------------------------------------------------------------------

    @property
    def verdict(self) -> Verdict:
        return self.verdicts[self.primary]

    @property
    def killed(self) -> bool:
        return self.error is None and self.verdict.killed

    def matches(self, check: str | None) -> bool:
        return check is not None and (self.expected_checks is None or check in self.expected_checks)

    @property
    def matching(self) -> bool:
        """Killed at the primary profile by at least one case whose check matches the bug."""
        return self.killed and any(self.matches(chk) for _, chk in self.verdict.failing)

    @property
    def caught_by(self) -> tuple[str | None, str | None]:
        """(case, check) shown for the primary profile: the first failing case whose check matches the
        bug; if none matches, the first failing case."""
        for cid, chk in self.verdict.failing:
            if self.matches(chk):
                return cid, chk
        return self.verdict.first_case, self.verdict.check

    @property
    def ok(self) -> bool:
        return self.matching

    def survives(self, profile: str) -> bool:
        return self.error is None and not self.verdicts[profile].killed

    def problem(self) -> str | None:
        if self.error is not None:
            return f"mutant {self.name!r} could not run: {self.error}"
        if self.rewrite is not None:
            v = self.verdicts[CONTROL_PROFILE]
            if v.cases_run == 0:
                return f"rewrite {self.name!r} ran no case (every selected case not claimed or skipped)"
            if v.killed:
                return (f"rewrite {self.name!r} (the same function: {self.breaks}) failed {v.failing_cases} of "
                        f"{v.cases_run} case(s) at {CONTROL_PROFILE} (first: {v.first_case} [{v.check}]): the gate "
                        "would fail an engine that computes the model")
            return None
        if self.equivalent is not None:
            if not self.verdicts[CONTROL_PROFILE].killed:
                return f"equivalent mutant {self.name!r} ({self.bug_class}) is not caught even at {CONTROL_PROFILE}"
            return None
        v = self.verdict
        if self.kill_sets and not set(self.kill_sets) & set(self.sets_run):
            return (f"mutant {self.name!r} ({self.bug_class}: {self.breaks}) SURVIVED at {self.primary}: only the "
                    f"fixture set(s) {', '.join(self.kill_sets)} can kill it, and none of their cases was selected")
        if v.cases_run == 0:
            return f"mutant {self.name!r} ran no case (every selected case not claimed or skipped)"
        if not v.killed:
            return (f"mutant {self.name!r} ({self.bug_class}: {self.breaks}) SURVIVED at {self.primary}: all "
                    f"{v.cases_run} case(s) passed")
        if not self.matching:
            want = ", ".join(sorted(self.expected_checks or ()))
            got = ", ".join(f"{k} ({n})" for k, n in v.checks.items())
            return (f"mutant {self.name!r} ({self.bug_class}) was killed at {self.primary} only by {got}, not by a "
                    f"check that matches its bug ({want})")
        return None

    def to_json(self) -> dict[str, Any]:
        case, check = self.caught_by
        v = self.verdict
        return {
            "name": self.name, "bug_class": self.bug_class, "breaks": self.breaks,
            "expected_checks": None if self.expected_checks is None else sorted(self.expected_checks),
            "killed": self.killed, "matching": self.matching, "ok": self.ok,
            "check": check if self.killed else None, "first_case": case if self.killed else None,
            "failing_cases": v.failing_cases, "cases_run": v.cases_run,
            "first_failure": ({"case": v.first_case, "check": v.check, "status": v.status, "message": v.message}
                              if v.killed else None),
            "checks": dict(v.checks),
            "failing": [{"case": cid, "check": chk} for cid, chk in v.failing],
            "survives": {p: self.survives(p) for p in self.verdicts},
            "profiles": {p: vv.to_json() for p, vv in self.verdicts.items()},
            "run_calls": self.run_calls, "duration": self.duration, "error": self.error,
            "equivalent": self.equivalent, "rewrite": self.rewrite, "kill_sets": list(self.kill_sets),
            "problem": self.problem(),
        }


@dataclass
class SelftestResult:
    control: ControlResult
    mutants: list[MutantResult]
    profiles: list[str]  # primary first
    sets: list[dict[str, Any]]  # name, version, path, cases_total, cases_selected
    select: str | None
    cases: int  # selected cases (per backend)
    started: _dt.datetime
    finished: _dt.datetime
    duration: float

    @property
    def primary(self) -> str:
        return self.profiles[0]

    @property
    def valid(self) -> bool:
        return self.control.passed

    def problems(self) -> list[str]:
        """Why the self-test fails (empty when it passes)."""
        p = self.control.problem()
        if p is not None:
            return [p]
        out = [m.problem() for m in self.mutants]
        out = [x for x in out if x is not None]
        if not self.mutants:
            out.append("no mutant was run")
        return out

    @property
    def exit_code(self) -> int:
        return 1 if self.problems() else 0

    def survivors(self, profile: str) -> list[str]:
        return [m.name for m in self.mutants if m.rewrite is None and m.survives(profile)]


