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
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from refimpl.threads import cores, use_threads

from ..check.cases import run_case
from ..check.expectations import Expectations
from ..check.policy import Policy
from ..check.profiles import get_profile
from ..check.session import Checkpoints, Selection, Session, Work
from ..protocol.types import Backend, BackendError
from .backend import NumpyEngineBackend
from .mutants import EQUIVALENT, MUTANTS, REWRITES
from .results import CONTROL_PROFILE, DEFAULT_PROFILES, ControlResult, MutantResult, Progress, SelftestResult, Verdict

__all__ = ["run_selftest", "default_control", "load_mutants", "load_equivalents", "load_rewrites", "select_mutants",
           "select_equivalents"]


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
    m, *_, mprofs = _FORKED["planned"][i]
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


def load_rewrites() -> tuple:
    """``conformance.selftest.mutants.REWRITES`` as (variant, reason) pairs (``select_equivalents`` picks them)."""
    return tuple(REWRITES.values())


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


def _checked(profiles: Sequence, control_profile: str, mutants: Iterable, equivalents: Iterable,
             rewrites: Iterable = ()) -> tuple[list, Any, list, list]:
    """(the profiles, the control's profile, the mutants, the equivalent pairs), checked: at least one profile,
    none twice, every mutant name (and rewrite's) unique."""
    profs = [get_profile(p) for p in profiles]
    if not profs:
        raise ValueError("run_selftest: at least one profile is needed")
    if len({p.name for p in profs}) != len(profs):
        raise ValueError(f"run_selftest: profiles given twice: {[p.name for p in profs]}")
    mutants, equivalents = list(mutants), list(equivalents)
    names = [m.name for m in mutants] + [m.name for m, _ in [*equivalents, *rewrites]]
    if len(set(names)) != len(names):
        raise ValueError(f"run_selftest: mutant names are not unique: {names}")
    return profs, get_profile(control_profile), mutants, equivalents


@dataclass
class _Run:
    """One self-test run: its selection, checkpoints, expectations, progress and case counter."""

    selection: Selection
    checkpoints: Checkpoints
    expectations: Expectations
    progress: Progress | None
    count: Any = None

    def cases_of(self, m: Any) -> int:
        """The cases a mutant runs (those of its kill sets only, when it names some)."""
        kill_sets = tuple(getattr(m, "kill_sets", ()) or ())
        return sum(len(chosen) for _, chosen in _sets_of(self.selection, kill_sets))

    def control(self, control: Backend, note: str | None, cprof: Any) -> ControlResult:
        """The unmutated backend on every selected case at the control profile."""
        cname = getattr(control, "name", type(control).__name__)
        t = time.perf_counter()
        try:
            cverdicts, _ = _run_backend(control, self.selection, self.checkpoints, self.expectations, [cprof],
                                        self.count, cname)
            cres = ControlResult(cname, cprof.name, cverdicts[cprof.name], note=note)
        except BackendError as exc:
            cres = ControlResult(cname, cprof.name, Verdict(cprof.name), error=str(exc), note=note)
        cres.duration = time.perf_counter() - t
        if self.progress is not None:
            self.progress(self.count.done, self.count.total, cname, cres)
        return cres

    def mutants(self, planned: list, workers: int, tmp: Path, primary: str,
                sets_run: tuple[str, ...]) -> list[MutantResult]:
        """Every planned (mutant, reason of an equivalent one, reason of a rewrite, profiles), forked or in this
        process."""
        results: list[MutantResult] = []
        forked = None
        try:
            forked = _run_forked(planned, workers, self.selection, self.checkpoints, self.expectations, tmp)
            for i, (m, reason, rewrite, mprofs) in enumerate(planned):
                exp = None if m.expected_checks is None else frozenset(m.expected_checks)
                mres = MutantResult(m.name, str(m.breaks), str(m.bug_class), exp,
                                    {p.name: Verdict(p.name) for p in mprofs}, primary, equivalent=reason,
                                    rewrite=rewrite,
                                    kill_sets=tuple(getattr(m, "kill_sets", ()) or ()), sets_run=sets_run)
                self.mutant(m, mres, mprofs, forked[i] if forked is not None else None)
                results.append(mres)
                if self.progress is not None:
                    self.progress(self.count.done, self.count.total, m.name, mres)
        finally:
            if forked is not None:
                forked.shutdown()
        return results

    def mutant(self, m: Any, mres: MutantResult, mprofs: list, future: cf.Future | None) -> None:
        """One mutant's verdicts into ``mres``: from its worker's ``future``, or run here."""
        t = time.perf_counter()
        done_before = self.count.done
        if future is not None:  # run in a worker: its outcome arrives whole
            verdicts, mres.run_calls, mres.error, mres.duration = _outcome(future)
            if verdicts is not None:
                mres.verdicts = verdicts
            self.count.done = done_before + self.cases_of(m)
            return
        try:
            backend = m.backend()
            mres.verdicts, mres.run_calls = _run_backend(backend, self.selection, self.checkpoints,
                                                         self.expectations, mprofs, self.count, m.name,
                                                         mres.kill_sets)
        except Exception as exc:  # noqa: BLE001 - a broken mutant fails the self-test, the rest go on
            mres.error = _error_text(exc)
            self.count.done = done_before + self.cases_of(m)  # as if its cases had run
        mres.duration = time.perf_counter() - t


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
    rewrites: Iterable = (),
    workers: int = 1,
) -> SelftestResult:
    """Run the control, then every mutant, on the selected cases of ``sets`` (paths or ``FixtureSet``s).

    ``profiles``: names or ``Profile``s; the first is the primary one. ``control``: the unmutated
    backend (default: ``numpy-engine``), ``control_note`` a note on it for the report. ``equivalents``: (mutant, reason)
    pairs for planted bugs that no
    float profile can see; they run after the mutants, are graded at every profile and at exact-f64,
    and count as a problem only if even exact-f64 misses them. ``rewrites``: (variant, reason) pairs for engines
    rewritten to compute the same function (the PLE fold done right), run like the equivalent ones; a problem when
    exact-f64 fails one (the gate would fail a correct engine). ``workers``: mutants run at the same time, each in
    a process forked after the control (``_run_forked``; Linux; elsewhere, or with 1, one after the other in
    this process). Raises FixtureError (a broken set), NoCasesSelected,
    ValueError (bad regex or unknown profile), BackendError when the default control cannot be
    loaded. A control or mutant that cannot be opened is recorded in the result, not raised.
    """
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    rewrites = list(rewrites)
    profs, cprof, mutants, equivalents = _checked(profiles, control_profile, mutants, equivalents, rewrites)
    with tempfile.TemporaryDirectory(prefix="gemma4-selftest-", dir=workdir) as tmp:
        run = _Run(Selection(sets, select), Checkpoints(tmp), Expectations(), progress)
        run.count = _Counter(run.selection.total + sum(map(run.cases_of, mutants))
                             + sum(run.cases_of(m) for m, _ in [*equivalents, *rewrites]), progress)
        if control is None:
            control, control_note = default_control()
        cres = run.control(control, control_note, cprof)
        results: list[MutantResult] = []
        sets_info = [{"name": i.name, "version": i.version, "path": i.path, "cases_total": i.cases_total,
                      "cases_selected": i.cases_selected} for i in run.selection.infos()]
        if cres.passed:
            planned = [(m, None, None, profs) for m in mutants]
            with_exact = profs + ([] if cprof.name in {p.name for p in profs} else [cprof])
            planned += [(m, str(reason), None, with_exact) for m, reason in equivalents]
            planned += [(m, None, str(reason), with_exact) for m, reason in rewrites]
            sets_run = tuple(s["name"] for s in sets_info if s["cases_selected"])
            results = run.mutants(planned, workers, Path(tmp), profs[0].name, sets_run)
    return SelftestResult(
        control=cres, mutants=results, profiles=[p.name for p in profs], sets=sets_info,
        select=run.selection.select, cases=run.selection.total, started=started,
        finished=_dt.datetime.now(_dt.timezone.utc), duration=time.perf_counter() - t0,
    )


