"""How a run calls its backend: directly, or on a supervised thread that enforces the case timeout
(``--case-timeout``). ``Session`` makes one ``Calls`` per backend; every call of the backend (open, run,
close) goes through it."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Callable

from ..protocol.types import Backend, CaseTimeout


class Supervisor:
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


class Calls:
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
                self.supervisor = Supervisor()

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

    def refuses(self, request) -> str | None:
        """The backend's reason it cannot be asked ``request`` exactly (its optional ``refuses``), or None."""
        refuses = getattr(self.backend, "refuses", None)
        return self._call(lambda: refuses(request), self.timeout) if callable(refuses) else None

    def prefetch(self, requests: list, concurrency: int) -> None:
        """Hand the backend a set's requests ahead (its ``prefetch``: a server backend sends them ``concurrency``
        at a time); ``run`` then takes each answer."""
        self._call(lambda: self.backend.prefetch(requests, concurrency), self.timeout)

    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        return fn() if self.supervisor is None else self.supervisor.call(fn, timeout)
