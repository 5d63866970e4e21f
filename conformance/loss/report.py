"""The loss report's faces: JSON (``loss_json``, schema ``gemma4-conformance-loss`` v1), the console tables
(``console_lines``) and Markdown (``loss_markdown``)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from .compare import COMPARISONS, LossRun

__all__ = ["SCHEMA", "SCHEMA_VERSION", "console_lines", "loss_json", "loss_markdown", "verdict"]

SCHEMA, SCHEMA_VERSION = "gemma4-conformance-loss", 1
# (heading, summary key, how its value is shown)
COLUMNS = (("KL mean", "kl_mean", "g"), ("KL p99", "kl_p99", "g"), ("KL max", "kl_max", "g"),
           ("same top-1", "top1_same_pct", "pct"), ("Δp RMS", "dp_rms", "g"), ("max_abs", "max_abs", "g"))
PER_CASE = (("KL mean", "kl_mean", "g"), ("top-1", "top1_same_pct", "pct"), ("Δp RMS", "dp_rms", "g"),
            ("max_abs", "max_abs", "g"))
SHORT = {"quantisation": "quant", "engine-vs-reference": "eng-ref", "engine-vs-quantised": "eng-q"}
MEANING = {"quantisation": "the quantised oracle against the reference oracle: what the quantisation costs",
           "engine-vs-reference": "the engine against the reference oracle: quantisation and arithmetic together",
           "engine-vs-quantised": "the engine against the quantised oracle: its arithmetic alone (what check grades)"}


def verdict(run: LossRun) -> str:
    """info (no threshold given), pass or fail."""
    if not run.thresholds.any():
        return "info"
    return "fail" if run.exit_code else "pass"


def _show(value: Any, how: str) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}%" if how == "pct" else f"{value:.3g}"


def loss_json(run: LossRun, argv: list[str] | None = None) -> dict[str, Any]:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "command": argv, "quantised": run.quantised,
            "reference": run.reference, "backend": run.backend, "comparisons": {k: MEANING[k] for k in run.total},
            "thresholds": dataclasses.asdict(run.thresholds), "verdict": verdict(run), "exit_code": run.exit_code,
            "breaches": run.breaches, "total": run.total, "cases": [c.to_json() for c in run.cases]}


def _header(run: LossRun) -> list[str]:
    q, r = run.quantised, run.reference
    lines = [f"quantised {q['name']} {q['version']} (activations {q['activations']}) against the reference "
             f"{r['name']} {r['version']} ({_checkpoint(r)})"]
    if run.backend is not None:
        states = Counter(c.engine for c in run.cases)
        lines.append(f"backend {run.backend}: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    return lines


def _checkpoint(info: dict[str, Any]) -> str:
    m = info["model"]
    if m.get("kind") == "synthetic":
        return f"preset {m.get('preset')}, seed {m.get('seed')}"
    return f"checkpoint {m.get('path')}"


def _verdict_lines(run: LossRun) -> list[str]:
    v = verdict(run)
    if v == "info":
        return ["information only: no threshold given (--max-kl, --max-kl-p99, --min-top1, --max-dp-rms make it a "
                "verdict)"]
    if v == "pass":
        return ["pass: every comparison against the reference keeps within the thresholds"]
    return ["fail: " + "; ".join(f"{name}: {', '.join(b)}" for name, b in run.breaches.items() if b)]


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*head), *(fmt.format(*r) for r in body)]


def _case_columns(run: LossRun) -> tuple[list[str], list[tuple[str, str, str]]]:
    names = [n for n in COMPARISONS if n in run.total]
    head, cols = [], []
    for n in names:
        for label, key, how in PER_CASE:
            head.append(f"{SHORT[n]} {label}")
            cols.append((n, key, how))
    return head, cols


def console_lines(run: LossRun) -> list[str]:
    """The header, the totals (one line per comparison), every case, the verdict."""
    lines = _header(run) + [""]
    lines += _table(["total", "rows", *(c[0] for c in COLUMNS)],
                    [[name, str(t["rows"]), *(_show(t[k], how) for _, k, how in COLUMNS)]
                     for name, t in run.total.items()])
    head, cols = _case_columns(run)
    body = [[c.id, str(c.rows), *(_show(c.loss.get(n, {}).get(k), how) for n, k, how in cols)] for c in run.cases]
    lines += ["", *_table(["case", "rows", *head], body)]
    for c in run.cases:
        if c.engine in ("error", "not-claimed"):
            lines.append(f"{c.id}: {c.engine}: {c.message}")
    return lines + ["", *_verdict_lines(run)]


def loss_markdown(run: LossRun) -> str:
    """The report as Markdown: header, totals, the verdict, every case."""
    def row(cells: list[str]) -> str:
        return "| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |"

    out = ["## Quantisation loss on the same rows", "", *(f"{line}  " for line in _header(run)), "",
           row(["comparison", "rows", *(c[0] for c in COLUMNS)]), row(["---"] * (len(COLUMNS) + 2))]
    out += [row([f"{name}: {MEANING[name]}", str(t["rows"]), *(_show(t[k], how) for _, k, how in COLUMNS)])
            for name, t in run.total.items()]
    out += ["", f"**{_verdict_lines(run)[0]}**", ""]
    head, cols = _case_columns(run)
    out += [row(["case", "rows", *head]), row(["---"] * (len(head) + 2))]
    out += [row([f"`{c.id}`", str(c.rows), *(_show(c.loss.get(n, {}).get(k), how) for n, k, how in cols)])
            for c in run.cases]
    return "\n".join(out) + "\n"
