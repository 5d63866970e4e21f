"""The hidden-state output (capability ``hidden_states``): the final-norm hidden state of every returned row.

* The refimpl backend's hidden rows equal the final norm of an independent full forward's residual rows
  (``tests/naive_gemma4``), on every request kind, within float64 rounding.
* The gate grades them: a backend that returns them shifted by a row fails ``hidden_identity``, one that
  claims them and returns none fails ``hidden``, one that does not claim them is never asked.
* The subprocess protocol carries them (the reference server and the client), decode and multi included.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import read_config, read_weights
from naive_gemma4 import naive_forward

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.profiles import get_profile
from conformance.check.runner import run
from conformance.protocol.types import Capabilities, Piece, Request, Response
from conformance.sets.bundled import bundled_set
from refimpl.synth import write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint("e2b-mini", 0, tmp_path_factory.mktemp("h") / "m")


@pytest.fixture(scope="module")
def backend(model_dir):
    b = RefimplBackend()
    b.open(model_dir)
    yield b
    b.close()


def naive_hidden(model_dir, ids):
    """Final-normed hidden rows [T, H] of every position, from the naive forward (tests/naive_gemma4)."""
    return naive_forward(read_config(model_dir), read_weights(model_dir), list(ids), hidden=True)


def test_hidden_rows_match_an_independent_forward(backend, model_dir):
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 500, 14)]
    ref = naive_hidden(model_dir, ids + [7, 9])
    requests = [
        Request(kind="full", tokens=tuple(ids), decode=(7, 9), hidden=True),
        Request(kind="last", tokens=tuple(ids), last_pos=5, hidden=True),
        Request(kind="prefill", pieces=(Piece(tuple(ids[:6]), (2,)), Piece(tuple(ids[6:]), (0, 7))), ubatch=3,
                decode=(7, 9), hidden=True),
    ]
    want = [ref[:16], ref[[5]], ref[[2, 6, 13, 14, 15]]]
    for request, expected in zip(requests, want, strict=True):
        r = backend.run(request)
        got = np.concatenate([r.hidden] + ([r.decode_hidden] if r.decode_hidden is not None else []))
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= 1e-12 * np.abs(expected).max()
    multi = backend.run(Request(kind="multi", sequences=(tuple(ids[:4]), tuple(ids)), seq_ids=(3, 1),
                                decode=((7,), (7, 9)), hidden=True))
    assert np.abs(multi.hidden[1] - ref[13]).max() <= 1e-12 * np.abs(ref).max()
    assert [d.shape[0] for d in multi.decode_hidden] == [1, 2]
    assert np.abs(multi.decode_hidden[1] - ref[14:16]).max() <= 1e-12 * np.abs(ref).max()


def test_not_asked_not_returned(backend):
    r = backend.run(Request(kind="last", tokens=(3, 4, 5), last_pos=2))
    assert r.hidden is None and r.decode_hidden is None


class _Tampered(RefimplBackend):
    """The oracle with its hidden rows altered after the fact (``how``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def run(self, request: Request) -> Response:
        r = super().run(request)
        if self.how == "shift" and r.hidden is not None and len(r.hidden) > 1:
            r.hidden = np.roll(r.hidden, 1, axis=0)
        if self.how == "drop":
            r.hidden = None
        return r


class _Unclaimed(RefimplBackend):
    def __init__(self):
        super().__init__()
        self.capabilities = Capabilities(**{**self.capabilities.to_dict(), "hidden_states": False})

    def run(self, request: Request) -> Response:
        assert not request.hidden  # never asked
        return super().run(request)


def test_the_gate_grades_hidden_rows():
    sets = [bundled_set("e2b-mini")]
    shifted = run(_Tampered("shift"), sets, get_profile("exact-f64"), select=r"/full/")
    assert shifted.exit_code == 1
    assert {c.check for c in shifted.cases} == {"hidden_identity"}
    dropped = run(_Tampered("drop"), sets, get_profile("exact-f64"), select=r"/last/plain/A/T7/pos3$")
    assert [c.check for c in dropped.cases] == ["hidden"]
    assert "no hidden rows returned for group 'logits'" in dropped.cases[0].message
    unclaimed = run(_Unclaimed(), sets, get_profile("exact-f64"), select=r"/last/")
    assert unclaimed.exit_code == 0
    assert not any(r["label"].endswith(" hidden") for c in unclaimed.cases for r in c.rows)


def test_subprocess_protocol_carries_hidden_rows(model_dir, backend):
    import sys

    from conformance.backends.subprocess.client import SubprocessBackend

    engine = SubprocessBackend(command=[sys.executable, "-m", "conformance.serve", "--backend", "refimpl"])
    engine.open(model_dir)
    try:
        ids = (3, 4, 5, 6, 7)
        for request in (Request(kind="prefill", pieces=(Piece(ids, (1, 4)),), decode=(8,), hidden=True),
                        Request(kind="multi", sequences=(ids, ids[:2]), decode=((8,), (9, 10)), hidden=True)):
            got, want = engine.run(request), backend.run(request)  # float64 rows of two processes: rounding apart
            dh_got = got.decode_hidden if isinstance(got.decode_hidden, list) else [got.decode_hidden]
            dh_want = want.decode_hidden if isinstance(want.decode_hidden, list) else [want.decode_hidden]
            assert len(dh_got) == len(dh_want)
            for a, b in zip([got.hidden, *dh_got], [want.hidden, *dh_want], strict=True):
                assert a.dtype == np.float64 and a.shape == b.shape
                assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max()
    finally:
        engine.close()
