"""The quantisation loss on the same rows: a quantised set and the unquantised (reference) set of the same model,
with the same cases, compared row by row; with a backend, its rows against both.

Three comparisons, each row by row over the rows a case returns (``row_groups``):

* ``quantisation``: the quantised set's oracle against the reference set's oracle: what the quantisation itself
  costs, exactly (both float64), whatever any engine computes;
* ``engine-vs-reference``: the backend's rows (it runs the quantised set's cases, on the quantised checkpoint)
  against the reference oracle: the quantisation and the engine's arithmetic together, what a user sees;
* ``engine-vs-quantised``: the same rows against the quantised oracle: the engine's arithmetic alone, what
  ``conformance check`` grades.

Per row: KL(P_ref || P_got) over the whole vocabulary, whether the top-1 tokens agree, delta_p (the change of the
reference's top token's probability) and max_abs; per case and in total: the KL's mean, 99th percentile and
maximum, the share of rows with the same top-1 token, the RMS of delta_p and the largest max_abs
(``summarise``). Information, not a verdict, unless thresholds are given (``Thresholds``): then every comparison
against the reference must keep within them.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..check import metrics as M
from ..check.cases import asked
from ..check.guard import CallInfo
from ..check.requests import response_groups
from ..check.session import Checkpoints, Session, Work
from ..protocol.types import Backend
from ..sets.case import row_groups, shared_prefix

__all__ = ["COMPARISONS", "CaseLoss", "LossError", "LossRun", "Thresholds", "loss_run", "pair_cases", "row_losses",
           "summarise"]

QUANTISATION, ENGINE_REF, ENGINE_Q = "quantisation", "engine-vs-reference", "engine-vs-quantised"
COMPARISONS = (QUANTISATION, ENGINE_REF, ENGINE_Q)
AGAINST_REFERENCE = (QUANTISATION, ENGINE_REF)  # the comparisons thresholds apply to


class LossError(Exception):
    """The two sets cannot be compared (not the same cases or prompts): exit 2."""


@dataclass(frozen=True)
class Thresholds:
    """Limits on the totals of every comparison against the reference (None: no limit)."""

    max_kl: float | None = None  # the mean KL over every row
    max_kl_p99: float | None = None
    min_top1: float | None = None  # percent of rows whose top-1 token is the reference's
    max_dp_rms: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def breaches(self, total: dict[str, Any]) -> list[str]:
        """What ``total`` (a ``summarise`` result) exceeds, one phrase each."""
        out = []
        for key, limit, above in (("kl_mean", self.max_kl, True), ("kl_p99", self.max_kl_p99, True),
                                  ("top1_same_pct", self.min_top1, False), ("dp_rms", self.max_dp_rms, True)):
            value = total.get(key)
            if limit is None or value is None:
                continue
            if (value > limit) if above else (value < limit):
                out.append(f"{key} {value:.4g} {'>' if above else '<'} {limit:g}")
        return out


@dataclass
class CaseLoss:
    id: str  # the quantised set's case id
    kind: str
    rows: int
    loss: dict[str, dict[str, Any]] = field(default_factory=dict)  # comparison -> summarise(...)
    engine: str = "none"  # none (no backend) | ok | not-claimed | error
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "rows": self.rows, "engine": self.engine, "message": self.message,
                "loss": self.loss}


@dataclass
class LossRun:
    quantised: dict[str, Any]  # name, version, path, model record (scalars), activations
    reference: dict[str, Any]
    backend: str | None
    cases: list[CaseLoss]
    total: dict[str, dict[str, Any]]  # comparison -> summarise over every row of every compared case
    rows: dict[str, dict[str, np.ndarray]]  # comparison -> the per-row arrays (for the plot), not in the JSON
    thresholds: Thresholds
    breaches: dict[str, list[str]]  # comparison -> what it exceeds

    @property
    def exit_code(self) -> int:
        return 1 if any(self.breaches.values()) else 0


def row_losses(ref: np.ndarray, got: np.ndarray) -> dict[str, np.ndarray]:
    """Per row of ``[R, V]`` logits: kl (KL(softmax(ref) || softmax(got))), top1_same, delta_p, max_abs."""
    ref, got = M.as_f64(ref), M.as_f64(got)
    return {"kl": M.kl(ref, got), "top1_same": M.top1(ref) == M.top1(got), "delta_p": M.delta_p(ref, got),
            "max_abs": M.max_abs(got, ref)}


def summarise(rows: dict[str, np.ndarray]) -> dict[str, Any]:
    """The summary of ``row_losses`` rows (concatenated over cases for a total)."""
    kl, n = rows["kl"], int(len(rows["kl"]))
    if n == 0:
        return {"rows": 0, "kl_mean": None, "kl_p99": None, "kl_max": None, "top1_same_pct": None, "dp_rms": None,
                "max_abs": None}
    return {"rows": n, "kl_mean": float(np.mean(kl)), "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(np.max(kl)), "top1_same_pct": 100.0 * float(np.mean(rows["top1_same"])),
            "dp_rms": float(np.sqrt(np.mean(rows["delta_p"] ** 2))), "max_abs": float(np.max(rows["max_abs"]))}


def _key(case_id: str, set_name: str) -> str:
    return case_id[len(set_name) + 1:] if case_id.startswith(set_name + "/") else case_id


def pair_cases(quantised, reference) -> tuple[list[tuple[Any, Any]], dict[str, int]]:
    """(quantised case, reference case) for every case of ``quantised``, matched by id without the set's name, and
    for every base the length of the prefix its tokens share in the two sets: a row is comparable where the
    prompts agree up to it (a generation base continues each model's own greedy choice, so a quantised model's
    may part from the reference's). LossError when the reference lacks a case or no base shares a token."""
    ref = {_key(c.id, reference.name): c for c in reference.cases}
    missing = [c.id for c in quantised.cases if _key(c.id, quantised.name) not in ref]
    if missing:
        raise LossError(f"the reference set {reference.name} does not hold {len(missing)} of the "
                        f"{len(quantised.cases)} cases of {quantised.name} (first: {missing[0]}); generate both "
                        "sets with the same --cases and prompts")
    qb, rb = quantised.bases(), reference.bases()
    prefix = {name: shared_prefix(qb[name], rb[name]) for name in qb if name in rb}
    if qb and not any(prefix.values()):
        raise LossError(f"no base of {quantised.name} starts with the tokens of the reference set {reference.name}'s "
                        "base of the same name: not the same prompts")
    return [(c, ref[_key(c.id, quantised.name)]) for c in quantised.cases], prefix


def _specs(case) -> list:
    return [s for _, group in row_groups(case) for s in group]


def _oracle_rows(specs: list, base_logits) -> np.ndarray:
    """The oracle rows of ``specs`` (a case's RowSpecs), in order, from its set's base logits: ``[R, V]``."""
    return np.stack([np.asarray(base_logits[s.base][s.position], dtype=np.float64) for s in specs])


def _engine_rows(session: Session, ctx, case) -> tuple[str, str, np.ndarray | None]:
    """(status, message, the engine's rows ``[R, V]``): ok, not-claimed or error. A backend without decode is
    asked the prompt's rows only (``check.cases.asked``): its rows are then the case's first ones."""
    case, request, _, missing = asked(case, ctx, session.claimed)
    if missing and missing != ["decode"]:
        return "not-claimed", "needs " + ", ".join(missing) + " (not claimed by the backend)", None
    call = CallInfo.from_call(lambda: session.calls.run(request))
    if call.failed:
        return "error", f"the backend failed: {call.text()}", None
    groups = response_groups(case, call.value)
    expected = [len(g) for _, g in row_groups(case)]
    if any(a is None or np.ndim(a) != 2 or len(a) != n for a, n in zip(groups, expected, strict=True)):
        return "error", "the backend returned a different number of rows than the case asks", None
    return "ok", "", np.concatenate([np.asarray(a, dtype=np.float64) for a in groups])


def _case_loss(qcase, qctx, rctx, prefix: dict[str, int], session: Session | None,
               rows: dict[str, list]) -> CaseLoss:
    """The case's loss over its comparable rows (where the two sets' prompts agree up to the row)."""
    specs = _specs(qcase)
    keep = [i for i, s in enumerate(specs) if s.position < prefix.get(s.base, 0)]
    res = CaseLoss(qcase.id, qcase.kind, len(keep))
    if len(keep) < len(specs):
        res.message = (f"{len(specs) - len(keep)} of its {len(specs)} rows not compared: the quantised model's own "
                       "continuation parts from the reference's before them")
    found = {}
    if keep:
        kept = [specs[i] for i in keep]
        ref_rows, q_rows = _oracle_rows(kept, rctx.base_logits), _oracle_rows(kept, qctx.base_logits)
        found[QUANTISATION] = row_losses(ref_rows, q_rows)
    if session is not None:
        res.engine, why, got = _engine_rows(session, qctx, qcase)
        res.message = "; ".join(x for x in (why, res.message) if x)
        # the kept rows the engine returned (a case without its decode steps returns its first rows only)
        mine = [k for k, i in enumerate(keep) if got is not None and i < len(got)]
        if mine:
            got_rows = got[[keep[k] for k in mine]]
            found[ENGINE_REF] = row_losses(ref_rows[mine], got_rows)
            found[ENGINE_Q] = row_losses(q_rows[mine], got_rows)
    for name, r in found.items():
        res.loss[name] = summarise(r)
        rows.setdefault(name, []).append(r)
    return res


def _set_info(fs) -> dict[str, Any]:
    """The report's record of a set: name, version, path, its model record's scalars (the checkpoint's path for
    an external set, the preset and seed of a synthetic one) and activation convention."""
    model = {k: v for k, v in fs.model_record.items() if isinstance(v, (str, int, float, bool))}
    return {"name": fs.name, "version": fs.version, "path": str(fs.path), "model": model,
            "activations": fs.activations}


def loss_run(quantised, reference, backend: Backend | None = None, *, select: Callable[[Any], bool] | None = None,
             thresholds: Thresholds = Thresholds(), model: str | Path | None = None,
             progress: Callable[[int, int, str], None] | None = None) -> LossRun:
    """Compare the selected cases of the fixture set ``quantised`` (``select(case)``; MTP cases are left out:
    their rounds follow each model's own acceptances) with the same cases of ``reference``, and with
    ``backend``'s rows when given. FixtureError when a set's checkpoint or rows cannot be had, BackendError when
    the backend cannot be opened, LossError when the sets do not pair."""
    paired, prefix = pair_cases(quantised, reference)
    pairs = [(q, r) for q, r in paired if q.kind != "mtp" and (select is None or select(q))]
    if not pairs:
        raise LossError(f"no case of {quantised.name} to compare (MTP cases are not compared)")
    rows: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="gemma4-conformance-loss-") as tmp:
        checkpoints = Checkpoints(tmp, model=model)
        session = None if backend is None else Session(backend, checkpoints)
        convention = "scaled" if backend is None else backend.capabilities.embedding_convention
        rctx = checkpoints.context(reference, convention)
        rctx.prepare([r for _, r in pairs])
        done: list[CaseLoss] = []

        def one(qctx, qcase) -> CaseLoss:
            if progress is not None:
                progress(len(done), len(pairs), qcase.id)
            out = _case_loss(qcase, qctx, rctx, prefix, session, rows)
            done.append(out)
            return out

        if session is None:
            qctx = checkpoints.context(quantised, convention)
            qctx.prepare([q for q, _ in pairs])
            for q, _ in pairs:
                one(qctx, q)
        else:
            session.run([(quantised, [q for q, _ in pairs])], Work(case=one))
    joined = {name: {k: np.concatenate([r[k] for r in parts]) for k in parts[0]} for name, parts in rows.items()}
    total = {name: summarise(r) for name, r in joined.items()}
    breaches = {name: thresholds.breaches(total[name]) for name in AGAINST_REFERENCE if name in total}
    return LossRun(_set_info(quantised), _set_info(reference), None if backend is None else backend.name,
                   done, total, joined, thresholds, breaches)
