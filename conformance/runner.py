"""Run the selected cases of fixture sets on a backend and grade them: ``run(...) -> RunResult``.

Order of events (see docs/conformance.md):

1. every fixture set is loaded and verified first (``FixtureError``: exit code 3), the ``-k`` regex
   is applied to the case ids (no case left: ``NoCasesSelected``, exit code 5);
2. per set: the model is materialised into a temporary directory (``FixtureSet.model_dir``) and the
   backend is opened on it (any exception: ``BackendError``, exit code 4);
3. per case: the request is built; a request needing a capability the backend does not claim is
   ``not-claimed``; an expectations ``skip`` is ``skipped``; otherwise ``backend.run`` is called
   (an exception is status ``error``, recorded, and the run goes on) and the response is graded
   with the profile (plus any expectations tolerance overrides): ``pass`` or ``fail``; a
   ``known-failure`` entry then turns fail/error into ``xfail`` and pass into ``xpass``.

The exit code of a run (``RunResult.exit_code``): 0 when every run case passed (xfail, skipped and
not-claimed allowed), 1 when any case is fail, error or xpass, 5 when no case was run at all (every
selected case not claimed or skipped).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import queue
import re
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .backend import Backend, BackendError, CaseTimeout, Response, required_capabilities
from .expectations import Expectations
from .fixtures import sha256_file

STATUSES = ("pass", "fail", "error", "not-claimed", "skipped", "xfail", "xpass")
FAILING = ("fail", "error", "xpass")
RAN = ("pass", "fail", "error", "xfail", "xpass")

# progress(done, total, case_id, result): called with result=None before a case runs and with its
# CaseResult after; done counts the cases finished so far.
Progress = Callable[[int, int, str, "CaseResult | None"], None]


class NoCasesSelected(Exception):
    """No case of the fixture sets matched the selection (exit code 5)."""


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


# ----------------------------------------------------------------------------------------------
# results


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

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "set": self.set, "kind": self.kind, "entry": self.entry,
            "features": list(self.features), "status": self.status, "check": self.check,
            "message": self.message, "rows": [dict(r) for r in self.rows], "summary": dict(self.summary),
            "first_divergence": self.first_divergence, "executed": self.executed,
            "duration": self.duration, "moe_min_margin": self.moe_min_margin,
            "ties": [list(t) for t in self.ties], "needs": list(self.needs), "missing": list(self.missing),
            "expectation": self.expectation, "error": self.error,
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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RunResult:
    backend: dict[str, Any]  # name, capabilities, options
    profile: Any  # conformance.profiles.Profile
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

    def counts(self, cases: Iterable[CaseResult] | None = None) -> dict[str, int]:
        c = {s: 0 for s in STATUSES}
        for r in self.cases if cases is None else cases:
            c[r.status] += 1
        return c

    @property
    def exit_code(self) -> int:
        """0, 1 or 5 by the cases' statuses; 128 + the signal's number when a signal ended the run."""
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


# ----------------------------------------------------------------------------------------------
# helpers


def entry_point(case) -> str:
    return f"last:{case.entry}" if case.kind == "last" else case.kind


def compile_select(select: str | re.Pattern | None) -> re.Pattern | None:
    """Compile a -k regex; ValueError with a readable message when invalid."""
    if select is None or isinstance(select, re.Pattern):
        return select
    try:
        return re.compile(select)
    except re.error as e:
        raise ValueError(f"-k: not a valid regular expression ({e}): {select!r}") from None


def _finite(x: Any) -> Any:
    """Metrics as plain Python floats (numpy scalars converted); non-finite kept as floats."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x)
    return x


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


def _make_pieces(model_dir: Path) -> Callable[[list[int]], list[str] | None]:
    """A function mapping token ids to tokenizer pieces (None when the checkpoint has no tokenizer)."""
    tok = None
    try:
        from refimpl.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(model_dir)
    except Exception:  # noqa: BLE001 - pieces are a nicety; never fail the run over them
        tok = None

    def pieces(ids: list[int]) -> list[str] | None:
        if tok is None:
            return None
        out = []
        for i in ids:
            try:
                out.append(tok.piece(int(i)) if 0 <= int(i) < tok.vocab_size else f"<id {int(i)}>")
            except Exception:  # noqa: BLE001
                out.append(f"<id {int(i)}>")
        return out

    return pieces


class _Embedder:
    """Input embeddings for the 'embeddings' entry, in the backend's convention, from the checkpoint.

    scaled: E[ids] * sqrt(H) with the exact float64 sqrt; raw: E[ids]. Read with refimpl's reader.
    """

    def __init__(self, model_dir: Path, convention: str):
        self.model_dir = model_dir
        self.convention = convention
        self._weights = None
        self._scale = 1.0

    def __call__(self, ids) -> np.ndarray:
        if self._weights is None:
            from refimpl.config import load_config
            from refimpl.weights import Gemma4Weights

            cfg = load_config(self.model_dir)
            self._weights = Gemma4Weights(self.model_dir, cfg, np.float64)
            self._scale = math.sqrt(cfg.hidden_size) if self.convention == "scaled" else 1.0
        rows = self._weights.rows("embed_tokens.weight", np.asarray(ids, dtype=np.int64))
        rows = np.asarray(rows, dtype=np.float64)
        return rows * self._scale if self.convention == "scaled" else rows


def _error_info(exc: BaseException) -> dict[str, str]:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    short = "".join(tb[-6:])
    if len(short) > 4000:
        short = "..." + short[-4000:]
    return {"type": type(exc).__name__, "message": str(exc), "traceback": short}


# ----------------------------------------------------------------------------------------------
# the run


def load_sets(paths: Iterable[str | Path]) -> list:
    """Load and verify every fixture set (FixtureError on the first problem)."""
    from .fixtures import load_set

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
) -> RunResult:
    """Run the selected cases of ``sets`` (paths or loaded ``FixtureSet``s) on ``backend``.

    Raises FixtureError (exit 3) for a broken set, BackendError (exit 4) when the backend cannot be
    opened, NoCasesSelected (exit 5) when ``select`` matches no case, ValueError for a bad regex.
    An interrupt (KeyboardInterrupt, or ``Interrupted`` under ``stop_signals``) does not propagate: the
    cases finished so far are returned with ``interrupted`` set. ``case_timeout``: seconds a request
    may take (see ``conformance.backend.CaseTimeout``); past it the case is an error with check
    ``timeout``, and the run goes on where the backend restarts its engine, else it ends there.
    """
    from .fixtures import FixtureSet, load_set

    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    pattern = compile_select(select)
    expectations = expectations if expectations is not None else Expectations()

    loaded: list[FixtureSet] = [s if isinstance(s, FixtureSet) else load_set(Path(s)) for s in sets]
    plan: list[tuple[Any, list]] = []
    infos: list[SetInfo] = []
    for fs in loaded:
        expectations.observe(c.id for c in fs.cases)
        chosen = [c for c in fs.cases if pattern is None or pattern.search(c.id)]
        plan.append((fs, chosen))
        m = fs.manifest
        infos.append(SetInfo(
            name=str(m.get("name", Path(fs.path).name)), version=str(m.get("version", "")),
            path=str(fs.path), manifest_sha256=sha256_file(Path(fs.path) / "manifest.json"),
            model=_model_summary(m), cases_total=len(fs.cases), cases_selected=len(chosen),
        ))
    total = sum(len(c) for _, c in plan)
    if total == 0:
        what = f"-k {pattern.pattern!r}" if pattern is not None else "the selection"
        n_all = sum(len(fs.cases) for fs in loaded)
        raise NoCasesSelected(f"no case selected: {what} matched none of the {n_all} cases of "
                              f"{len(loaded)} fixture set(s)")

    caps = backend.capabilities
    claimed = caps.to_dict()
    calls = _Calls(backend, case_timeout)
    results: list[CaseResult] = []
    in_flight: list[str] = []  # the case being run, while it runs
    interrupted = None
    try:
        for (fs, chosen), info in zip(plan, infos):
            if chosen:
                interrupted = _run_set(calls, claimed, fs, chosen, info, profile, expectations, workdir,
                                       results, total, progress, in_flight)
            if interrupted is not None:
                break
    except KeyboardInterrupt as exc:
        sig = signal.Signals(interrupt_signal(exc)).name
        case = in_flight[0] if in_flight else None
        interrupted = {"reason": sig, "case": case, "message": f"interrupted by {sig}" + (
            f" while case {case} was running (it is not reported)" if case else "")}
    if interrupted is not None:
        interrupted["cases_not_run"] = total - len(results)

    finished = _dt.datetime.now(_dt.timezone.utc)
    return RunResult(
        backend={"name": getattr(backend, "name", type(backend).__name__), "capabilities": claimed,
                 "options": dict(backend_options or {})},
        profile=profile, sets=infos, cases=results, expectations=expectations.report(),
        select=pattern.pattern if pattern is not None else None,
        started=started, finished=finished, duration=time.perf_counter() - t0, interrupted=interrupted,
    )


def _run_set(calls: _Calls, claimed: dict, fs, chosen: list, info: SetInfo, profile, expectations: Expectations,
             workdir, results: list, total: int, progress: Progress | None, in_flight: list) -> dict | None:
    """Run the chosen cases of one set, appending to ``results``; the ``interrupted`` record when an
    in-process backend timed out (the run cannot go on), else None."""

    def record(res: CaseResult) -> None:
        results.append(res)
        if progress is not None:
            progress(len(results), total, res.id, res)

    with tempfile.TemporaryDirectory(prefix="gemma4-conformance-", dir=workdir) as tmp:
        model_dir = fs.model_dir(Path(tmp))
        info.warnings = [str(w) for w in getattr(fs, "warnings", [])]
        ctx = SetContext(fs, Path(model_dir), claimed["embedding_convention"])
        if not any(_claimable(ctx, case, claimed) for case in chosen):
            # nothing here for this backend (e.g. an image set for a text-only engine): every case is
            # reported as not claimed, and the backend is not made to load a checkpoint it cannot use
            for case in chosen:
                record(run_case(calls.backend, claimed, ctx, case, profile, expectations))
            return None
        try:
            calls.open(Path(model_dir))
        except BackendError:
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - cannot open (SystemExit too): the run stops (exit 4)
            raise BackendError(f"backend {getattr(calls.backend, 'name', '?')!r} could not open "
                               f"{fs.manifest.get('name', fs.path)} ({model_dir}): "
                               f"{type(exc).__name__}: {exc}") from exc
        clean = False
        try:
            for case in chosen:
                if progress is not None:
                    progress(len(results), total, case.id, None)
                in_flight[:] = [case.id]
                res = run_case(calls, claimed, ctx, case, profile, expectations)
                in_flight.clear()
                record(res)
                if res.check == "timeout" and not calls.restarts:
                    return {"reason": "timeout", "case": case.id,
                            "message": (f"case {case.id} did not finish within {calls.timeout:g} s: an in-process "
                                        "backend cannot be stopped or restarted, so the run ended there "
                                        "(--isolate runs the backend in a child process that is killed and "
                                        "restarted)")}
            clean = True
        finally:
            if clean or not in_flight:  # never wait on a backend interrupted in the middle of a call
                try:
                    calls.close()
                except KeyboardInterrupt:
                    raise
                except BaseException:  # noqa: BLE001 - a failing close must not hide the results
                    pass
    return None


def _model_summary(manifest: dict) -> dict[str, Any]:
    model = manifest.get("model")
    if not isinstance(model, dict):
        return {}
    keep = {}
    for k, v in model.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            keep[k] = v
    return keep


class SetContext:
    """What grading the cases of one opened fixture set needs: bases, oracle logits, embedder, tokenizer."""

    def __init__(self, fs, model_dir: Path, convention: str):
        self.fs = fs
        self.name = str(fs.manifest.get("name", Path(fs.path).name))
        self.model_dir = model_dir
        self.bases = fs.bases()
        self.base_logits = fs.base_logits()
        self.embed = _Embedder(model_dir, convention)
        self.media = fs.media(convention) if hasattr(fs, "media") else {}
        self.pieces = _make_pieces(model_dir)


def run_case(backend: Backend, claimed: dict, ctx: SetContext, case, profile,
             expectations: Expectations) -> CaseResult:
    """Run and grade one case on an opened backend (``claimed``: ``backend.capabilities.to_dict()``).

    Never raises for backend or grading problems: they become status ``error``.
    """
    from .cases import build_request, response_groups, row_groups
    from .grading import grade_case

    res = CaseResult(
        id=case.id, set=ctx.name, kind=case.kind, entry=entry_point(case), features=list(case.features),
        status="pass", moe_min_margin=case.moe_min_margin, ties=[[str(a), float(b)] for a, b in case.ties],
    )
    decision = expectations.decide(case.id)
    res.expectation = decision.to_json()

    try:
        request = build_request(case, ctx.bases, ctx.embed, ctx.media)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a harness bug must not stop the run either
        res.status, res.check = "error", "harness"
        res.message = f"the harness could not build the request: {type(exc).__name__}: {exc}"
        res.error = _error_info(exc)
        return res
    res.needs = required_capabilities(request)
    res.missing = [n for n in res.needs if not claimed.get(n, False)]
    if res.missing == ["decode"]:
        # a backend without decode still has its prefill rows graded; the decode steps are reported as
        # not claimed (in `missing`) rather than dropping the whole case
        case = _without_decode(case)
        request = build_request(case, ctx.bases, ctx.embed, ctx.media)
    elif res.missing:
        res.status = "not-claimed"
        res.message = "needs " + ", ".join(res.missing) + " (not claimed by the backend)"
        return res
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
    res.executed = _jsonable(executed)

    prof = profile
    if decision.tolerance:
        from .profiles import with_overrides

        prof = with_overrides(profile, decision.tolerance)
    try:
        groups = row_groups(case)
        got = response_groups(case, response)
        grade = grade_case(case, groups, got, ctx.base_logits, prof)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a malformed response the grader cannot read
        res.status, res.check = "error", "response"
        res.message = f"the response could not be graded: {type(exc).__name__}: {exc}"
        res.error = _error_info(exc)
        return _apply_known_failure(res, decision)
    res.status = grade.status
    res.check = grade.check
    res.message = grade.message
    if res.missing:
        res.message = (res.message + "; " if res.message else "") + "decode not claimed: only the prefill rows were graded"
    res.rows = [_row_json(r, ctx.pieces) for r in grade.rows]
    res.summary = {k: _finite(v) for k, v in (grade.summary or {}).items()}
    res.first_divergence = None if grade.first_divergence is None else int(grade.first_divergence)
    return _apply_known_failure(res, decision)


def _claimable(ctx: SetContext, case, claimed: dict) -> bool:
    """Whether the backend claims what ``case`` needs (decode aside, which is dropped when unclaimed).
    A case whose request cannot be built counts as claimable: running it reports the harness error."""
    from .cases import build_request

    try:
        need = required_capabilities(build_request(case, ctx.bases, ctx.embed, ctx.media))
    except Exception:  # noqa: BLE001
        return True
    return all(claimed.get(n, False) for n in need if n != "decode")


def _without_decode(case):
    """The same case with its decode steps removed (for backends that do not claim decode)."""
    from dataclasses import replace

    return replace(
        case, decode_len=0, sequences=tuple((b, n, sid, 0) for b, n, sid, _ in case.sequences),
        golden_tokens=tuple(case.golden_tokens[:1]),
    )


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


def _jsonable(x: Any, depth: int = 0) -> Any:
    """Best-effort conversion of a backend's ``executed`` record into JSON-able values."""
    if depth > 8:
        return repr(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist(), depth + 1)
    if isinstance(x, (np.generic,)):
        return _finite(x.item())
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return repr(x)


# names used by earlier callers
_SetContext = SetContext
_run_case = run_case
