"""``conformance explain``: re-run cases with traces and find where the backend first leaves the oracle.

For each selected case the backend answers the case's request with ``trace=True`` (capability ``traces``),
the oracle (``RefimplBackend``, float64) answers the same request with its own trace, and
``conformance.check.traces.compare_traces`` lines the two up point by point and row by row: the prompt's
rows, then every decode step. The first point where a row's error passes the profile's floor (the case's
``nmse`` threshold, scaled as the check scales it) is the case's ``first_divergence``: layer, sub-block,
rows. A backend that serves no traces still gets the logits compared, and is told so.

A bug in a row the case does not return (an image row's soft token, its per-layer input) reaches the
returned rows only through attention, layers later. So explain also traces every row of the prompt: the
same pieces (micro-batches and media included) as a prefill whose output rows are all its rows, when the
backend claims what that needs. When that shows an earlier point, it is the first divergence, on those rows
("traced": "every prompt row"); a bug of the row selection itself (pruning) shows only in the case's own
request and stays there.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ..backends.refimpl_backend import RefimplBackend
from ..check.guard import CallInfo
from ..check.policy import case_profile
from ..check.requests import build_request, response_groups, trace_groups, without_decode
from ..check.session import Checkpoints, NoCasesSelected, Selection, Session, Work
from ..check.traces import TraceComparison, compare_traces, point_order
from ..protocol.types import Backend, Piece, Request, claims, required_capabilities
from ..sets.case import prompt_length, row_groups

__all__ = ["CaseExplanation", "ReportError", "explain", "failed_in_report", "row_roles"]

SCHEMA = "gemma4-conformance-explain/1"
FAILED = ("fail", "error", "xfail", "xpass")


class ReportError(Exception):
    """--from: the report cannot be read (exit 2)."""


@dataclass
class CaseExplanation:
    id: str
    set: str
    kind: str
    status: str  # diverges | within | error | not-claimed | skipped
    message: str
    comparison: TraceComparison | None = None  # the comparison that names the first divergence
    served: list[str] = field(default_factory=list)  # the trace points the backend returned
    returned: TraceComparison | None = None  # the case's own rows, when every prompt row diverges earlier

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        return None if self.comparison is None else self.comparison.first_divergence

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "set": self.set, "kind": self.kind, "status": self.status, "message": self.message,
                "first_divergence": self.first_divergence, "served_points": len(self.served),
                "comparison": None if self.comparison is None else self.comparison.to_json(),
                "returned_rows": None if self.returned is None else self.returned.to_json()}


def failed_in_report(path: str | Path) -> tuple[set[str], list[str]]:
    """The ids of the failed cases (fail, error, xfail, xpass) of a ``conformance check --json`` report, and
    the paths of its fixture sets. ReportError for a file that is not such a report."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"--from: cannot read the report {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise ReportError(f"--from: {path} is not a 'conformance check --json' report (no cases list)")
    ids = {c["id"] for c in data["cases"] if isinstance(c, dict) and c.get("status") in FAILED}
    sets = [s["path"] for s in data.get("sets", []) if isinstance(s, dict) and s.get("path")]
    return ids, sets


def row_roles(case, media, kv_shared: bool = False) -> tuple[list[str], list[str]]:
    """(labels, roles) of every row a case returns, in order: role decode, image, audio (a row inside a
    media block of its base), pruned (a row of an output-row prefill on a model with KV-shared layers: an
    engine may run only such rows through those layers), last (the prompt's last row) or interior."""
    labels, roles = [], []
    groups = row_groups(case)
    pruned = kv_shared and case.kind == "prefill" and len(groups[0][1]) < prompt_length(case)
    for gname, specs in groups:
        for spec in specs:
            labels.append(spec.label)
            if gname.startswith("decode"):
                roles.append("decode")
                continue
            m = media.get(spec.base)

            def inside(spans, pos: int = spec.position) -> bool:
                return any(s <= pos < s + n for s, n in spans)

            if m is not None and inside(m.images):
                roles.append("image")
            elif m is not None and inside(m.audio):
                roles.append("audio")
            elif pruned:
                roles.append("pruned")
            elif spec.label.endswith("last") or spec.position == prompt_length(case) - 1:
                roles.append("last")
            else:
                roles.append("interior")
    return labels, roles


def widened(request: Request) -> Request | None:
    """The prompt of a ``last`` or ``prefill`` request as a prefill returning every row of every piece (the same
    pieces, micro-batches and media; no decode), or None when it has no such form (``multi``, ``full``, a text
    prompt given as embeddings)."""
    if request.kind == "prefill":
        pieces = tuple(dataclasses.replace(p, rows=tuple(range(len(p.tokens)))) for p in request.pieces)
        return dataclasses.replace(request, pieces=pieces, decode=())
    if request.kind != "last" or (request.entry == "embeddings" and not (request.images or request.audio)):
        return None
    media = request.images or request.audio
    piece = Piece(request.tokens, tuple(range(len(request.tokens))), embeddings=request.embeddings if media else None)
    return Request(kind="prefill", pieces=(piece,), images=request.images, audio=request.audio,
                   audio_inputs=request.audio_inputs, image_inputs=request.image_inputs, hidden=request.hidden,
                   trace=request.trace)


def prompt_roles(request: Request) -> tuple[list[str], list[str]]:
    """(labels, roles) of every row of a ``widened`` request: "row <position>"; image, audio, last, interior."""
    n = sum(len(p.tokens) for p in request.pieces)

    def inside(spans, i: int) -> bool:
        return any(s <= i < s + m for s, m in spans)

    roles = ["image" if inside(request.images, i) else "audio" if inside(request.audio, i) else
             "last" if i == n - 1 else "interior" for i in range(n)]
    return [f"row {i}" for i in range(n)], roles


def _earlier(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether first divergence ``a`` is at an earlier point of the forward than ``b`` (None: never)."""
    if a is None:
        return False
    if b is None:
        return True
    if "logits" in (a["point"], b["point"]):
        return b["point"] == "logits" and a["point"] != "logits"
    order = point_order([a["point"], b["point"]])
    return order[0] == a["point"] and a["point"] != b["point"]


def _every_prompt_row(backend: Backend, oracle: Backend, request: Request, oracle_request: Request, claimed: dict,
                      floor: float) -> TraceComparison | None:
    """The comparison of the ``widened`` request (every prompt row traced), or None when the case has no such
    form, the backend does not claim what it needs, or fails on it (the case's own comparison then stands)."""
    wide, oracle_wide = widened(request), widened(oracle_request)
    if wide is None or not all(claims(claimed, n) for n in required_capabilities(wide)):
        return None
    call = CallInfo.from_call(lambda: backend.run(wide))
    if call.failed:  # the case's own comparison stands
        return None
    got = call.value
    ref = oracle.run(dataclasses.replace(oracle_wide, trace=True))
    labels, roles = prompt_roles(oracle_wide)
    try:
        out = compare_traces([got.trace], [ref.trace], [got.logits], [ref.logits], labels, roles, floor)
    except ValueError:
        return None
    out.traced = "every prompt row"
    return out


def _explain_case(backend: Backend, oracle: Backend, bctx, octx, case, profile, claimed: dict) -> CaseExplanation:
    def result(status: str, message: str, **kw) -> CaseExplanation:
        return CaseExplanation(case.id, bctx.name, case.kind, status, message, **kw)

    if case.kind == "mtp":
        return result("skipped", "MTP cases carry no traces; the check locates an MTP failure by round and step")
    request = build_request(case, bctx.bases, bctx.embed, bctx.media, bctx.drafter)
    missing = [n for n in required_capabilities(request) if not claims(claimed, n)]
    if missing == ["decode"]:
        case = without_decode(case)
        request = build_request(case, bctx.bases, bctx.embed, bctx.media, bctx.drafter)
    elif missing:
        return result("not-claimed", "needs " + ", ".join(missing) + " (not claimed by the backend)")
    traced = bool(claimed.get("traces", False))
    request = dataclasses.replace(request, trace=traced, hidden=bool(claimed.get("hidden_states", False)))
    call = CallInfo.from_call(lambda: backend.run(request))
    if call.failed:  # the backend's failure is this case's finding
        return result("error", f"the backend failed on the traced request: {call.text()}")
    got = call.value
    oracle_request = build_request(case, octx.bases, octx.embed, octx.media, octx.drafter)
    ref = oracle.run(dataclasses.replace(oracle_request, trace=True))
    cfg = octx.text_config
    labels, roles = row_roles(case, octx.media, cfg.first_shared_layer < cfg.num_hidden_layers)
    got_traces, got_logits = trace_groups(case, got), response_groups(case, got)
    ref_traces, ref_logits = trace_groups(case, ref), response_groups(case, ref)
    floor = float(case_profile(profile, bctx, case).nmse)
    try:
        comparison = compare_traces(got_traces if traced else [None] * len(ref_traces), ref_traces, got_logits,
                                    ref_logits, labels, roles, floor)
    except ValueError as exc:  # a trace outside the vocabulary, or misshapen
        return result("error", f"the backend's trace cannot be compared: {exc}")
    served = sorted(set().union(*(t.keys() for t in got_traces if t))) if traced else []
    first, returned = comparison.first_divergence, None
    everywhere = _every_prompt_row(backend, oracle, request, oracle_request, claimed, floor) if traced else None
    if everywhere is not None and _earlier(everywhere.first_divergence, first):
        returned, comparison, first = comparison, everywhere, everywhere.first_divergence
    if first is None:
        message = f"every compared point is within the floor {floor:.3g}"
    else:
        where = "" if first["layer"] is None else f"layer {first['layer']}, "
        message = (f"first leaves the floor at {where}{first['what']} ({first['point']}): "
                   f"{', '.join(first['rows'][:6])}{' ...' if len(first['rows']) > 6 else ''} "
                   f"({'/'.join(first['roles'])}); error {first['error']:.3g} > {floor:.3g}")
        if returned is not None:
            seen = returned.first_divergence
            message += (" (traced over every prompt row: rows the case does not return; on its returned rows the "
                        "error shows first at " + (seen["point"] if seen else "no point") + ")")
    if not traced:
        message += "; the backend serves no traces (capability traces), so only its logits were compared"
    return result("diverges" if first is not None else "within", message, comparison=comparison, served=served,
                  returned=returned)


def explain(backend: Backend, sets: Iterable, profile, *, select=None, ids: set[str] | None = None,
            progress: Callable[[int, int, str], None] | None = None, model: str | Path | None = None,
            rehash: bool = False, workdir: str | Path | None = None) -> list[CaseExplanation]:
    """Explain the cases of ``sets`` that ``select`` (a -k regex) and ``ids`` (case ids, e.g. a report's failed
    ones) both choose. NoCasesSelected when none is chosen; BackendError when the backend cannot be opened."""
    selection = Selection(sets, select)
    chosen = [[c for c in cases if ids is None or c.id in ids] for cases in selection.chosen]
    total = sum(len(c) for c in chosen)
    if total == 0:
        raise NoCasesSelected("no case matches the selection" + (" among the report's failed cases" if ids else ""))
    out: list[CaseExplanation] = []
    with tempfile.TemporaryDirectory(prefix="gemma4-explain-", dir=workdir) as tmp:
        checkpoints = Checkpoints(tmp, model=model, rehash=rehash)
        mine, theirs = Session(backend, checkpoints), Session(RefimplBackend(oracle=checkpoints.oracle), checkpoints)

        def explain_one(bctx, case) -> CaseExplanation:
            if progress is not None:
                progress(len(out), total, case.id)
            octx = theirs.enter(bctx.fs)
            out.append(_explain_case(backend, theirs.backend, bctx, octx, case, profile, mine.claimed))
            return out[-1]

        try:
            mine.run(zip(selection.sets, chosen, strict=True), Work(explain_one))
        finally:
            theirs.close()
    if progress is not None:
        progress(total, total, "")
    return out


def explain_json(results: list[CaseExplanation], backend: Backend, profile) -> dict[str, Any]:
    """The JSON document of ``--json``."""
    return {"schema": SCHEMA, "backend": getattr(backend, "name", type(backend).__name__),
            "profile": profile.name, "cases": [r.to_json() for r in results]}


def worst_table(comparison: TraceComparison) -> list[str]:
    """A console table of one case: per layer the worst row error at each sub-block, then the final norm and
    the logits; the first divergence marked with '<'."""
    first = comparison.first_divergence
    cols = ("attn_out", "ffn_out", "ple_add", "residual")
    layers: dict[int, dict[str, float]] = {}
    lines = []
    for p in comparison.points:
        if p.layer is not None and p.sub in cols:
            layers.setdefault(p.layer, {})[p.sub] = p.worst
    present = [c for c in cols if any(c in v for v in layers.values())]

    def cell(value: float | None, marked: bool) -> str:
        text = "-" if value is None or np.isnan(value) else f"{value:.1e}"
        return (text + (" <" if marked else "")).ljust(11)

    def mark(name: str) -> bool:
        return first is not None and first["point"] == name

    for p in comparison.points:
        if p.layer is None and p.sub == "embed":
            lines.append(f"    {'embed':<12}{cell(p.worst, mark(p.name))}")
    if layers:
        lines.append("    " + "layer".ljust(12) + "".join(c.ljust(11) for c in present))
        for i in sorted(layers):
            lines.append("    " + str(i).ljust(12) + "".join(cell(layers[i].get(c), mark(f"layers.{i}.{c}"))
                                                           for c in present))
    for p in comparison.points:
        if p.layer is None and p.sub != "embed":
            lines.append(f"    {p.name:<12}{cell(p.worst, mark(p.name))}")
    for d in comparison.router_differs():
        lines.append(f"    layer {d['layer']}: the router chose other experts for {', '.join(d['rows'])}")
    return lines


def console_lines(results: list[CaseExplanation], verbose: bool = True) -> list[str]:
    """What ``conformance explain`` prints: per case its verdict line, then its table."""
    lines = []
    for r in results:
        lines.append(f"{r.id}: {r.status}: {r.message}")
        if r.comparison is not None and (verbose or r.status == "diverges"):
            labelled = zip(r.comparison.rows[:8], r.comparison.roles[:8], strict=True)
            lines.append(f"  worst row error per point (floor {r.comparison.floor:.3g}; rows: "
                         f"{', '.join(f'{a} ({b})' for a, b in labelled)}"
                         f"{' ...' if len(r.comparison.rows) > 8 else ''})")
            lines += worst_table(r.comparison)
    n = {s: sum(1 for r in results if r.status == s) for s in ("diverges", "within", "error", "not-claimed", "skipped")}
    lines.append(", ".join(f"{v} {k}" for k, v in n.items() if v) or "no case")
    return lines
