"""The harness's self-test: does the gate catch the bugs it exists for? ``run_selftest(...) -> SelftestResult``.

Each *mutant* is a deliberately broken variant of the ``numpy-engine`` backend with one bug of the
catalogue (``conformance/selftest/mutants.py``; ``docs/bug-classes.md``). The self-test

1. runs the **control**, the unmutated engine, on every selected case and grades it with the
   ``exact-f64`` profile: every case must pass, or the self-test is invalid (a mutant "killed" by a
   case the correct engine fails as well proves nothing) and the mutants are not run;
2. runs every mutant **once** per case (``backend.run`` is called once; the response is kept) and
   grades that response with each profile (``fp32`` first, the primary profile, then ``bf16`` and
   ``q8`` for information);
3. records, per mutant and profile, whether it is **killed** (at least one case fails or errors)
   and, for the primary profile, the check and the first case (fixture order) that caught it, how
   many cases failed, and whether the check **matches** the bug (it is in the mutant's
   ``expected_checks``; ``None`` accepts any check).

The self-test passes (``exit_code`` 0) when the control passes and every mutant is killed at the
primary profile by a matching check. A survivor, a mutant killed only by a check that does not
match its bug (a dropped softcap seen only by ``top1``, say), or a mutant that cannot be built or
opened, makes it fail (1). Survivors at the looser profiles are reported, not failed: they show what
a looser profile gives up.

The mutants are duck-typed: anything with ``name``, ``breaks``, ``bug_class``, ``expected_checks``
and ``backend()`` (a fresh, unopened backend) will do. An optional ``kill_sets`` (names of fixture sets)
says that only those sets can kill the mutant (the image mutants: only the image sets hold image
prompts; the audio mutants: only ``e2b-audio-mini`` holds audio prompts; the MTP mutants: only the MTP
sets hold MTP requests): such a mutant runs on those sets' cases alone (the others cannot show its bug),
and a survivor none of whose kill sets had a case selected is told so.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import json
import multiprocessing
import os
import re
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from refimpl.threads import cores, use_threads

from ..check.cases import run_case
from ..check.expectations import Expectations
from ..check.policy import Policy
from ..check.profiles import get_profile
from ..check.results import FAILING, CaseResult
from ..check.session import Checkpoints, Selection, Session, Work
from ..protocol.types import Backend, BackendError
from ..report.json_report import clean, versions, write_output
from .engine import NumpyEngineBackend
from .mutants import EQUIVALENT, MUTANTS

__all__ = ["SCHEMA", "SCHEMA_VERSION", "DEFAULT_PROFILES", "CONTROL_PROFILE", "Verdict", "ControlResult",
           "MutantResult", "SelftestResult", "run_selftest", "default_control", "load_mutants",
           "select_mutants", "format_table", "to_json", "write_json"]

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
            "equivalent": self.equivalent, "kill_sets": list(self.kill_sets), "problem": self.problem(),
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
        return [m.name for m in self.mutants if m.survives(profile)]


# ----------------------------------------------------------------------------------------------
# running


class _Replay:
    """Calls the wrapped backend's ``run`` once per case and replays the response (or the exception)
    for the other profiles' grading. ``reset()`` before each case."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.name = getattr(backend, "name", type(backend).__name__)
        self.capabilities = backend.capabilities
        self.calls = 0
        self._memo: tuple[str, Any] | None = None

    def reset(self) -> None:
        self._memo = None

    def open(self, model_dir):  # pragma: no cover - the self-test opens the backend itself
        return self.backend.open(model_dir)

    def close(self):  # pragma: no cover
        return self.backend.close()

    def run(self, request):
        if self._memo is None:
            self.calls += 1
            try:
                self._memo = ("ok", self.backend.run(request))
            except Exception as exc:  # noqa: BLE001 - replayed for every profile
                self._memo = ("raise", exc)
        kind, value = self._memo
        if kind == "raise":
            raise value
        return value


def _error_text(exc: BaseException) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last


def _short(s: str, limit: int = 200) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class _Counter:
    def __init__(self, total: int, progress: Progress | None):
        self.done = 0
        self.total = total
        self.progress = progress

    def __call__(self, label: str, result: Any) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, label, result)


def _sets_of(selection: Selection, kill_sets: Sequence[str]) -> list[tuple]:
    """(set, chosen cases) of the selection a mutant runs on: its kill sets' (every set when it has none)."""
    return [(fs, chosen) for fs, chosen in zip(selection.sets, selection.chosen, strict=True)
            if chosen and (not kill_sets or fs.name in kill_sets)]


def _run_backend(backend: Backend, selection: Selection, checkpoints: Checkpoints, expectations: Expectations,
                 profiles: Sequence, count: _Counter, label: str,
                 kill_sets: Sequence[str] = ()) -> tuple[dict[str, Verdict], int]:
    """Run every selected case (of ``kill_sets`` only, when given) once on ``backend`` and grade it with every
    profile.

    Returns ({profile name: Verdict}, backend.run calls). BackendError when the backend cannot be opened.
    """
    verdicts = {p.name: Verdict(p.name) for p in profiles}
    replay = _Replay(backend)
    session = Session(backend, checkpoints)

    def grade(ctx, case) -> None:
        count(f"{label}: {case.id}", None)
        replay.reset()
        first = None
        for p in profiles:
            res = run_case(replay, session.claimed, ctx, case, Policy(p, expectations))
            verdicts[p.name].add(res)
            first = first or res
        count.done += 1
        count(f"{label}: {case.id}", first)

    session.run(_sets_of(selection, kill_sets), Work(grade))
    return verdicts, replay.calls


# What a forked worker reads: set by _run_forked before its pool forks, inherited by the children (fork
# copies memory), never pickled: the selection, checkpoints and oracle logits the control materialised.
_FORKED: dict[str, Any] = {}


def _run_forked(planned: list, workers: int, selection: Selection, checkpoints: Checkpoints,
                expectations: Expectations, tmp: Path) -> "_Forked | None":
    """Start every planned (mutant, reason, profiles) on ``workers`` forked processes; None when they run in
    this process instead (one worker, one mutant, or no fork on this platform)."""
    if workers <= 1 or len(planned) <= 1 or not sys.platform.startswith("linux"):
        return None
    n = min(workers, len(planned))
    _FORKED.update(planned=planned, selection=selection, checkpoints=checkpoints, expectations=expectations, tmp=tmp,
                   threads=max(1, cores() // n))
    before = set(multiprocessing.active_children())
    try:
        pool = cf.ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("fork"))
        futures = [pool.submit(_run_planned, i) for i in range(len(planned))]
    except OSError:  # no fork (memory, process limits): the mutants run in this process
        _FORKED.clear()
        return None
    return _Forked(pool, futures, set(multiprocessing.active_children()) - before)


@dataclass
class _Forked:
    pool: cf.ProcessPoolExecutor
    futures: list
    children: set  # the pool's processes

    def __getitem__(self, i: int) -> cf.Future:
        return self.futures[i]

    def shutdown(self) -> None:
        """After every outcome was read: the workers exit. Interrupted: the mutants not started are cancelled
        and the workers terminated."""
        done = all(f.done() for f in self.futures)
        if not done:  # interrupted: stop the workers before the temporary directory goes
            for child in self.children:
                child.terminate()
        self.pool.shutdown(wait=True, cancel_futures=not done)
        _FORKED.clear()


def _run_planned(i: int) -> tuple[dict[str, Verdict] | None, int, str | None, float]:
    """In a forked worker: run planned mutant ``i`` as the sequential loop does; (verdicts, run calls, error,
    seconds). A checkpoint the control did not materialise goes under this worker's own directory."""
    m, _, mprofs = _FORKED["planned"][i]
    checkpoints = _FORKED["checkpoints"]
    checkpoints.workdir = _FORKED["tmp"] / f"worker-{os.getpid()}"
    t = time.perf_counter()
    try:
        with use_threads(_FORKED["threads"]):  # the workers share the cores
            verdicts, calls = _run_backend(m.backend(), _FORKED["selection"], checkpoints, _FORKED["expectations"],
                                           mprofs, _Counter(0, None), m.name, tuple(getattr(m, "kill_sets", ()) or ()))
        return verdicts, calls, None, time.perf_counter() - t
    except Exception as exc:  # noqa: BLE001 - as in the sequential loop: the mutant is broken, the rest go on
        return None, 0, _error_text(exc), time.perf_counter() - t


def _outcome(future: cf.Future) -> tuple[dict[str, Verdict] | None, int, str | None, float]:
    """A worker's result; a worker that died (a crash, a kill) makes its mutant broken."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - BrokenProcessPool and the like
        return None, 0, (f"a worker process died before this mutant finished ({type(exc).__name__}: {exc}); "
                         "run it with --workers 1 to see whether it crashes"), 0.0


def default_control() -> tuple[Backend, str | None]:
    """The unmutated numpy engine (float64), and no note."""
    return NumpyEngineBackend(), None


def load_mutants() -> tuple:
    """``conformance.selftest.mutants.MUTANTS``."""
    return tuple(MUTANTS)


def load_equivalents() -> tuple:
    """``conformance.selftest.mutants.EQUIVALENT`` as (mutant, reason) pairs."""
    return tuple(EQUIVALENT.values())


def select_equivalents(equivalents: Iterable, regex: str | re.Pattern | None) -> list:
    """The (mutant, reason) pairs whose mutant matches ``regex`` as in ``select_mutants``."""
    equivalents = list(equivalents)
    chosen = select_mutants([m for m, _ in equivalents], regex)
    return [(m, reason) for m, reason in equivalents if m in chosen]


def select_mutants(mutants: Iterable, regex: str | re.Pattern | None) -> list:
    """The mutants whose name (or bug class) matches ``regex`` (``re.search``); all when None."""
    mutants = list(mutants)
    if regex is None:
        return mutants
    pat = regex if isinstance(regex, re.Pattern) else re.compile(regex)
    return [m for m in mutants if pat.search(m.name) or pat.fullmatch(str(m.bug_class))]


def run_selftest(
    sets: Iterable,
    mutants: Iterable,
    profiles: Sequence = DEFAULT_PROFILES,
    select: str | re.Pattern | None = None,
    progress: Progress | None = None,
    *,
    control: Backend | None = None,
    control_note: str | None = None,
    control_profile: str = CONTROL_PROFILE,
    workdir: str | Path | None = None,
    equivalents: Iterable = (),
    workers: int = 1,
) -> SelftestResult:
    """Run the control, then every mutant, on the selected cases of ``sets`` (paths or ``FixtureSet``s).

    ``profiles``: names or ``Profile``s; the first is the primary one. ``control``: the unmutated
    backend (default: ``numpy-engine``), ``control_note`` a note on it for the report. ``equivalents``: (mutant, reason)
    pairs for planted bugs that no
    float profile can see; they run after the mutants, are graded at every profile and at exact-f64,
    and count as a problem only if even exact-f64 misses them. ``workers``: mutants run at the same time, each in
    a process forked after the control (``_run_forked``; Linux; elsewhere, or with 1, one after the other in
    this process). Raises FixtureError (a broken set), NoCasesSelected,
    ValueError (bad regex or unknown profile), BackendError when the default control cannot be
    loaded. A control or mutant that cannot be opened is recorded in the result, not raised.
    """
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    profs = [get_profile(p) for p in profiles]
    if not profs:
        raise ValueError("run_selftest: at least one profile is needed")
    if len({p.name for p in profs}) != len(profs):
        raise ValueError(f"run_selftest: profiles given twice: {[p.name for p in profs]}")
    cprof = get_profile(control_profile)
    mutants = list(mutants)
    equivalents = list(equivalents)
    names = [m.name for m in mutants] + [m.name for m, _ in equivalents]
    if len(set(names)) != len(names):
        raise ValueError(f"run_selftest: mutant names are not unique: {names}")

    with tempfile.TemporaryDirectory(prefix="gemma4-selftest-", dir=workdir) as tmp:
        selection = Selection(sets, select)
        checkpoints, expectations = Checkpoints(tmp), Expectations()
        def cases_of(m) -> int:
            return sum(len(chosen) for _, chosen in _sets_of(selection, tuple(getattr(m, "kill_sets", ()) or ())))

        count = _Counter(selection.total + sum(map(cases_of, mutants)) + sum(cases_of(m) for m, _ in equivalents),
                         progress)

        note = control_note
        if control is None:
            control, note = default_control()
        cname = getattr(control, "name", type(control).__name__)
        t = time.perf_counter()
        try:
            cverdicts, _ = _run_backend(control, selection, checkpoints, expectations, [cprof], count, cname)
            cres = ControlResult(cname, cprof.name, cverdicts[cprof.name], note=note)
        except BackendError as exc:
            cres = ControlResult(cname, cprof.name, Verdict(cprof.name), error=str(exc), note=note)
        cres.duration = time.perf_counter() - t
        if progress is not None:
            progress(count.done, count.total, cname, cres)

        results: list[MutantResult] = []
        sets_info = [{"name": i.name, "version": i.version, "path": i.path, "cases_total": i.cases_total,
                      "cases_selected": i.cases_selected} for i in selection.infos()]
        sets_run = tuple(s["name"] for s in sets_info if s["cases_selected"])
        if cres.passed:
            planned = [(m, None, profs) for m in mutants]
            with_exact = profs + ([] if cprof.name in {p.name for p in profs} else [cprof])
            planned += [(m, str(reason), with_exact) for m, reason in equivalents]
            forked = None
            try:
                forked = _run_forked(planned, workers, selection, checkpoints, expectations, Path(tmp))
                for i, (m, reason, mprofs) in enumerate(planned):
                    exp = None if m.expected_checks is None else frozenset(m.expected_checks)
                    mres = MutantResult(m.name, str(m.breaks), str(m.bug_class), exp,
                                        {p.name: Verdict(p.name) for p in mprofs}, profs[0].name, equivalent=reason,
                                        kill_sets=tuple(getattr(m, "kill_sets", ()) or ()), sets_run=sets_run)
                    t = time.perf_counter()
                    done_before = count.done
                    if forked is not None:  # run in a worker: its outcome arrives whole
                        verdicts, mres.run_calls, mres.error, mres.duration = _outcome(forked[i])
                        if verdicts is not None:
                            mres.verdicts = verdicts
                        count.done = done_before + cases_of(m)
                    else:
                        try:
                            backend = m.backend()
                            mres.verdicts, mres.run_calls = _run_backend(backend, selection, checkpoints, expectations,
                                                                         mprofs, count, m.name, mres.kill_sets)
                        except Exception as exc:  # noqa: BLE001 - a broken mutant fails the self-test, the rest go on
                            mres.error = _error_text(exc)
                            count.done = done_before + cases_of(m)  # as if its cases had run
                        mres.duration = time.perf_counter() - t
                    results.append(mres)
                    if progress is not None:
                        progress(count.done, count.total, m.name, mres)
            finally:
                if forked is not None:
                    forked.shutdown()

    return SelftestResult(
        control=cres, mutants=results, profiles=[p.name for p in profs], sets=sets_info, select=selection.select,
        cases=selection.total, started=started, finished=_dt.datetime.now(_dt.timezone.utc),
        duration=time.perf_counter() - t0,
    )


# ----------------------------------------------------------------------------------------------
# output

#: the mark after a check that does not match the mutant's bug
MISMATCH_MARK = " (!)"
#: the primary-profile cell of an equivalent mutant that no float profile can see
EQUIVALENT_MARK = "equivalent*"


def _cell_profile(m: MutantResult, profile: str) -> str:
    if m.error is not None:
        return "-"
    return "survives" if m.survives(profile) else f"killed ({m.verdicts[profile].failing_cases})"


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
    lines = [f"self-test: {len(result.mutants)} mutant(s) of {result.control.backend}, graded at {primary} "
             f"(verdict) and {', '.join(result.profiles[1:]) or 'no other profile'} (information); "
             f"{result.cases} case(s) from {sets or 'no set'}"]
    if result.select:
        lines.append(f"selected with {result.select}")
    if result.control.note:
        lines.append(f"note: {result.control.note}")
    lines.append("")
    lines.append(format_table(result, breaks_width))
    if any(m.killed and not m.matching and m.equivalent is None for m in result.mutants):
        lines.append(f"{MISMATCH_MARK.strip()} killed, but not by a check that matches the bug")
    for m in result.mutants:
        if m.equivalent is not None:
            lines.append(f"* {m.name}: equivalent at float precision, graded at {CONTROL_PROFILE} (its row shows "
                         f"that verdict): {m.equivalent}")
    lines.append("")
    if result.valid:
        for p in result.profiles[1:]:
            surv = result.survivors(p)
            lines.append(f"would survive at {p}: " + (", ".join(surv) if surv else "none")
                         + f" ({len(surv)} of {len(result.mutants)})")

    problems = result.problems()
    if not problems:
        eq = [m.name for m in result.mutants if m.equivalent is not None]
        lines.append(f"every mutant killed at {primary} by a matching check"
                     + (f" (equivalent ones at {CONTROL_PROFILE}: {', '.join(eq)})" if eq else "")
                     + f"; the control passes at {result.control.profile}")
    else:
        head = "SELF-TEST INVALID" if not result.valid else "SELF-TEST FAILED"
        lines.append(f"{head}:")
        lines += [f"  - {p}" for p in problems]
    lines.append(f"{len(result.mutants)} mutant(s) x {result.cases} case(s) in {result.duration:.1f}s")
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
