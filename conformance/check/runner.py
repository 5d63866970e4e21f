"""Run the selected cases of fixture sets on a backend and grade them: ``run(...) -> RunResult``.

Order of events (see docs/conformance.md):

1. every fixture set is loaded and verified first (``FixtureError``: exit code 3), the ``-k`` regex
   is applied to the case ids (no case left: ``NoCasesSelected``, exit code 5);
2. per set: the model is materialised into the run's working directory (``Checkpoints``) and the
   backend is opened on it (``Session``; any exception: ``BackendError``, exit code 4);
3. per case: the request is built; a request needing a capability the backend does not claim is
   ``not-claimed``; an expectations ``skip`` is ``skipped``; otherwise ``backend.run`` is called
   (any exception, SystemExit too, is status ``error``, recorded, and the run goes on) and the response
   is graded with the profile (plus any expectations tolerance overrides): ``pass`` or ``fail``; a
   ``known-failure`` entry then turns fail/error into ``xfail`` and pass into ``xpass``.

The exit code of a run (``RunResult.exit_code``): 0 when every run case passed (xfail, skipped and
not-claimed allowed), 1 when any case is fail, error or xpass, 5 when no case was run at all (every
selected case not claimed or skipped), 128 + the signal when SIGINT, SIGTERM or SIGHUP ended it.
"""

from __future__ import annotations

import datetime as _dt
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from refimpl.signals import Interrupted, interrupt_name, interrupt_signal, stop_signals

from ..protocol.types import Backend
from ..sets.integrity import load_set
from .cases import claimed_requests, diagnose, run_case
from .exits import refuse_process_exit
from .expectations import Expectations
from .policy import Policy
from .results import CaseResult, Progress, RunResult
from .session import PHASES, Checkpoints, Selection, Session, SetContext

__all__ = ["PHASES", "Interrupted", "interrupt_signal", "load_sets", "run", "run_case", "stop_signals"]


def load_sets(paths: Iterable[str | Path]) -> list:
    """Load and verify every fixture set (FixtureError on the first problem)."""
    return [load_set(Path(p)) for p in paths]


def run(
    backend: Backend,
    sets: Iterable,
    profile,
    expectations: Expectations | None = None,
    select: str | re.Pattern | None = None,
    progress: Progress | None = None,
    *,
    backend_options: dict[str, Any] | None = None,
    workdir: str | Path | None = None,
    case_timeout: float | None = None,
    model: str | Path | None = None,
    rehash: bool = False,
    drafter: str | Path | None = None,
    profile_named: bool = True,
    concurrency: int | None = None,
) -> RunResult:
    """Run the selected cases of ``sets`` (paths or loaded ``FixtureSet``s) on ``backend``.

    Raises FixtureError (exit 3) for a broken set, BackendError (exit 4) when the backend cannot be
    opened, NoCasesSelected (exit 5) when ``select`` matches no case, ValueError for a bad regex.
    An interrupt (KeyboardInterrupt, or ``Interrupted`` under ``stop_signals``) does not propagate: the
    cases finished so far are returned with ``interrupted`` set. ``case_timeout``: seconds a request
    may take (see ``conformance.protocol.CaseTimeout``); past it the case is an error with check
    ``timeout``, and the run goes on where the backend restarts its engine, else it ends there.
    ``model``: the directory of every external set's checkpoint (``--model``; default: each set's recorded
    path); ``rehash``: read the checkpoint files again instead of trusting the digest cache (``Checkpoints``);
    ``drafter``: the MTP assistant of sets with MTP cases (``--drafter``; default: the path each set records);
    ``profile_named``: ``profile`` was named by the user and grades every set; when False a set made under an
    activation convention is graded with that convention's profile (``Policy.set_profile``; the set's
    ``SetInfo.profile`` says which); ``concurrency``: each set's claimed requests handed to the backend's
    ``prefetch`` as it opens on the set, to be sent that many at a time (``--concurrency``; a server backend).
    """
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    policy = Policy(profile, expectations if expectations is not None else Expectations(), named=profile_named)
    selection = Selection(sets, select)
    policy.observe(selection.sets)
    plan, infos, total = list(zip(selection.sets, selection.chosen, strict=True)), selection.infos(), selection.total

    for fs, chosen, info in zip(selection.sets, selection.chosen, infos, strict=True):
        if chosen:
            info.warnings = [str(w) for w in getattr(fs, "warnings", [])]
        if (own := policy.set_profile(fs)) is not profile:
            info.profile = own.name
    interrupted = None
    with tempfile.TemporaryDirectory(prefix="gemma4-conformance-", dir=workdir) as tmp, refuse_process_exit():
        session = Session(backend, Checkpoints(tmp, model=model, rehash=rehash, drafter=drafter), case_timeout)
        work = _CheckWork(session, policy, total, progress, concurrency)
        try:
            session.run(plan, work, work.note)
            interrupted = session.stopped
        except KeyboardInterrupt as exc:
            sig = interrupt_name(exc)
            case = session.in_flight
            interrupted = {"reason": sig, "case": case, "message": f"interrupted by {sig}" + (
                f" while case {case} was running (it is not reported)" if case else "")}
    results = work.results
    if interrupted is not None:
        interrupted["cases_not_run"] = total - len(results)

    finished = _dt.datetime.now(_dt.timezone.utc)
    return RunResult(
        backend={"name": getattr(backend, "name", type(backend).__name__), "capabilities": session.claimed,
                 "options": dict(backend_options or {})},
        profile=profile, sets=infos, cases=results, expectations=policy.expectations.report(),
        select=selection.select,
        started=started, finished=finished, duration=time.perf_counter() - t0, interrupted=interrupted,
        timings=session.timings,
    )


class _CheckWork:
    """``conformance check``'s work on each case: run and grade it (``run_case``), record the result and tell
    ``progress``; the set's failed cases diagnosed together at its end. A case timed out on an in-process
    backend (which cannot be stopped or restarted) ends the run."""

    def __init__(self, session: Session, policy: Policy, total: int, progress: Progress | None,
                 concurrency: int | None = None):
        self.session, self.policy, self.concurrency = session, policy, concurrency
        self.total, self.progress = total, progress
        self.results: list[CaseResult] = []
        self.first = 0  # where the current set's results start

    def note(self, text: str) -> None:
        if self.progress is not None:
            self.progress(len(self.results), self.total, text, None)

    def start(self, ctx: SetContext, chosen: list) -> None:
        """``--concurrency``: the set's claimed requests to the backend's prefetch, sent ahead of grading."""
        if self.concurrency:
            session = self.session
            with session.clock("backend"):
                session.calls.prefetch(claimed_requests(session.calls, session.claimed, ctx, chosen),
                                       self.concurrency)

    def case(self, ctx: SetContext, case) -> CaseResult:
        session = self.session
        if self.progress is not None:
            self.progress(len(self.results), self.total, case.id, None)
        with session.clock("grade"):
            res = run_case(session.calls, session.claimed, ctx, case, self.policy)
        session.timings["grade"] -= res.duration
        session.timings["backend"] += res.duration
        return res

    def record(self, res: CaseResult) -> None:
        session = self.session
        self.results.append(res)
        if self.progress is not None:
            self.progress(len(self.results), self.total, res.id, res)
        if res.check == "timeout" and not session.calls.restarts:
            session.stop({"reason": "timeout", "case": res.id,
                          "message": (f"case {res.id} did not finish within {session.calls.timeout:g} s: an "
                                      "in-process backend cannot be stopped or restarted, so the run ended there "
                                      "(--isolate runs the backend in a child process that is killed and "
                                      "restarted)")})

    def done(self, ctx: SetContext, results: list) -> None:
        with self.session.clock("grade"):
            diagnose(ctx, results)
