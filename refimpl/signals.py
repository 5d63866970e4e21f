"""Stop signals as interrupts: ``with stop_signals():`` SIGTERM and SIGHUP raise ``Interrupted`` (a
KeyboardInterrupt) in the main thread, so a CI job's timeout ends a command as Ctrl-C does: finally blocks
run and temporary files go (a half-written 57 GiB checkpoint of ``refimpl synth`` among them).
Python's default SIGTERM ends the process without running them."""

from __future__ import annotations

import signal
import threading

__all__ = ["Interrupted", "interrupt_name", "interrupt_signal", "stop_signals"]


class Interrupted(KeyboardInterrupt):
    """A stop signal other than SIGINT (SIGTERM, SIGHUP) arrived: raised by the handler of ``stop_signals``.
    A subclass of KeyboardInterrupt, so every place that lets an interrupt through lets this through too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def interrupt_signal(exc: KeyboardInterrupt) -> int:
    """The signal number an interrupt stands for (SIGINT for a plain KeyboardInterrupt)."""
    return exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)


def interrupt_name(exc: KeyboardInterrupt) -> str:
    """The name of the signal an interrupt stands for: SIGINT, SIGTERM, SIGHUP."""
    return signal.Signals(interrupt_signal(exc)).name


class stop_signals:
    """``with stop_signals():`` SIGTERM and SIGHUP raise ``Interrupted`` in the main thread (SIGINT already
    raises KeyboardInterrupt). The previous handlers come back on exit. Outside the main thread it does
    nothing."""

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
