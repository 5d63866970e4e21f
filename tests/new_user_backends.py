"""Backends a new engine author might write, each with one of the defects a new user hits first, for
tests/gate/cli/test_new_user.py: degenerate outputs (zeros, a constant, one row repeated, one canned response for every
case), a backend that ends the process (os._exit, SIGKILL), one that fails at start."""

from __future__ import annotations

import os
import signal

import numpy as np

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.protocol.types import BackendError


class Zeros(RefimplBackend):
    """Returns all-zero logits of the right shape (an output buffer never filled)."""
    name = "zeros"

    def run(self, request):
        resp = super().run(request)
        resp.logits = np.zeros_like(np.asarray(resp.logits))
        return resp


class Constant(RefimplBackend):
    """Every logit one value."""
    name = "constant"

    def run(self, request):
        resp = super().run(request)
        resp.logits = np.full_like(np.asarray(resp.logits), -2.5)
        return resp


class RepeatedRow(RefimplBackend):
    """The last row written to every output row."""
    name = "repeated-row"

    def run(self, request):
        resp = super().run(request)
        logits = np.asarray(resp.logits)
        resp.logits = np.repeat(logits[-1:], len(logits), axis=0)
        return resp


class Canned(RefimplBackend):
    """The first response's first row, for every row of every case (a cached response)."""
    name = "canned"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.row = None

    def run(self, request):
        resp = super().run(request)
        logits = np.asarray(resp.logits)
        if self.row is None:
            self.row = logits[:1].copy()
        resp.logits = np.repeat(self.row, len(logits), axis=0)
        return resp


class ExitsThree(RefimplBackend):
    """Calls os._exit(3) in its first run (3 is the gate's own 'fixture integrity')."""
    name = "exits-three"

    def run(self, request):
        os._exit(3)


class Killed(RefimplBackend):
    """Kills its own process (SIGKILL: nothing in the process can report it)."""
    name = "killed"

    def run(self, request):
        os.kill(os.getpid(), signal.SIGKILL)


class FailsAtStart(RefimplBackend):
    """Cannot be constructed: a subprocess engine that is not there, say."""
    name = "fails-at-start"

    def __init__(self, **kw):
        raise BackendError("subprocess backend: cannot start './my-engine': No such file or directory")


class FailsToOpen(RefimplBackend):
    """Loads, then cannot open the set's checkpoint."""
    name = "fails-to-open"

    def open(self, model_dir):
        raise RuntimeError("unsupported architecture Gemma4ForConditionalGeneration")
