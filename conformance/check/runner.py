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

import dataclasses
import datetime as _dt
import queue
import re
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

from ..protocol.types import Backend, CaseTimeout, Response, claims, required_capabilities
from ..protocol.wire import jsonable
from ..sets.case import row_groups
from ..sets.integrity import load_set
from .diagnosis import diagnose_set
from .exits import refuse_process_exit
from .expectations import Expectations
from .grading import grade_case
from .hidden import grade_hidden, hidden_groups
from .mtp import grade_mtp
from .profiles import with_overrides
from .requests import build_request, response_groups, without_decode
from .results import CaseResult, Progress, RunResult, SetInfo, _finite, entry_point
from .session import Checkpoints, Selection, Session, SetContext


class Interrupted(KeyboardInterrupt):
    """A stop signal other than SIGINT (SIGTERM, SIGHUP) arrived during a run: raised by the handler of
    ``stop_signals``. A subclass of KeyboardInterrupt, so every place that lets an interrupt through
    lets this through too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def interrupt_signal(exc: KeyboardInterrupt) -> int:
    """The signal number an interrupt stands for (SIGINT for a plain KeyboardInterrupt)."""
    return exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)


class stop_signals:
    """``with stop_signals():`` SIGTERM and SIGHUP raise ``Interrupted`` in the main thread (SIGINT already
    raises KeyboardInterrupt), so a CI job's timeout ends a run like Ctrl-C: finally blocks run,
    temporary files go, and the finished cases are reported. The previous handlers come back on exit.
    Outside the main thread it does nothing."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __enter__(self):
        self._saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Interrupted(signum)

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        return False


def _row_json(row: Any, pieces: Callable[[list[int]], list[str] | None] | None) -> dict[str, Any]:
    d = dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(row)
    d["metrics"] = {k: _finite(v) for k, v in (d.get("metrics") or {}).items()}
    for k in ("top_ref", "top_got"):
        d[k] = [int(t) for t in (d.get(k) or [])]
    if "position" in d and d["position"] is not None:
        d["position"] = int(d["position"])
    if pieces is not None and d.get("status") == "fail":
        d["top_ref_pieces"] = pieces(d["top_ref"])
        d["top_got_pieces"] = pieces(d["top_got"])
    return d


def _error_info(exc: BaseException) -> dict[str, str]:
    """The error record of a case: the exception's type and message, and the last frames of its traceback
    without the exception's text again (the message holds it: an engine error is shown once)."""
    short = "".join(traceback.format_tb(exc.__traceback__)[-5:])
    if len(short) > 4000:
        short = "..." + short[-4000:]
    return {"type": type(exc).__name__, "message": str(exc), "traceback": short}


def _harness_error(res: CaseResult, doing: str, exc: BaseException) -> CaseResult:
    """``res`` as the case's error when the harness itself failed to ``doing`` (check ``harness``)."""
    res.status, res.check = "error", "harness"
    res.message = f"the harness could not {doing}: {type(exc).__name__}: {exc}"
    res.error = _error_info(exc)
    return res


def load_sets(paths: Iterable[str | Path]) -> list:
    """Load and verify every fixture set (FixtureError on the first problem)."""
    return [load_set(Path(p)) for p in paths]


class _Supervisor:
    """Runs an in-process backend's calls on one dedicated daemon thread, so that a call can be given up
    on after a deadline (``--case-timeout``). Every call of the backend (open, run, close) goes through
    the same thread, so a backend that keeps thread-local state (streams, contexts) sees one thread.
    A call that is given up on keeps running: nothing can stop it in-process, so the run must end."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self.busy = False  # a call was given up on and may still be running
        threading.Thread(target=self._work, name="conformance-backend", daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who decides
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """``fn()`` on the backend thread; CaseTimeout when it has not returned after ``timeout`` seconds."""
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            self.busy = True
            raise CaseTimeout(f"the backend did not return within {timeout:g} s (--case-timeout)")
        ok, value = box[0]
        if ok:
            return value
        raise value


class _Calls:
    """How the run calls the backend: directly, or through a supervisor that enforces the case timeout.

    A backend with ``set_case_timeout`` (one whose engine runs in a child process it kills and
    restarts) enforces the timeout itself and is called directly."""

    def __init__(self, backend: Backend, case_timeout: float | None):
        self.backend = backend
        self.timeout = case_timeout
        self.supervisor = None
        if case_timeout is not None:
            if callable(getattr(backend, "set_case_timeout", None)):
                backend.set_case_timeout(case_timeout)
            else:
                self.supervisor = _Supervisor()

    @property
    def restarts(self) -> bool:
        """Whether a timed-out case leaves a usable backend (it restarts its engine)."""
        return self.supervisor is None

    def open(self, model_dir: Path) -> None:
        self._call(lambda: self.backend.open(model_dir))

    def close(self) -> None:
        if self.supervisor is not None and self.supervisor.busy:
            return  # a hung call still holds the backend
        self._call(self.backend.close)

    def run(self, request) -> Any:
        return self._call(lambda: self.backend.run(request), self.timeout)

    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        return fn() if self.supervisor is None else self.supervisor.call(fn, timeout)


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
) -> RunResult:
    """Run the selected cases of ``sets`` (paths or loaded ``FixtureSet``s) on ``backend``.

    Raises FixtureError (exit 3) for a broken set, BackendError (exit 4) when the backend cannot be
    opened, NoCasesSelected (exit 5) when ``select`` matches no case, ValueError for a bad regex.
    An interrupt (KeyboardInterrupt, or ``Interrupted`` under ``stop_signals``) does not propagate: the
    cases finished so far are returned with ``interrupted`` set. ``case_timeout``: seconds a request
    may take (see ``conformance.backend.CaseTimeout``); past it the case is an error with check
    ``timeout``, and the run goes on where the backend restarts its engine, else it ends there.
    ``model``: the directory of every external set's checkpoint (``--model``; default: each set's recorded
    path); ``rehash``: read the checkpoint files again instead of trusting the digest cache (``Checkpoints``);
    ``drafter``: the MTP assistant of sets with MTP cases (``--drafter``; default: the path each set records).
    """
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    expectations = expectations if expectations is not None else Expectations()

    selection = Selection(sets, select)
    for fs in selection.sets:
        expectations.observe(c.id for c in fs.cases)
    plan, infos, total = list(zip(selection.sets, selection.chosen, strict=True)), selection.infos(), selection.total

    claimed = backend.capabilities.to_dict()
    calls = _Calls(backend, case_timeout)
    timings = dict.fromkeys(PHASES, 0.0)
    results: list[CaseResult] = []
    in_flight: list[str] = []  # the case being run, while it runs
    interrupted = None
    with tempfile.TemporaryDirectory(prefix="gemma4-conformance-", dir=workdir) as tmp, refuse_process_exit():
        session = Session(backend, Checkpoints(tmp, model=model, rehash=rehash, drafter=drafter), calls)
        try:
            for (fs, chosen), info in zip(plan, infos, strict=True):
                if chosen:
                    interrupted = _run_set(session, claimed, fs, chosen, info, profile, expectations, results, total,
                                           progress, in_flight, timings)
                if interrupted is not None:
                    break
        except KeyboardInterrupt as exc:
            sig = signal.Signals(interrupt_signal(exc)).name
            case = in_flight[0] if in_flight else None
            interrupted = {"reason": sig, "case": case, "message": f"interrupted by {sig}" + (
                f" while case {case} was running (it is not reported)" if case else "")}
        finally:
            if not in_flight:  # never wait on a backend interrupted in the middle of a call
                session.close()
    if interrupted is not None:
        interrupted["cases_not_run"] = total - len(results)

    finished = _dt.datetime.now(_dt.timezone.utc)
    return RunResult(
        backend={"name": getattr(backend, "name", type(backend).__name__), "capabilities": claimed,
                 "options": dict(backend_options or {})},
        profile=profile, sets=infos, cases=results, expectations=expectations.report(),
        select=selection.select,
        started=started, finished=finished, duration=time.perf_counter() - t0, interrupted=interrupted,
        timings=timings,
    )


# where a run's time goes (RunResult.timings, seconds): the checkpoint made or checked (a synthetic set's
# regenerated, an external one's digests), the oracle's rows rebuilt through its head (a set stored as hidden
# states), the backend opened on it, the backend's requests (the cases' durations), the grading and diagnosis
PHASES = ("checkpoint", "rebuild", "open", "backend", "grade")


class _Clock:
    """``with _Clock(timings, phase):`` adds the block's wall time to ``timings[phase]``."""

    def __init__(self, timings: dict, phase: str):
        self.timings, self.phase = timings, phase

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.timings[self.phase] += time.perf_counter() - self.t0


def _run_set(session: Session, claimed: dict, fs, chosen: list, info: SetInfo, profile, expectations: Expectations,
             results: list, total: int, progress: Progress | None, in_flight: list, timings: dict) -> dict | None:
    """Run the chosen cases of one set, appending to ``results`` (the time of each phase added to ``timings``);
    the ``interrupted`` record when an in-process backend timed out (the run cannot go on), else None."""

    def record(res: CaseResult) -> None:
        results.append(res)
        if progress is not None:
            progress(len(results), total, res.id, res)

    with _Clock(timings, "checkpoint"):
        ctx = session.context(fs)
    with _Clock(timings, "rebuild"):
        ctx.prepare(chosen, None if progress is None else (lambda text: progress(len(results), total, text, None)))
    info.warnings = [str(w) for w in getattr(fs, "warnings", [])]
    if not any(ctx.claimable(case, claimed) for case in chosen):
        # nothing here for this backend (e.g. an image set for a text-only engine): every case is
        # reported as not claimed, and the backend is not made to load a checkpoint it cannot use
        for case in chosen:
            record(run_case(session.backend, claimed, ctx, case, profile, expectations))
        return None
    with _Clock(timings, "open"):
        session.enter(fs)
    calls = session.calls
    first = len(results)
    try:
        for case in chosen:
            if progress is not None:
                progress(len(results), total, case.id, None)
            in_flight[:] = [case.id]
            with _Clock(timings, "grade"):
                res = run_case(calls, claimed, ctx, case, profile, expectations)
            timings["grade"] -= res.duration
            timings["backend"] += res.duration
            in_flight.clear()
            record(res)
            if res.check == "timeout" and not calls.restarts:
                return {"reason": "timeout", "case": case.id,
                        "message": (f"case {case.id} did not finish within {calls.timeout:g} s: an in-process "
                                    "backend cannot be stopped or restarted, so the run ended there "
                                    "(--isolate runs the backend in a child process that is killed and "
                                    "restarted)")}
    finally:  # also when the run is interrupted: the cases it finished keep their diagnoses
        with _Clock(timings, "grade"):
            _diagnose(ctx, results[first:])
    return None


def _diagnose(ctx: SetContext, results: list[CaseResult]) -> None:
    """The diagnosis line of every failed case of one set (conformance.check.diagnosis); a diagnosis that
    cannot be made (a checkpoint whose config cannot be read again) leaves the results as they are."""
    try:
        cfg = ctx.text_config
        diagnose_set(results, softcap=cfg.final_logit_softcapping,
                     kv_shared=cfg.first_shared_layer < cfg.num_hidden_layers, unified=cfg.family == "gemma4_unified")
    except Exception:  # noqa: BLE001 - a diagnosis is advice; it never costs the verdict
        pass


def run_case(backend: Backend, claimed: dict, ctx: SetContext, case, profile,
             expectations: Expectations) -> CaseResult:
    """Run and grade one case on an opened backend (``claimed``: ``backend.capabilities.to_dict()``).

    Never raises for backend or grading problems: they become status ``error``.
    """

    res = CaseResult(
        id=case.id, set=ctx.name, kind=case.kind, entry=entry_point(case), features=list(case.features),
        status="pass", moe_min_margin=case.moe_min_margin, ties=[[str(a), float(b)] for a, b in case.ties],
    )
    decision = expectations.decide(case.id)
    res.expectation = decision.to_json()

    try:
        request = build_request(case, ctx.bases, ctx.embed, ctx.media, ctx.drafter)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a harness bug must not stop the run either
        return _harness_error(res, "build the request", exc)
    res.needs = required_capabilities(request)
    res.missing = [n for n in res.needs if not claims(claimed, n)]
    if res.missing == ["decode"]:
        # a backend without decode still has its prefill rows graded; the decode steps are reported as
        # not claimed (in `missing`) rather than dropping the whole case
        case = without_decode(case)
        request = build_request(case, ctx.bases, ctx.embed, ctx.media, ctx.drafter)
    elif res.missing:
        res.status = "not-claimed"
        res.message = "needs " + ", ".join(res.missing) + " (not claimed by the backend)"
        return res
    if claimed.get("hidden_states", False):
        request = dataclasses.replace(request, hidden=True)  # the final-norm hidden state of every returned row
    if decision.skip is not None:
        res.status = "skipped"
        res.message = f"skipped by expectations entry {decision.skip.index}: {decision.skip.reason}"
        return res

    t = time.perf_counter()
    try:
        response = backend.run(request)
        res.duration = time.perf_counter() - t
        if not isinstance(response, Response):
            raise TypeError(f"backend.run returned {type(response).__name__}, not conformance.backend.Response")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure (SystemExit too) is this case's error; the run goes on
        res.duration = time.perf_counter() - t
        res.status, res.check = "error", ("timeout" if isinstance(exc, CaseTimeout) else None)
        res.message = f"{type(exc).__name__}: {exc}"
        res.error = _error_info(exc)
        return _apply_known_failure(res, decision)
    executed = response.executed if response.executed is not None else {}
    if not isinstance(executed, dict):
        res.status, res.check = "error", "response"
        res.message = (f"the response could not be graded: Response.executed must be a dict, got "
                       f"{type(executed).__name__}")
        return _apply_known_failure(res, decision)
    res.executed = jsonable(executed)

    try:
        prof = ctx.profile_for(profile, case)  # a rounding-scaled profile (exact-f64) follows the set's size
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a harness bug must not stop the run either
        return _apply_known_failure(_harness_error(res, "scale the profile to this set", exc), decision)
    if decision.tolerance:
        prof = with_overrides(prof, decision.tolerance)
    try:
        groups = row_groups(case)
        got = response_groups(case, response)
        grade = grade_case(case, groups, got, ctx.base_logits, prof)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a malformed response the grader cannot read
        return _apply_known_failure(_ungradable(res, "the response", exc), decision)
    res.status = grade.status
    res.check = grade.check
    res.message = grade.message
    if case.kind == "mtp":
        failure = grade_mtp(case, response, prof)
        if failure is not None:
            _fold(res, failure[0], failure[1], failure[1])
    hidden_rows = []
    hidden_of = hidden_groups(case, groups, response) if request.hidden else None
    if hidden_of is not None and all(r.base in ctx.base_hidden for _, rows in hidden_of[0] for r in rows):
        try:
            hidden_rows = grade_hidden(*hidden_of, ctx.base_hidden, prof)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - malformed hidden rows the grader cannot read
            return _apply_known_failure(_ungradable(res, "the response's hidden rows", exc), decision)
        bad = [r for r in hidden_rows if r.status == "fail"]
        if bad:
            more = f" (+{len(bad) - 1} more hidden rows fail)" if len(bad) > 1 else ""
            _fold(res, bad[0].check, bad[0].message + more,
                  f"{len(bad)} hidden row{'s' if len(bad) > 1 else ''} fail too ({bad[0].message})")
    if res.missing:
        res.message = (res.message + "; " if res.message else "") + ("decode not claimed: only the prefill rows were "
                                                                     "graded")
    res.rows = [_row_json(r, ctx.pieces) for r in grade.rows + hidden_rows]
    res.summary = {k: _finite(v) for k, v in (grade.summary or {}).items()}
    res.first_divergence = None if grade.first_divergence is None else int(grade.first_divergence)
    return _apply_known_failure(res, decision)


def _ungradable(res: CaseResult, what: str, exc: BaseException) -> CaseResult:
    """``res`` as the error of a response whose ``what`` ("the response") the grader cannot read."""
    res.status, res.check = "error", "response"
    res.message = f"{what} could not be graded: {type(exc).__name__}: {exc}"
    res.error = _error_info(exc)
    return res


def _fold(res: CaseResult, check: str, message: str, also: str) -> None:
    """A failure found after the rows were graded (an MTP answer, hidden rows): the case's failure when it
    passed so far, else ``also`` noted in its message."""
    if res.status == "pass":
        res.status, res.check, res.message = "fail", check, message
    else:
        res.message += f"; {also}"


def _apply_known_failure(res: CaseResult, decision) -> CaseResult:
    e = decision.known_failure
    if e is None:
        return res
    if res.status in ("fail", "error"):
        was = res.status
        res.status = "xfail"
        res.message = f"known failure (expectations entry {e.index}: {e.reason}); {was}: {res.message}"
    elif res.status == "pass":
        res.status = "xpass"
        res.message = (f"passed, but expectations entry {e.index} declares a known failure ({e.reason}); "
                       "remove the entry")
    return res


