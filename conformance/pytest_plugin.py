"""pytest plugin: run the conformance cases as pytest items.

    pytest --conformance-backend refimpl
    pytest --conformance-backend mypkg.engine:MyBackend --conformance-fixtures sets/ \\
           --conformance-profile q8 --conformance-expectations expectations.json -k "last and not embeddings"
    pytest --conformance-backend refimpl --conformance-fixtures my-set/ --conformance-model /data/ckpt
    pytest --conformance-backend refimpl --conformance-json report.json

The plugin is registered through the ``pytest11`` entry point, so it is loaded in every pytest run
once the package is installed; without ``--conformance-backend`` it only adds its options and does
nothing else (the harness modules are imported lazily, only when the option is given).

With the option, one item is collected per case of the fixture sets (the bundled sets unless
``--conformance-fixtures`` is given), named by the case id, under one file collector per set: the set's
``manifest.json`` (or the set's ``.tar``). An item's node id is therefore ``<manifest path>::<case id>``
(the path relative to the rootdir, or absolute for a set outside it), which pytest resolves like any
other: ``pytest "<node id>" --conformance-backend X`` runs that one case. A command-line argument that
points into a set (its manifest, a node id, the set's directory) chooses that set's cases; otherwise
every set's cases are added to the session's other tests. Each item carries its feature tags, its kind,
its entry point (``last:embeddings``) and its set's name as ``-k`` keywords.

The first item of a set to run runs every selected case of that set through the harness runner, in order,
and diagnoses them together, as ``conformance check`` does (the same diagnosis line); each item then
reports its own case: ``pass`` passes; ``fail``, ``error`` and ``xpass``
fail with the console summary's details of the case (``conformance.report.console.failure_details``:
message, diagnosis, first failing row with its metrics, top-5 tokens, every failing row, what the backend
executed); ``not-claimed`` and expectations ``skip`` are skipped; a known failure that fails is an xfail.
The backend is opened once per set (on the set's model), when the set's first item runs, and closed when
the next set starts or the session ends. ``--conformance-only`` deselects every other test of the
session; ``--conformance-json FILE`` writes the versioned JSON report of ``conformance check --json``
(``conformance/report/schemas/report-v1.json``) of the cases that ran, at the end of the session, and
``--conformance-html FILE`` the HTML page of ``conformance check --html``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from .check.cases import diagnose, run_case
from .check.policy import Policy, PolicyError, check_profile_name, load_given, resolve_policy
from .check.results import CaseResult, RunResult, entry_point
from .check.session import Checkpoints, Selection, Session, Work
from .protocol.types import BackendError
from .registry import load_backend, parse_option
from .report import failure_details, printable, write_json
from .report.html import write_html
from .sets import MANIFEST, FixtureError, load_set, set_paths

PLUGIN_NAME = "gemma4-conformance-session"


def pytest_addoption(parser):
    group = parser.getgroup("gemma4-conformance", "Gemma 4 conformance harness")
    group.addoption("--conformance-backend", metavar="NAME|module:attr", default=None,
                    help="run the conformance cases on this backend (a registered name or module:attr)")
    group.addoption("--conformance-fixtures", metavar="DIR", action="append", default=None,
                    help="a fixture set, or a directory of sets (repeatable; default: the bundled sets)")
    group.addoption("--conformance-profile", metavar="PROFILE", default=None,
                    help="tolerance profile (default: the backend's default_profile)")
    group.addoption("--conformance-expectations", metavar="FILE", default=None,
                    help="expectations file: skips, known failures, tolerance overrides (default: the file "
                         "the backend ships for its configuration, if any)")
    group.addoption("--conformance-no-shipped-expectations", action="store_true", default=False,
                    help="grade without the expectations file the backend ships")
    group.addoption("--conformance-backend-option", metavar="KEY=VALUE", action="append", default=[],
                    help="option passed to the backend's class or factory (VALUE parsed as JSON if it can be)")
    group.addoption("--conformance-model", metavar="DIR", default=None,
                    help="the checkpoint of every external fixture set: a directory anywhere whose files have the "
                         "size and sha256 the set records (default: the path the set records; synthetic sets "
                         "ignore it)")
    group.addoption("--conformance-rehash", action="store_true", default=False,
                    help="read every checkpoint file again instead of trusting the digest cache")
    group.addoption("--conformance-only", action="store_true", default=False,
                    help="deselect every test that is not a conformance case")
    group.addoption("--conformance-json", metavar="FILE", default=None,
                    help="write the JSON report of the cases that ran (the schema of `conformance check --json`) "
                         "to FILE at the end of the session")
    group.addoption("--conformance-html", metavar="FILE", default=None,
                    help="write the HTML page of `conformance check --html` (verdict, tables, every failed case "
                         "with its diagnosis, rows and top-k tokens) to FILE at the end of the session")


def pytest_configure(config):
    if config.getoption("--conformance-backend", default=None):
        try:
            session = ConformanceSession(config)
        except ImportError as exc:  # a harness module is missing (broken install)
            raise pytest.UsageError(f"--conformance-backend: cannot import the harness: {exc}") from None
        config.pluginmanager.register(session, PLUGIN_NAME)


# ----------------------------------------------------------------------------------------------


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs, read as ``conformance check --backend-option`` reads them."""
    try:
        return dict(parse_option(pair) for pair in pairs)
    except ValueError as e:
        raise pytest.UsageError(f"--conformance-backend-option {e}") from None


def _policy(backend, config) -> Policy:
    """The profile and expectations of the session, chosen as ``conformance check`` chooses them
    (``conformance.check.policy.resolve_policy``); a bad option or declaration is a usage error."""
    name, path = config.getoption("--conformance-profile"), config.getoption("--conformance-expectations")
    try:
        check_profile_name(name)
    except PolicyError as exc:
        raise pytest.UsageError(f"--conformance-profile: {exc}") from None
    try:
        given = load_given(path)
    except PolicyError as exc:
        raise pytest.UsageError(f"--conformance-expectations: {exc}") from None
    try:
        return resolve_policy(backend, name, given,
                              shipped=not config.getoption("--conformance-no-shipped-expectations"),
                              flag="--conformance-profile")
    except PolicyError as exc:
        raise pytest.UsageError(str(exc)) from None


def _set_dirs(args: list[str] | None) -> list[Path]:
    """Fixture-set directories: the bundled sets, or each argument (a directory of sets expands to them)."""
    try:
        return set_paths(args, "--conformance-fixtures")
    except (ValueError, FixtureError) as e:  # FixtureError: a loop of symbolic links
        raise pytest.UsageError(str(e)) from None


def _absolute(path: str | Path) -> Path:
    """An absolute path as pytest makes them (normalised, symbolic links kept), so that they compare equal."""
    return Path(os.path.abspath(path))


def _anchor(set_path: Path) -> Path:
    """The file a set's items hang under: its manifest (or the set's .tar). A node id must name a file for
    pytest to take ``::`` parts after it; a directory that is no set (no manifest) stays itself, and its
    collection reports what is missing."""
    manifest = set_path / MANIFEST
    return manifest if manifest.is_file() else set_path


def _set_name(fs) -> str:
    return str(fs.manifest.get("name", Path(fs.path).name))


class ConformanceSession:
    """Per-session state: the backend, the profile, the expectations, the set now open and the results."""

    def __init__(self, config):
        self.config = config
        self.spec = config.getoption("--conformance-backend")
        self.options = _parse_options(config.getoption("--conformance-backend-option"))
        try:
            self.backend = load_backend(self.spec, **self.options)
        except BackendError as exc:
            raise pytest.UsageError(f"--conformance-backend: {exc}") from None
        self.policy = _policy(self.backend, config)
        self.profile, self.expectations = self.policy.profile, self.policy.expectations
        self.only = config.getoption("--conformance-only")
        # every set, by the file its items hang under (see _anchor), in the order given
        self.sets: dict[Path, Path] = {_anchor(p): p for p in map(_absolute, _set_dirs(
            config.getoption("--conformance-fixtures")))}
        self.model = config.getoption("--conformance-model")
        if self.model is not None and not Path(self.model).is_dir():
            raise pytest.UsageError(f"--conformance-model: no such directory: {self.model}")
        self.rehash = config.getoption("--conformance-rehash")
        # the report files asked for: (option, path); what was written, and what could not be
        self.outputs = [(flag, config.invocation_params.dir / value) for flag in ("--conformance-json",
                                                                             "--conformance-html")
                        if (value := config.getoption(flag)) is not None]
        self.written: list[tuple[str, Path]] = []
        self.unwritten: list[tuple[str, str]] = []
        self.counts: dict[str, int] = {}
        self.results: list[CaseResult] = []  # every case that ran, in order (the JSON report's cases)
        self.loaded: dict[Path, Any] = {}  # anchor -> the FixtureSet its collector loaded
        self.selected: dict[Path, int] = {}  # anchor -> its items left after deselection
        self.batches: dict[str, list] = {}  # case id -> the selected cases of its set, in run order
        self.done: dict[str, CaseResult] = {}  # case id -> its result, once its set's batch ran
        self._collected: set[Path] = set()  # anchors pytest's own collection reached (an argument, a directory)
        self._started = _dt.datetime.now(_dt.timezone.utc)
        self._t0 = time.perf_counter()
        self._open_set = None  # the FixtureSet the backend is open on
        self._open_error: str | None = None
        self._tmp = tempfile.mkdtemp(prefix="gemma4-conformance-")  # the materialised checkpoints
        self.session = Session(self.backend, Checkpoints(self._tmp, model=self.model, rehash=self.rehash))

    # -- collection -----------------------------------------------------------------------------

    def nodeid(self, anchor: Path) -> str:
        """A set collector's node id: its file's path relative to the rootdir (pytest's own rule), or its
        absolute path when the set is outside the rootdir; either way a path ``pytest`` resolves."""
        try:
            return anchor.relative_to(self.config.rootpath).as_posix()
        except ValueError:
            return anchor.as_posix()

    def set_collector(self, parent, anchor: Path) -> ConformanceSet:
        return ConformanceSet.from_parent(parent, path=anchor, name=self.sets[anchor].name,
                                          nodeid=self.nodeid(anchor), conformance=self, set_path=self.sets[anchor])

    def pytest_collect_file(self, file_path: Path, parent):
        """A set's manifest reached by pytest's collection: a node id or path argument, or a directory walked."""
        anchor = _absolute(file_path)
        if anchor in self.sets:
            self._collected.add(anchor)
            return self.set_collector(parent, anchor)
        return None

    def _addressed(self, config) -> bool:
        """Whether a command-line argument points into a fixture set (its manifest, a node id under it, the
        set's directory or a file in it): then the arguments choose the cases, as for any pytest test."""
        for arg in config.args:
            path = _absolute(config.invocation_params.dir / arg.partition("[")[0].split("::")[0])
            for anchor, set_path in self.sets.items():
                if path in (anchor, set_path) or set_path in path.parents:
                    return True
        return False

    @pytest.hookimpl(tryfirst=True)  # before -k / -m deselection
    def pytest_collection_modifyitems(self, session, config, items):
        added = []
        if not self._addressed(config):
            for anchor in self.sets:
                if anchor not in self._collected:  # not already collected through a directory argument
                    self._collected.add(anchor)
                    added.extend(session.genitems(self.set_collector(session, anchor)))
        ours = [item for item in items if isinstance(item, ConformanceCase)] + added
        self.expectations.observe(item.case.id for item in ours)
        if self.only:
            others = [item for item in items if not isinstance(item, ConformanceCase)]
            if others:
                config.hook.pytest_deselected(items=others)
            items[:] = ours
        else:
            items.extend(added)

    def pytest_collection_finish(self, session):
        """How many cases of each set are left after -k, -m and the other deselections (the report's
        ``cases_selected``)."""
        self.selected = {}
        batches: dict[Path, list] = {}
        for item in session.items:
            if isinstance(item, ConformanceCase):
                self.selected[item.parent.path] = self.selected.get(item.parent.path, 0) + 1
                batches.setdefault(item.parent.path, []).append(item.case)
        self.batches = {case.id: cases for cases in batches.values() for case in cases}

    # -- running --------------------------------------------------------------------------------

    def run_case(self, fs, case) -> CaseResult:
        """The result of ``case``. The first item of a set to run runs every selected case of the set through
        the session's loop, in order, and diagnoses them together as ``conformance check`` does (the
        cross-case patterns need the whole set); each item then reports its own case's result. A set whose
        model cannot be prepared or whose backend cannot be opened makes each of its items an error."""
        if case.id in self.done:
            return self.done.pop(case.id)
        if self._open_set is fs and self._open_error is not None:
            self._record(self._error(fs, case))
            raise ConformanceFailure(self._open_error)
        self.close()
        self._open_set = fs
        batch = [c for c in self.batches.get(case.id, [case]) if c.id not in self.done]
        try:
            self.session.run_set(fs, batch, Work(self._run_one, diagnose, self._ran))
        except BackendError as exc:
            self._open_error = f"backend error: {exc}"
        except Exception as exc:  # noqa: BLE001 - e.g. FixtureError while materialising the model
            msg = str(exc).replace("--model DIR", "--conformance-model DIR")  # this plugin's name of the flag
            self._open_error = f"cannot prepare the model of set {fs.path}: {type(exc).__name__}: {msg}"
        if case.id not in self.done:  # the set could not be opened: the case is an error of the report too
            self._record(self._error(fs, case))
            raise ConformanceFailure(self._open_error)
        return self.done.pop(case.id)

    def _error(self, fs, case) -> CaseResult:
        return CaseResult(id=case.id, set=_set_name(fs), kind=case.kind, entry=entry_point(case),
                          features=list(case.features), status="error", message=str(self._open_error))

    def _run_one(self, ctx, case) -> CaseResult:
        """The session's work on one case: run and grade it as conformance check does."""
        return run_case(self.session.calls, self.session.claimed, ctx, case, self.policy)

    def _ran(self, result: CaseResult) -> None:
        self.done[result.id] = result
        self._record(result)

    def _record(self, result: CaseResult) -> None:
        self.results.append(result)
        self.counts[result.status] = self.counts.get(result.status, 0) + 1

    def close(self):
        """Close the backend on the set it is open on (the next set opens it again)."""
        self.session.close()
        self._open_set = self._open_error = None

    def pytest_sessionfinish(self, session, exitstatus):
        self.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if not self.outputs:
            return
        result = self.run_result(exitstatus)
        writers = {"--conformance-json": lambda path: write_json(result, path,
                                                                 argv=["pytest", *self.config.invocation_params.args]),
                   "--conformance-html": lambda path: write_html(result, path)}
        for flag, path in self.outputs:
            try:
                self.written.append((flag, writers[flag](path)))
            except OSError as exc:
                self.unwritten.append((flag, f"{type(exc).__name__}: {exc}"))
                if session.exitstatus == pytest.ExitCode.OK:
                    session.exitstatus = pytest.ExitCode.USAGE_ERROR

    def run_result(self, exitstatus=None) -> RunResult:
        """The run as ``conformance check`` records it (``RunResult``): the cases that ran, the sets they
        came from, the profile, the backend, the expectations and the timing."""
        infos = []
        for anchor, fs in self.loaded.items():
            if not self.selected.get(anchor):
                continue  # collected, but every case deselected (-k): no part of this run
            info = Selection([fs]).infos()[0]
            info.cases_selected = self.selected[anchor]
            info.warnings = [str(w) for w in getattr(fs, "warnings", [])]
            infos.append(info)
        interrupted = None
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            case = self.session.in_flight
            not_run = max(sum(self.selected.values()) - len(self.results), 0)
            interrupted = {"reason": "SIGINT", "case": case, "cases_not_run": not_run,
                           "message": "interrupted by SIGINT" + (
                               f" while case {case} was running (it is not reported)" if case else "")}
        keyword = self.config.getoption("keyword", default="") or ""
        return RunResult(
            backend={"name": getattr(self.backend, "name", type(self.backend).__name__),
                     "capabilities": self.session.claimed, "options": dict(self.options)},
            profile=self.profile, sets=infos, cases=list(self.results), expectations=self.expectations.report(),
            select=f"-k {keyword.strip()!r}" if keyword.strip() else None,
            started=self._started, finished=_dt.datetime.now(_dt.timezone.utc),
            duration=time.perf_counter() - self._t0, interrupted=interrupted,
        )

    def pytest_report_header(self, config):
        return (f"conformance: backend {self.backend.name!r} ({self.spec}), profile {self.profile.name}"
                + (f", expectations {self.expectations.path}" if self.expectations.path else ""))

    def pytest_terminal_summary(self, terminalreporter):
        if self.counts:
            counts = ", ".join(f"{n} {s}" for s, n in sorted(self.counts.items()))
            terminalreporter.write_line(f"conformance ({self.backend.name}, {self.profile.name}): {counts}")
        for e in self.expectations.expired:
            terminalreporter.write_line(f"conformance: expectations entry {e.index} ({e.match!r}) expired on "
                                        f"{e.expires.isoformat()} and no longer applies")
        for e in self.expectations.unused:
            terminalreporter.write_line(f"conformance: expectations entry {e.index} ({e.match!r}) matches no case")
        for flag, path in self.written:
            what = "JSON report" if flag == "--conformance-json" else "HTML report"
            terminalreporter.write_line(f"conformance: {what} written to {path}")
        for flag, error in self.unwritten:
            terminalreporter.write_line(f"conformance: {flag}: cannot write the report: {error}",
                                        red=True)


class ConformanceFailure(Exception):
    """A case that did not pass; its message is the report (no traceback)."""


class ConformanceSet(pytest.File):
    """The cases of one fixture set, under the set's manifest (``path``; the set's .tar for an archive)."""

    def __init__(self, *, conformance: ConformanceSession, set_path: Path, **kwargs):
        super().__init__(**kwargs)
        self.conformance = conformance
        self.set_path = set_path

    def collect(self):
        fs = load_set(self.set_path)
        self.conformance.loaded[self.path] = fs
        return [ConformanceCase.from_parent(self, name=case.id, fixture_set=fs, case=case) for case in fs.cases]

    def repr_failure(self, excinfo):
        return f"fixture set {self.set_path}: {type(excinfo.value).__name__}: {excinfo.value}"


class ConformanceCase(pytest.Item):
    """One conformance case. Its ``-k`` keywords, besides its id: its feature tags, its kind, its entry point
    (``last:plain``, ``last:seq_id``, ``last:embeddings``) and its set's name, as ``conformance check -k``."""

    def __init__(self, *, fixture_set, case, **kwargs):
        super().__init__(**kwargs)
        self.fixture_set = fixture_set
        self.case = case
        keywords = {*getattr(case, "features", ()), case.kind, entry_point(case), _set_name(fixture_set)}
        self.extra_keyword_matches.update(k for k in keywords if k)

    def runtest(self):
        res = self.parent.conformance.run_case(self.fixture_set, self.case)
        self.user_properties.append(("status", res.status))
        if res.executed:
            self.user_properties.append(("executed", json.dumps(res.executed, sort_keys=True)))
        if res.status == "pass":
            return
        if res.status in ("not-claimed", "skipped"):
            pytest.skip(printable(f"{res.status}: {res.message}"))
        if res.status == "xfail":
            pytest.xfail(printable(res.message))
        # the verdict in one line, then what the console summary of `conformance check -v` shows of the case
        lines = [f"{res.status}" + (f" [{res.check}]" if res.check else "") + f": {res.message}", ""]
        details = failure_details(res, verbose=True)
        tb = ((res.error or {}).get("traceback") or "").rstrip().splitlines()
        if len(tb) > 4:  # instead of the last 4 lines of the traceback failure_details shows, all of it
            details = [line for line in details if not line.startswith("  | ")]
            details += ["  traceback:"] + ["  | " + line for line in tb]
        lines += details
        raise ConformanceFailure(printable("\n".join(lines)))  # backend text reaches pytest's terminal

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{printable(self.case.id)}: {excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"conformance {self.case.id}"
