"""An in-process backend cannot end the run's process: ``refuse_process_exit`` turns a call of ``os._exit`` in
this process into ``BackendExit`` (a SystemExit, so the case that made it is an error and the run goes on),
where the status it asked for would otherwise become the run's exit status and read as one of the gate's own
(``os._exit(3)``: "fixture integrity"). A child the backend forked keeps the real ``os._exit``; a backend run
in a child process (``--isolate``, the subprocess protocol) is ended by the harness, not by itself."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["BackendExit", "refuse_process_exit"]


class BackendExit(SystemExit):
    """``os._exit(status)`` called in the harness's process by an in-process backend, and refused."""

    def __init__(self, status: object):
        super().__init__(f"the backend called os._exit({status!r}), which would have ended the whole run with its "
                         "status; refused (the case is an error; --isolate runs a backend in a child process)")
        self.status = status


@contextlib.contextmanager
def refuse_process_exit() -> Iterator[None]:
    """While the block runs, ``os._exit`` in this process raises BackendExit instead of ending it."""
    real, pid = os._exit, os.getpid()

    def refused(status):
        if os.getpid() != pid:  # a process the backend forked ends as it asks
            real(status)
        raise BackendExit(status)

    os._exit = refused
    try:
        yield
    finally:
        os._exit = real
