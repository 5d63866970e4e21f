"""One case on an opened backend: ``run_case`` builds its request, calls the backend and grades the answer
(``CaseResult``), and ``diagnose`` names what a set's failed cases have in common. Every step that may fail
runs under the one guard (``guard.CallInfo``): a failure is the case's ``error`` with the check that says
whose it is (``harness``, ``timeout``, ``response``, or none for the backend's own exception), never the run's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..protocol.types import Backend, CaseTimeout, Response, claims, required_capabilities
from ..protocol.wire import jsonable
from ..sets.case import row_groups
from .diagnosis import diagnose_set
from .grading import grade_case
from .guard import CallInfo, error_info
from .hidden import grade_hidden, hidden_groups
from .mtp import grade_mtp
from .policy import Policy
from .requests import build_request, response_groups, topk_groups, without_decode
from .results import CaseResult, _finite, entry_point
from .topk import grade_topk_case


def run_case(backend: Backend, claimed: dict, ctx, case, policy: Policy) -> CaseResult:
    """Run and grade one case on an opened backend (``claimed``: ``backend.capabilities.to_dict()``;
    ``ctx``: the set's ``SetContext``; ``policy``: the run's profile and expectations, ``policy.Policy``).

    Never raises for backend or grading problems: they become status ``error``. A case needing a capability
    the backend does not claim is ``not-claimed`` (a backend without decode has its prefill rows graded);
    an expectations ``skip`` is ``skipped``; a ``known-failure`` entry turns fail/error into ``xfail`` and
    pass into ``xpass``, except for a request the harness could not build (its own bug is never masked).
    """
    res = CaseResult(
        id=case.id, set=ctx.name, kind=case.kind, entry=entry_point(case), features=list(case.features),
        status="pass", moe_min_margin=case.moe_min_margin, ties=[[str(a), float(b)] for a, b in case.ties],
    )
    decision = policy.decide(case.id)
    res.expectation = decision.to_json()
    built = CallInfo.from_call(lambda: _claimed_request(res, case, ctx, claimed, backend))
    if built.failed:
        return _harness_error(res, "build the request", built.excinfo)
    if res.status == "not-claimed":
        return res
    case, request = built.value
    if decision.skip is not None:
        res.status = "skipped"
        res.message = f"skipped by expectations entry {decision.skip.index}: {decision.skip.reason}"
        return res
    return _apply_known_failure(_answered(res, backend, ctx, case, request, policy, decision), decision)


def asked(case, ctx, claimed: dict) -> tuple[Any, Any, list[str], list[str]]:
    """(the case as a backend that claims ``claimed`` is asked it, its request, the capabilities it needs, those
    not claimed). A case whose only missing capability is decode loses its decode steps: a backend without
    decode still has its prefill rows graded, the decode steps reported as not claimed (``missing`` says decode)
    rather than the whole case dropped."""
    request = build_request(case, ctx.bases, ctx.embed, ctx.media, ctx.drafter)
    needs = required_capabilities(request) + ctx.weight_needs
    missing = [n for n in needs if not claims(claimed, n)]
    if missing == ["decode"]:
        case = without_decode(case)
        request = build_request(case, ctx.bases, ctx.embed, ctx.media, ctx.drafter)
    return case, request, needs, missing


def claimed_requests(calls, claimed: dict, ctx, cases: list) -> list:
    """The requests of ``cases`` the backend claims and does not refuse, as ``run_case`` asks them (``--concurrency``
    hands them to the backend's ``prefetch``)."""
    out = []
    for case in cases:
        res = CaseResult(id=case.id, set=ctx.name, kind=case.kind, entry="", features=[], status="pass")
        built = CallInfo.from_call(lambda c=case, r=res: _claimed_request(r, c, ctx, claimed, calls))
        if not built.failed and res.status != "not-claimed":
            out.append(built.value[1])
    return out


def _claimed_request(res: CaseResult, case, ctx, claimed: dict, backend: Backend | None = None):
    """(case, request) as the backend is asked it (``asked``): ``res.needs`` and ``res.missing`` filled in;
    ``res`` marked ``not-claimed`` when it needs more than the backend claims, or when the backend's optional
    ``refuses(request)`` gives a reason it cannot be asked this request exactly (a server that takes text prompts
    only, for a prompt whose text does not come back as its ids)."""
    case, request, res.needs, res.missing = asked(case, ctx, claimed)
    if res.missing and res.missing != ["decode"]:
        res.status = "not-claimed"
        res.message = "needs " + ", ".join(res.missing) + " (not claimed by the backend)"
        return case, request
    refuses = getattr(backend, "refuses", None)
    reason = refuses(request) if callable(refuses) else None  # a Calls, or a backend that has its own
    if reason:
        res.status, res.message = "not-claimed", f"refused by the backend: {reason}"
        return case, request
    if claimed.get("hidden_states", False):
        request = dataclasses.replace(request, hidden=True)  # the final-norm hidden state of every returned row
    return case, request


def _response(backend: Backend, request) -> Response:
    response = backend.run(request)
    if not isinstance(response, Response):
        raise TypeError(f"backend.run returned {type(response).__name__}, not conformance.protocol.Response")
    return response


def _answered(res: CaseResult, backend: Backend, ctx, case, request, policy: Policy, decision) -> CaseResult:
    """``res`` once the backend answered ``request`` and the answer was graded with the policy's profile as it
    applies to this case (``Policy.profile_for``: scaled to the set, the tolerance overrides on top)."""
    call = CallInfo.from_call(lambda: _response(backend, request))
    res.duration = call.duration
    if call.failed:  # any failure (SystemExit too) is this case's error; the run goes on
        res.status, res.check = "error", ("timeout" if isinstance(call.excinfo, CaseTimeout) else None)
        res.message = call.text()
        res.error = error_info(call.excinfo)
        return res
    response = call.value
    executed = response.executed if response.executed is not None else {}
    if not isinstance(executed, dict):
        res.status, res.check = "error", "response"
        res.message = (f"the response could not be graded: Response.executed must be a dict, got "
                       f"{type(executed).__name__}")
        return res
    res.executed = jsonable(executed)
    prof = CallInfo.from_call(lambda: policy.profile_for(ctx, case, decision))
    if prof.failed:
        return _harness_error(res, "scale the profile to this set", prof.excinfo)
    graded = CallInfo.from_call(lambda: _graded(case, response, ctx, prof.value))
    if graded.failed:  # a malformed response the grader cannot read
        return _ungradable(res, "the response", graded.excinfo)
    grade, groups = graded.value
    res.status, res.check, res.message = grade.status, grade.check, grade.message
    if case.kind == "mtp":
        failure = grade_mtp(case, response, prof.value)
        if failure is not None:
            _fold(res, failure[0], failure[1], failure[1])
    hidden_rows = []
    hidden_of = hidden_groups(case, groups, response) if request.hidden else None
    if hidden_of is not None and all(r.base in ctx.base_hidden for _, rows in hidden_of[0] for r in rows):
        hidden = CallInfo.from_call(lambda: grade_hidden(*hidden_of, ctx.base_hidden, prof.value))
        if hidden.failed:  # malformed hidden rows the grader cannot read
            return _ungradable(res, "the response's hidden rows", hidden.excinfo)
        hidden_rows = hidden.value
        bad = [r for r in hidden_rows if r.status == "fail"]
        if bad:
            more = f" (+{len(bad) - 1} more hidden rows fail)" if len(bad) > 1 else ""
            _fold(res, bad[0].check, bad[0].message + more,
                  f"{len(bad)} hidden row{'s' if len(bad) > 1 else ''} fail too ({bad[0].message})")
    if res.missing:
        res.message = (res.message + "; " if res.message else "") + ("decode not claimed: only the prefill rows were "
                                                                     "graded")
    res.rows = [_row_json(r, ctx.pieces) for r in grade.rows + hidden_rows]
    res.summary = {k: _finite(v) for k, v in (grade.summary or {}).items()}
    res.first_divergence = None if grade.first_divergence is None else int(grade.first_divergence)
    return res


def _graded(case, response: Response, ctx, prof):
    """(the grade of the response's logits rows, or of its top-k logprobs rows, and the case's row groups)."""
    groups = row_groups(case)
    if response.logprobs is not None:  # a server's top-k logprobs (conformance.check.topk)
        return grade_topk_case(case, groups, topk_groups(case, response), ctx.base_logits, prof), groups
    return grade_case(case, groups, response_groups(case, response), ctx.base_logits, prof), groups


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


def _harness_error(res: CaseResult, doing: str, exc: BaseException) -> CaseResult:
    """``res`` as the case's error when the harness itself failed to ``doing`` (check ``harness``)."""
    return _errored(res, "harness", f"the harness could not {doing}", exc)


def _ungradable(res: CaseResult, what: str, exc: BaseException) -> CaseResult:
    """``res`` as the error of a response whose ``what`` ("the response") the grader cannot read."""
    return _errored(res, "response", f"{what} could not be graded", exc)


def _errored(res: CaseResult, check: str, saying: str, exc: BaseException) -> CaseResult:
    res.status, res.check = "error", check
    res.message = f"{saying}: {type(exc).__name__}: {exc}"
    res.error = error_info(exc)
    return res


def _fold(res: CaseResult, check: str, message: str, also: str) -> None:
    """A failure found after the rows were graded (an MTP answer, hidden rows): the case's failure when it
    passed so far, else ``also`` noted in its message."""
    if res.status == "pass":
        res.status, res.check, res.message = "fail", check, message
    else:
        res.message += f"; {also}"


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


def diagnose(ctx, results: list[CaseResult]) -> None:
    """The diagnosis line of every failed case of one set (``conformance.check.diagnosis``), made over the
    set's results together: the cross-case patterns (only the multi-sequence cases fail, only the chunked
    ones, ...) need the whole set. A diagnosis that cannot be made (a checkpoint whose config cannot be read
    again) leaves the results as they are."""
    try:
        cfg = ctx.text_config
        diagnose_set(results, softcap=cfg.final_logit_softcapping,
                     kv_shared=cfg.first_shared_layer < cfg.num_hidden_layers, unified=cfg.family == "gemma4_unified")
    except Exception:  # noqa: BLE001 - a diagnosis is advice; it never costs the verdict
        pass
