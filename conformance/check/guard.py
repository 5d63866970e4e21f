"""The one guard around every call the harness makes that may fail without stopping the run: a backend's
(its ``open``, ``run``, ``close``) and the harness's own steps on a case (building the request, scaling the
profile, grading the response). Modelled on pytest's ``CallInfo.from_call``: the call's value or the
exception it raised, and its wall time; the caller decides what a failure means. An interrupt
(KeyboardInterrupt and its subclass ``Interrupted``) is never captured: it stops the run, not the case.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class CallInfo:
    """The outcome of one guarded call: ``value`` when it returned, ``excinfo`` when it raised (any
    exception, ``SystemExit`` included), and its ``duration`` in seconds."""

    value: Any
    excinfo: BaseException | None
    duration: float

    @classmethod
    def from_call(cls, fn: Callable[[], Any]) -> CallInfo:
        """Call ``fn()`` and record what happened; KeyboardInterrupt passes through."""
        t = time.perf_counter()
        try:
            value = fn()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded for the caller, who decides what it means
            return cls(None, exc, time.perf_counter() - t)
        return cls(value, None, time.perf_counter() - t)

    @property
    def failed(self) -> bool:
        return self.excinfo is not None

    def text(self) -> str:
        """``Type: message`` of the exception (empty when the call returned)."""
        return "" if self.excinfo is None else f"{type(self.excinfo).__name__}: {self.excinfo}"


def error_info(exc: BaseException) -> dict[str, str]:
    """The error record of a case: the exception's type and message, and the last frames of its traceback
    without the exception's text again (the message holds it: an engine error is shown once)."""
    short = "".join(traceback.format_tb(exc.__traceback__)[-5:])
    if len(short) > 4000:
        short = "..." + short[-4000:]
    return {"type": type(exc).__name__, "message": str(exc), "traceback": short}
