"""pytest plugin: run the conformance cases as pytest items.

    pytest --conformance-backend refimpl
    pytest --conformance-backend mypkg.engine:MyBackend --conformance-fixtures sets/ \\
           --conformance-profile q8 --conformance-expectations expectations.json -k "last/"
    pytest --conformance-backend refimpl --conformance-fixtures my-set/ --conformance-model /data/ckpt

The plugin is registered through the ``pytest11`` entry point, so it is loaded in every pytest run
once the package is installed; without ``--conformance-backend`` it only adds its options and does
nothing else (the harness modules are imported lazily, only when the option is given).

With the option, one item is collected per case of the fixture sets (the bundled sets unless
``--conformance-fixtures`` is given), named by the case id, under one collector per set. Each item
runs its case through the harness runner: ``pass`` passes; ``fail``, ``error`` and ``xpass`` fail
with the grading message; ``not-claimed`` and expectations ``skip`` are skipped; a known failure
that fails is an xfail. The backend is opened once per set (on the set's model), when the set's
first item runs, and closed when the next set starts or the session ends. ``--conformance-only``
deselects every other test of the session.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from .check import expectations
from .check.profiles import PROFILES
from .check.runner import run_case
from .check.session import Checkpoints, Session
from .protocol.types import BackendError
from .registry import load_backend, parse_option
from .report import printable
from .sets import load_set, set_paths

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


def _set_dirs(args: list[str] | None) -> list[Path]:
    """Fixture-set directories: the bundled sets, or each argument (a directory of sets expands to them)."""
    try:
        return set_paths(args, "--conformance-fixtures")
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


class ConformanceSession:
    """Per-session state: the backend, the profile, the expectations, and the set now open."""

    def __init__(self, config):
        self.config = config
        self.spec = config.getoption("--conformance-backend")
        self.options = _parse_options(config.getoption("--conformance-backend-option"))
        try:
            self.backend = load_backend(self.spec, **self.options)
        except BackendError as exc:
            raise pytest.UsageError(f"--conformance-backend: {exc}") from None
        self.profile = self._profile(config.getoption("--conformance-profile"))
        path = config.getoption("--conformance-expectations")
        if path is None and not config.getoption("--conformance-no-shipped-expectations"):
            path = getattr(self.backend, "expectations_file", None)  # as conformance check does
        self.expectations = self._expectations(path)
        self.only = config.getoption("--conformance-only")
        self.fixture_args = config.getoption("--conformance-fixtures")
        self.model = config.getoption("--conformance-model")
        if self.model is not None and not Path(self.model).is_dir():
            raise pytest.UsageError(f"--conformance-model: no such directory: {self.model}")
        self.rehash = config.getoption("--conformance-rehash")
        self.claimed = self.backend.capabilities.to_dict()
        self.counts: dict[str, int] = {}
        self._open_set = None  # the FixtureSet the backend is open on
        self._ctx = None
        self._open_error: str | None = None
        self._session: Session | None = None
        self._tmp: str | None = None  # the working directory of the materialised checkpoints

    def _profile(self, name: str | None):
        if name is not None and name not in PROFILES:
            raise pytest.UsageError(f"--conformance-profile: unknown profile {name!r}; "
                                    f"choose one of {', '.join(PROFILES)}")
        if name is None:
            name = self.backend.capabilities.default_profile
            if name not in PROFILES:
                raise pytest.UsageError(f"backend {self.backend.name!r} declares default_profile {name!r}, which "
                                        f"is not a known profile ({', '.join(PROFILES)}); pass --conformance-profile")
        return PROFILES[name]

    @staticmethod
    def _expectations(path: str | None):
        if path is None:
            return expectations.empty()
        try:
            return expectations.load(path)
        except expectations.ExpectationsError as exc:
            raise pytest.UsageError(f"--conformance-expectations: {exc}") from None

    # -- collection -----------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)  # before -k / -m deselection
    def pytest_collection_modifyitems(self, session, config, items):
        ours, names = [], set()
        for path in _set_dirs(self.fixture_args):
            name, n = path.name, 1
            while name in names:  # two sets in directories of the same name
                n += 1
                name = f"{path.name}-{n}"
            names.add(name)
            node = ConformanceSet.from_parent(session, path=path, name=name, nodeid=f"conformance/{name}",
                                              conformance=self)
            ours.extend(session.genitems(node))
        self.expectations.observe(item.case.id for item in ours)
        if self.only:
            if items:
                config.hook.pytest_deselected(items=list(items))
            items[:] = ours
        else:
            items.extend(ours)

    # -- running --------------------------------------------------------------------------------

    def context(self, fs):
        """Open the backend on ``fs`` (closing the previous set first); the set's context."""
        if self._open_set is fs:
            if self._open_error is not None:
                raise ConformanceFailure(self._open_error)
            return self._ctx
        self.close()
        self._open_set = fs
        if self._session is None:
            self._tmp = tempfile.mkdtemp(prefix="gemma4-conformance-")
            self._session = Session(self.backend, Checkpoints(self._tmp, model=self.model, rehash=self.rehash))
        try:
            self._ctx = self._session.enter(fs)
        except BackendError as exc:
            self._open_error = f"backend error: {exc}"
            raise ConformanceFailure(self._open_error) from None
        except Exception as exc:  # noqa: BLE001 - e.g. FixtureError while materialising the model
            msg = str(exc).replace("--model DIR", "--conformance-model DIR")  # this plugin's name of the flag
            self._open_error = f"cannot prepare the model of set {fs.path}: {type(exc).__name__}: {msg}"
            raise ConformanceFailure(self._open_error) from None
        return self._ctx

    def run_case(self, fs, case):
        result = run_case(self.backend, self.claimed, self.context(fs), case, self.profile, self.expectations)
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        return result

    def close(self):
        """Close the backend on the set it is open on (the next set opens it again)."""
        if self._session is not None:
            self._session.close()
        self._open_set = self._ctx = self._open_error = None

    def pytest_sessionfinish(self, session):
        self.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._session = self._tmp = None

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


class ConformanceFailure(Exception):
    """A case that did not pass; its message is the report (no traceback)."""


class ConformanceSet(pytest.Collector):
    """The cases of one fixture set."""

    def __init__(self, *, conformance: ConformanceSession, **kwargs):
        super().__init__(**kwargs)
        self.conformance = conformance

    def collect(self):
        fs = load_set(self.path)
        return [ConformanceCase.from_parent(self, name=case.id, fixture_set=fs, case=case) for case in fs.cases]

    def repr_failure(self, excinfo):
        return f"fixture set {self.path}: {type(excinfo.value).__name__}: {excinfo.value}"


class ConformanceCase(pytest.Item):
    """One conformance case."""

    def __init__(self, *, fixture_set, case, **kwargs):
        super().__init__(**kwargs)
        self.fixture_set = fixture_set
        self.case = case
        for feature in getattr(case, "features", ()):
            self.extra_keyword_matches.add(feature)

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
        lines = [f"{res.status}" + (f" [{res.check}]" if res.check else "") + f": {res.message}"]
        if res.executed:
            lines.append(f"executed: {json.dumps(res.executed, sort_keys=True)}")
        if res.error and res.error.get("traceback"):
            lines.append(res.error["traceback"].rstrip())
        raise ConformanceFailure(printable("\n".join(lines)))  # backend text reaches pytest's terminal

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{printable(self.case.id)}: {excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.fixture_set.path, None, f"conformance {self.case.id}"
