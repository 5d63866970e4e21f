"""Grading from top-k logprobs (conformance.check.topk; issue 60): a backend that answers its rows as the top k
log-probabilities a server's completions endpoint returns, instead of logits.

* The oracle's own rows turned into top-k logprobs pass every claimed case of a bundled set at exact-f64 (the
  bound is 2 x max_abs: a logprob is the logit minus the log-sum-exp, which moves by at most the largest logit
  difference), and the full-logit metrics are not applicable (None).
* The bound is tight where it should be: a logprob moved by just over 2 x max_abs fails (``logprob``), one moved
  by just under passes.
* A wrong row fails by the check that names it: a logprob off (``logprob``), the oracle's top-1 replaced by the
  next token (``top1``), the oracle's second token left out of the returned set (``topk``), a row too few
  (``count``), repeated or out-of-range ids (``shape``), positive or non-finite logprobs (``nonfinite``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.metrics import log_softmax
from conformance.check.profiles import get_profile
from conformance.check.runner import run
from conformance.check.topk import PAD, logprob_bound
from conformance.protocol.types import Capabilities, Request, Response, TopLogprobs
from conformance.sets.bundled import bundled_set
from conformance.sets.case import row_groups
from conformance.sets.integrity import load_set

EXACT = get_profile("exact-f64")
K = 5
SELECT = r"^e2b-mini/(last/plain/A/T9/pos(8|4)|full/A/T9|prefill/A/T19/rows-middle/ub5|multi/A-T3\+B-T8\+C-T13)$"


def top_k(rows: np.ndarray, k: int = K) -> TopLogprobs:
    lp = np.stack([log_softmax(r) for r in np.asarray(rows, dtype=np.float64)])
    ids = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return TopLogprobs(ids, np.take_along_axis(lp, ids, axis=-1))


class TopKOracle(RefimplBackend):
    """The oracle answering top-k logprobs, with one fault planted by ``how``."""

    def __init__(self, how: str = "", by: float = 0.0):
        super().__init__()
        self.how, self.by = how, by
        self.capabilities = Capabilities(**{**self.capabilities.to_dict(), "top_logprobs": True, "hidden_states": False,
                                            "traces": False})

    def run(self, request: Request) -> Response:
        r = super().run(request)
        t = top_k(r.logits)
        if self.how == "shift":
            t.logprobs[0, 1] += self.by
        elif self.how == "top1":  # the oracle's top-1 and its second token swap places
            t.ids[0, [0, 1]] = t.ids[0, [1, 0]]
        elif self.how == "missing":  # the second token left out: the 6th in its place
            lp = log_softmax(r.logits[0])
            sixth = int(np.argsort(-lp, kind="stable")[K])
            t.ids[0, 1], t.logprobs[0, 1] = sixth, lp[sixth]
        elif self.how == "short":
            t = TopLogprobs(t.ids[:-1], t.logprobs[:-1])
        elif self.how == "repeat":
            t.ids[0, 1] = t.ids[0, 0]
        elif self.how == "positive":
            t.logprobs[0, 0] = 0.5
        elif self.how == "padded":  # the row's least likely entry left out, padded
            t.ids[0, -1], t.logprobs[0, -1] = PAD, -np.inf
        elif self.how in ("unnamed", "withheld"):  # the oracle's top-1 not named (a text shared by several ids)
            top1 = int(t.ids[0, 0])
            t.ids[0, 0], t.logprobs[0, 0] = PAD, -np.inf
            if self.how == "unnamed":  # ... and said to be unnamed
                t.unnamed = [[top1]] + [[] for _ in range(len(t.ids) - 1)]
        dl = r.decode_logits
        decode = None if dl is None else ([top_k(d) for d in dl] if isinstance(dl, list) else top_k(dl))
        return Response(None, None, r.executed, logprobs=t, decode_logprobs=decode)


def test_the_oracles_top_k_passes_at_exact_f64():
    result = run(TopKOracle(), [bundled_set("e2b-mini")], EXACT, select=SELECT)
    assert len(result.cases) == 5 and result.exit_code == 0, [c.message for c in result.cases if c.status != "pass"]
    rows = [r for c in result.cases for r in c.rows]
    fs = load_set(bundled_set("e2b-mini"))
    asked = [c for c in fs.cases if c.id in {r.id for r in result.cases}]
    assert len(rows) == sum(len(specs) for c in asked for _, specs in row_groups(c))  # every row, decode rows too
    assert {r.kind for r in result.cases} == {"last", "full", "prefill", "multi"}
    assert all(r["metrics"]["max_abs"] is None and r["metrics"]["logprob_max_abs"] < 1e-12 for r in rows)
    assert all(0.0 <= r["metrics"]["mass_outside"] < 1.0 and r["metrics"]["topk_overlap"] == 1.0 for r in rows)


@pytest.mark.parametrize("factor, status", [(1.01, "fail"), (0.99, "pass")])
def test_the_bound_is_two_max_abs(factor, status):
    result = run(TopKOracle("shift", factor * logprob_bound(EXACT)), [bundled_set("e2b-mini")], EXACT,
                 select=r"^e2b-mini/last/plain/A/T9/pos8$")
    (case,) = result.cases
    assert case.status == status and logprob_bound(EXACT) == 2 * EXACT.max_abs
    if status == "fail":
        assert case.check == "logprob" and "(2 x max_abs)" in case.message


def test_top1_on_a_decided_row():
    """The oracle's top two ids swapped, their values kept: within a bound wide enough for the values, the most
    likely returned token is not the oracle's top-1 on a decided row (any margin above tie_margin 0 here)."""
    wide = dataclasses.replace(EXACT, max_abs=100.0, tie_margin=0.0)
    (case,) = run(TopKOracle("top1"), [bundled_set("e2b-mini")], wide, select=r"^e2b-mini/last/plain/A/T9/pos8$").cases
    assert (case.status, case.check) == ("fail", "top1") and "the most likely returned token is" in case.message
    (case,) = run(TopKOracle("top1"), [bundled_set("e2b-mini")], EXACT, select=r"^e2b-mini/last/plain/A/T9/pos8$").cases
    assert case.check == "logprob"  # at exact-f64 the swapped values fail first


@pytest.mark.parametrize("how, check, says", [
    ("shift", "logprob", "row 8: logprob "),
    ("missing", "topk", "is missing from the returned top 5"),
    ("short", "count", "logits: 0 top-k rows returned, the request defines 1"),
    ("repeat", "shape", "the returned ids repeat"),
    ("positive", "nonfinite", "must be finite and <= 0"),
])
def test_a_wrong_row_fails_by_its_check(how, check, says):
    result = run(TopKOracle(how, 1.0), [bundled_set("e2b-mini")], EXACT, select=r"^e2b-mini/last/plain/A/T9/pos8$")
    (case,) = result.cases
    assert (case.status, case.check) == ("fail", check), case.message
    assert says in case.message


@pytest.mark.parametrize("how, status", [("padded", "pass"), ("unnamed", "pass"), ("withheld", "fail")])
def test_padding_and_unnamed_ids(how, status):
    """A row returned with fewer than k entries (padded with -1) is graded on what it names; the oracle's top-1
    left out of a row passes only where the answer says it cannot name it (TopLogprobs.unnamed: a server keying its
    logprobs by a text several ids share), and fails where it is simply missing."""
    (case,) = run(TopKOracle(how), [bundled_set("e2b-mini")], EXACT, select=r"^e2b-mini/last/plain/A/T9/pos8$").cases
    assert case.status == status, case.message
    if status == "fail":
        assert case.check in ("top1", "topk"), case.message
