"""The HTML report of a check run (``conformance check --html FILE``, the pytest plugin's
``--conformance-html FILE``) and of ``conformance explain --html FILE``: one self-contained page to keep as a CI
artifact and open in a browser. No network, no external asset, no script: the style sheet is inline, the
heat maps are tables with background colours.

The check page holds the verdict (exit line, counts, backend, profile, fixture sets), the tables by fixture set,
entry point and feature, an index of the failed cases, then every failed case (fail, error, xpass, then xfail)
in its own section (``id="case-<slug>"``): check, message, diagnosis, every failing row with its metrics and
the oracle's and the backend's top-k tokens, the expectations applied, what the backend says it executed. A long
run stays usable: a filter by status and by feature above the index (radio buttons and CSS: checking one hides
the other cases), and past the first OPEN_CASES failed cases each case's details start collapsed. With
``explanations`` (``conformance.explain.explain()``'s results) a case's section also holds the heat map of the
error at every traced point and row. Every piece of text from backends and sets is made printable and
HTML-escaped."""

from __future__ import annotations

import json
import math
import re
from html import escape
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..check.results import FAILING, CaseResult, RunResult
from ..protocol.trace import SUB_BLOCKS
from .console import COLUMNS, ENTRY_TAGS, counts_line, exit_line
from .json_report import clean, matrix, versions, write_output
from .junit import fmt, one_line
from .text import printable

__all__ = ["anchor_ids", "explain_html", "heat_colour", "html_report", "write_explain_html", "write_html"]

SHOWN = ("fail", "error", "xpass", "xfail")  # the statuses whose cases get a section, in this order
ROW_METRICS = ("max_abs", "nmse", "kl", "top1_agree", "topk_overlap", "got_max_abs")
MAX_ROWS = 60  # failing rows listed per case
MAX_HEAT_ROWS = 240  # rows of one heat map
SHORT = {"embed": "emb", "attn_out": "attn", "ffn_out": "ffn", "ple_add": "ple", "residual": "res",
         "final_norm": "norm", "logits": "logits"}
# matplotlib's magma at nine stops (the colours of conformance explain --plot)
MAGMA = ("#000004", "#1c1044", "#4f127b", "#812581", "#b5367a", "#e55064", "#fb8761", "#fec287", "#fcfdbf")
VMIN = -34.0  # log10 of the smallest error drawn (float64 rounding sits near -30)

STYLE = """
:root{--fg:#1f2328;--mut:#59636e;--bd:#d1d9e0;--bg2:#f6f8fa;--red:#cf222e;--redbg:#ffebe9;--grn:#1a7f37;
--grnbg:#dafbe1;--amb:#9a6700;--ambbg:#fff8c5;--blu:#0969da}
*{box-sizing:border-box}
body{font:14px/1.45 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:var(--fg);margin:0;background:#fff}
main{max-width:1200px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 4px}
h2{font-size:18px;margin:28px 0 8px;padding-bottom:4px;border-bottom:1px solid var(--bd)}
h3{font-size:15px;margin:0 0 6px;word-break:break-all}h4{font-size:13px;margin:12px 0 4px;color:var(--mut)}
code,pre,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
pre{background:var(--bg2);border:1px solid var(--bd);border-radius:6px;padding:8px;overflow-x:auto;white-space:pre-wrap;
word-break:break-all}
a{color:var(--blu);text-decoration:none}a:hover{text-decoration:underline}
.verdict{border-radius:8px;padding:12px 16px;margin:12px 0;border:1px solid}
.verdict.ok{background:var(--grnbg);border-color:#4ac26b}.verdict.bad{background:var(--redbg);border-color:#ff8182}
.verdict.warn{background:var(--ambbg);border-color:#d4a72c}.verdict .line{font-size:18px;font-weight:600}
table{border-collapse:collapse;margin:6px 0 10px}th,td{border:1px solid var(--bd);padding:3px 8px;vertical-align:top}
th{background:var(--bg2);text-align:left;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
td.hot{background:var(--redbg);color:var(--red);font-weight:600}tr.failing>td:first-child{font-weight:600}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:6px 0}dl.facts dt{color:var(--mut)}
dl.facts dd{margin:0;word-break:break-word}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;font-weight:700;color:#fff;margin-right:4px}
.b-fail,.b-error,.b-xpass,.b-diverges{background:var(--red)}.b-xfail{background:var(--amb)}.b-within{background:var(--grn)}
.b-not-claimed,.b-skipped{background:var(--mut)}
section.case{border:1px solid var(--bd);border-left:4px solid var(--red);border-radius:6px;padding:10px 14px;
margin:14px 0}
section.case.s-xfail{border-left-color:#d4a72c}section.case.s-within{border-left-color:var(--grn)}
section.case:target{box-shadow:0 0 0 3px #54aeff66}
.diag{background:var(--ambbg);border:1px solid #d4a72c;border-radius:6px;padding:6px 10px;margin:6px 0}
.msg{margin:6px 0;word-break:break-word}.mut{color:var(--mut)}
.tok{display:inline-block;border:1px solid var(--bd);border-radius:4px;padding:0 4px;margin:1px 2px;
background:var(--bg2);
white-space:pre}table.rows{width:100%}.tok.miss{background:var(--redbg);border-color:#ff8182}
.scroll{overflow-x:auto;max-width:100%}
table.heat{border-collapse:separate;border-spacing:0}
table.heat td.c{width:13px;min-width:13px;height:15px;padding:0;border:0}
table.heat td.c.first{outline:2px solid #00e5ff;outline-offset:-2px}
table.heat td.c.na{background:repeating-linear-gradient(45deg,#ddd 0 2px,#fff 2px 4px)}
table.heat th{font-size:10px;font-weight:500;padding:1px;border:0;background:#fff}
table.heat th.v{writing-mode:vertical-rl;transform:rotate(180deg);height:46px;text-align:left;white-space:nowrap}
table.heat th.lay{border-left:1px solid var(--bd);text-align:left;color:var(--mut)}
table.heat th.row{vertical-align:bottom;text-align:right;white-space:nowrap;padding-right:6px;
font-family:ui-monospace,monospace}
table.heat td.c.l0{border-left:1px solid #fff}
.bar{position:relative;height:14px;width:360px;border:1px solid var(--bd);margin:4px 0 18px}
.bar span{position:absolute;top:15px;font-size:10px;transform:translateX(-50%);white-space:nowrap;color:var(--mut)}
.bar i{position:absolute;top:-3px;bottom:-3px;width:2px;background:#00b8d4}
footer{margin-top:32px;color:var(--mut);font-size:12px}
"""


def esc(x: Any) -> str:
    """Text from anywhere, printable and HTML-escaped (quotes too: safe in an attribute)."""
    return escape(printable(str(x)), quote=True)


def anchor_ids(ids: Iterable[str], prefix: str = "case-") -> dict[str, str]:
    """``{case id: "case-<slug>"}``: a slug of letters, digits, ``_``, ``.`` and ``-``, unique on the page."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for cid in ids:
        if cid in out:
            continue
        base = prefix + (re.sub(r"[^A-Za-z0-9_.-]+", "-", cid).strip("-") or "x")
        slug, n = base, 2
        while slug in taken:
            slug, n = f"{base}-{n}", n + 1
        taken.add(slug)
        out[cid] = slug
    return out


def heat_colour(value: float, vmax: float) -> str:
    """The magma colour of ``value`` (log10 of an error) on the scale VMIN..vmax, as ``#rrggbb``."""
    t = min(max((value - VMIN) / (vmax - VMIN), 0.0), 1.0) * (len(MAGMA) - 1)
    k = min(int(t), len(MAGMA) - 2)
    a, b = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in MAGMA[k:k + 2])
    f = t - k
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b, strict=True))


def _page(title: str, body: list[str], style: str = "") -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\n"
            f"<title>{esc(title)}</title>\n<style>{STYLE}{style}</style>\n</head>\n<body>\n<main>\n"
            + "\n".join(body) + f"\n<footer>gemma4-conformance {esc(versions()['conformance'])}: "
            "a self-contained page (no script, no external asset).</footer>\n</main>\n</body>\n</html>\n")


def _badge(status: str) -> str:
    return f'<span class="badge b-{esc(status)}">{esc(status.upper())}</span>'


def _facts(pairs: Sequence[tuple[str, Any]]) -> str:
    items = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in pairs if v not in (None, ""))
    return f'<dl class="facts">{items}</dl>'


def _table(title: str, rows: dict[str, dict[str, int]]) -> list[str]:
    """A count table (a row per set, entry point or feature), rows with failures marked."""
    if not rows:
        return []
    cols = [c for c in COLUMNS if any(r.get(c, 0) for r in rows.values())] or ["pass"]
    out = ["<table class=\"counts\"><thead><tr><th>" + esc(title) + "</th>"
           + "".join(f"<th>{esc(c)}</th>" for c in cols) + "<th>total</th></tr></thead><tbody>"]
    for name, r in rows.items():
        failing = any(r.get(s, 0) for s in FAILING)
        cells = "".join(f'<td class="n{" hot" if c in FAILING and r.get(c, 0) else ""}">{r.get(c, 0) or "·"}</td>'
                        for c in cols)
        row = '<tr class="failing">' if failing else "<tr>"
        out.append(f'{row}<td>{esc(name)}</td>{cells}'
                   f'<td class="n">{sum(r.values())}</td></tr>')
    return out + ["</tbody></table>"]


def _tokens(ids: Sequence[Any], pieces: Sequence[Any] | None, other: Sequence[Any] | None = None) -> str:
    """Token chips ``id 'piece'``; with ``other`` (the oracle's top-k), a token outside it is marked."""
    if not ids:
        return '<span class="mut">-</span>'
    chips = []
    for k, i in enumerate(ids):
        piece = f" {pieces[k]!r}" if pieces and k < len(pieces) else ""
        miss = other is not None and i not in other
        chips.append(f'<span class="tok{" miss" if miss else ""}">{esc(i)}{esc(piece)}</span>')
    return "".join(chips)


def _rows_table(c: CaseResult) -> list[str]:
    bad = [r for r in c.rows if r.get("status") == "fail"]
    if not bad:
        return []
    shown = [k for k in ROW_METRICS if any((r.get("metrics") or {}).get(k) is not None for r in bad)]
    out = [f"<h4>Failing rows ({len(bad)} of {len(c.rows)})</h4>", '<div class="scroll"><table class="rows"><thead><tr>'
           "<th>row</th><th>position</th><th>check</th>" + "".join(f"<th>{esc(k)}</th>" for k in shown)
           + "<th>oracle top-k</th><th>backend top-k</th></tr></thead><tbody>"]
    for r in bad[:MAX_ROWS]:
        m = r.get("metrics") or {}
        ref = r.get("top_ref") or []
        out.append(f"<tr><td class=\"mono\">{esc(r.get('label'))}</td><td class=\"n\">{esc(r.get('position'))}</td>"
                   f"<td>{esc(r.get('check') or '-')}</td>"
                   + "".join(f'<td class="n">{esc("-" if m.get(k) is None else fmt(m[k]))}</td>' for k in shown)
                   + f"<td class=\"toks\">{_tokens(ref, r.get('top_ref_pieces'))}</td>"
                   f"<td class=\"toks\">{_tokens(r.get('top_got') or [], r.get('top_got_pieces'), ref)}</td></tr>")
    out.append("</tbody></table></div>")
    if len(bad) > MAX_ROWS:
        out.append(f'<p class="mut">... and {len(bad) - MAX_ROWS} more failing rows (the JSON report has every '
                   'one)</p>')
    messages = [r.get("message") for r in bad[:MAX_ROWS] if r.get("message")]
    if messages:
        out.append("<details><summary>row messages</summary><pre>" + esc("\n".join(messages)) + "</pre></details>")
    return out


def _expectation(e: dict[str, Any] | None) -> list[str]:
    """What the expectations file said about one case (CaseResult.expectation)."""
    if not e:
        return []
    items = []
    for key, what in (("skip", "skip"), ("known_failure", "known failure")):
        entry = e.get(key)
        if entry:
            items.append(f"<li>{esc(what)}: entry {esc(entry.get('index'))} (match "
                         f"<code>{esc(entry.get('match'))}</code>): "
                         f"{esc(entry.get('reason'))}" + (f"; issue {esc(entry['issue'])}" if entry.get("issue")
                                                                     else "")
                         + (f"; expires {esc(entry['expires'])}" if entry.get("expires") else "") + "</li>")
    if e.get("tolerance"):
        items.append(f"<li>tolerance {esc(json.dumps(clean(e['tolerance']), sort_keys=True))} (entries "
                     f"{esc(', '.join(map(str, e.get('tolerance_entries') or [])))}: "
                     f"{esc('; '.join(map(str, e.get('tolerance_reasons') or [])))})</li>")
    return ["<h4>Expectations applied</h4>", "<ul>" + "".join(items) + "</ul>"]


def _case_section(c: CaseResult, anchor: str, explanation=None, classes: str = "",
                  collapsed: bool = False) -> list[str]:
    facts = [("set", esc(c.set)), ("entry", f"<code>{esc(c.entry)}</code>"), ("kind", esc(c.kind)),
             ("check", f"<code>{esc(c.check)}</code>" if c.check else None),
             ("features", esc(", ".join(c.features)) or None),
             ("generation", None if c.first_divergence is None else f"diverges at step {esc(c.first_divergence)}"),
             ("needs", esc(", ".join(c.needs)) or None), ("duration", f"{c.duration:.3f} s")]
    out = [f'<section class="case s-{esc(c.status)}{classes}" id="{esc(anchor)}">',
           f'<h3>{_badge(c.status)} <a href="#{esc(anchor)}"><code>{esc(c.id)}</code></a></h3>', _facts(facts),
           f'<p class="msg">{esc(c.message)}</p>']
    if c.diagnosis:
        out.append(f'<div class="diag"><strong>Diagnosis:</strong> {esc(c.diagnosis)}</div>')
    if c.status == "error" and c.error:
        out.append(f"<h4>Error: {esc(c.error.get('type') or '')}</h4>")
        if c.error.get("traceback"):
            out.append("<pre>" + esc(c.error["traceback"].rstrip()) + "</pre>")
    head = len(out)
    out += _rows_table(c)
    if c.summary:
        out.append('<p class="mut">case metrics: ' + esc(", ".join(f"{k} {fmt(v)}" for k, v in c.summary.items()))
                   + "</p>")
    out += _expectation(c.expectation)
    if c.executed:
        out.append("<details><summary>what the backend says it executed</summary><pre>"
                   + esc(json.dumps(clean(c.executed), sort_keys=True, indent=1)) + "</pre></details>")
    if explanation is not None:
        out += ["<h4>Where it leaves the oracle (conformance explain)</h4>"] + _explanation_body(explanation)
    if collapsed and len(out) > head:  # a long run: the details of the later cases open on a click
        out = out[:head] + ["<details><summary>failing rows, metrics, expectation, what the backend executed"
                            "</summary>"] + out[head:] + ["</details>"]
    return out + ["</section>"]


def _run_facts(result: RunResult) -> str:
    b = result.backend
    claimed = [k for k, v in (b.get("capabilities") or {}).items() if v is True]
    stop = result.interrupted
    return _facts([
        ("backend", f"<code>{esc(b.get('name'))}</code>"),
        ("options", esc(json.dumps(clean(b.get("options")), sort_keys=True)) if b.get("options") else None),
        ("capabilities", esc(", ".join(claimed)) or None),
        ("profile", f"<code>{esc(getattr(result.profile, 'name', '?'))}</code>"),
        ("selection", f"<code>{esc(result.select)}</code>" if result.select else None),
        ("started", esc(result.started.isoformat(timespec="seconds"))),
        ("duration", f"{result.duration:.1f} s"),
        ("ended early", None if stop is None else esc(f"{stop['message']}; {stop['cases_not_run']} cases not run")),
        ("harness", esc(", ".join(f"{k} {v}" for k, v in versions().items()))),
    ])


def _sets_table(result: RunResult) -> list[str]:
    out = ["<h2>Fixture sets</h2>", "<table><thead><tr><th>set</th><th>version</th><th>cases</th><th>manifest</th>"
           "<th>path</th></tr></thead><tbody>"]
    for s in result.sets:
        out.append(f"<tr><td>{esc(s.name)}</td><td>{esc(s.version)}</td><td class=\"n\">{s.cases_selected} of "
                   f"{s.cases_total}</td><td class=\"mono\">{esc(s.manifest_sha256[:12])}</td>"
                   f"<td class=\"mono\">{esc(s.path)}</td></tr>")
    out.append("</tbody></table>")
    for s in result.sets:
        out += [f'<p class="diag">warning ({esc(s.name)}): {esc(w)}</p>' for w in s.warnings]
    return out


def _expectations_section(result: RunResult, anchors: dict[str, str]) -> list[str]:
    exp = result.expectations or {}
    applied = [c for c in result.cases if c.expectation]
    if not (exp.get("path") or exp.get("entries") or applied):
        return []
    source = f"file <code>{esc(exp['path'])}</code>" if exp.get("path") else "no file"
    out = ["<h2 id=\"expectations\">Expectations</h2>",
           f"<p>{source}; "
           f"{_n(exp.get('entries', 0), 'entry', 'entries')}; dates compared with {esc(exp.get('today') or '?')}.</p>"]
    if applied:
        out.append("<table><thead><tr><th>case</th><th>status</th><th>applied</th></tr></thead><tbody>")
        for c in applied:
            name = f"<code>{esc(c.id)}</code>"
            if c.id in anchors:
                name = f'<a href="#{esc(anchors[c.id])}">{name}</a>'
            what = "; ".join(f"{k.replace('_', ' ')} (entry {v.get('index')}: {v.get('reason')})"
                             for k, v in c.expectation.items() if k in ("skip", "known_failure"))
            if c.expectation.get("tolerance"):
                what = "; ".join(filter(None, [what, "tolerance " + json.dumps(clean(c.expectation["tolerance"]),
                                                                               sort_keys=True)]))
            out.append(f"<tr><td>{name}</td><td>{_badge(c.status)}</td><td>{esc(what)}</td></tr>")
        out.append("</tbody></table>")
    for key, what in (("expired", "expired (no longer applied; renew or remove)"), ("unused", "matched no case")):
        if exp.get(key):
            out.append(f"<h4>{_n(len(exp[key]), 'entry', 'entries')} {esc(what)}</h4><ul>" + "".join(
                f"<li>entry {esc(e.get('index'))} ({esc(e.get('action'))}, match <code>{esc(e.get('match'))}</code>"
                + (f", expired {esc(e['expires'])}" if key == "expired" and e.get("expires") else "")
                + f"): {esc(e.get('reason'))}</li>" for e in exp[key]) + "</ul>")
    return out


def _n(count: Any, one: str, many: str) -> str:
    return f"{esc(count)} {one if count == 1 else many}"


OPEN_CASES = 20  # a run's first failed cases are shown whole; the later ones keep their details collapsed


def _filters(cases: Sequence[CaseResult]) -> tuple[list[str], str, dict[str, str]]:
    """A filter of the failed cases by status and by feature, in radio buttons and CSS alone (the page runs no
    script): checking one hides the index rows and sections of the other cases. Returns the buttons (they
    must come before the index and the sections, as their siblings), the CSS, and each case's classes."""
    statuses = [s for s in SHOWN if any(c.status == s for c in cases)]
    features = sorted({f for c in cases for f in c.features if f not in ENTRY_TAGS})
    fid = {f: f"ft{i}" for i, f in enumerate(features)}
    classes = {c.id: "".join(f" {fid[f]}" for f in c.features if f in fid) for c in cases}
    options = [(f"st-{s}", s, f"s-{s}", sum(c.status == s for c in cases)) for s in statuses]
    options += [(f"f-{fid[f]}", f, fid[f], sum(f in c.features for c in cases)) for f in features]
    radios = ['<input type="radio" name="show" id="show-all" class="pick" checked>']
    labels = [f'<label for="show-all">all ({len(cases)})</label>']
    css = ["#show-all:checked~p.filter label[for=show-all]"]
    for key, text, _, n in options:
        radios.append(f'<input type="radio" name="show" id="show-{key}" class="pick">')
        labels.append(f'<label for="show-{key}">{esc(text)} ({n})</label>')
        css.append(f"#show-{key}:checked~p.filter label[for=show-{key}]")
    hide = "".join(f"#show-{key}:checked~table.index tr.c:not(.{cls}),#show-{key}:checked~section.case:not(.{cls})"
                   f"{{display:none}}" for key, _, cls, _ in options)
    style = (".pick{position:absolute;opacity:0;width:0;height:0}p.filter label{display:inline-block;margin:2px 4px;"
             "padding:1px 8px;border:1px solid var(--bd);border-radius:10px;cursor:pointer;font-size:12px}"
             + ",".join(css) + "{background:var(--fg);color:#fff}" + hide)
    html = radios + ['<p class="filter">show: ' + " ".join(labels) + "</p>"]
    return html, style, classes


def _index(cases: Sequence[CaseResult], anchors: dict[str, str], classes: dict[str, str] | None = None) -> list[str]:
    out = ["<table class=\"index\"><thead><tr><th>status</th><th>case</th><th>check</th><th>diagnosis</th></tr>"
           "</thead><tbody>"]
    for c in cases:
        out.append(f"<tr class=\"c s-{esc(c.status)}{(classes or {}).get(c.id, '')}\"><td>{_badge(c.status)}</td>"
                   f"<td><a href=\"#{esc(anchors[c.id])}\"><code>{esc(c.id)}</code>"
                   f"</a></td><td>{esc(c.check or '-')}</td><td>{esc(one_line(c.diagnosis or '', 160))}</td></tr>")
    return out + ["</tbody></table>"]


def html_report(result: RunResult | None, explanations: Sequence | None = None) -> str:
    """The run as one self-contained HTML page; ``explanations`` (CaseExplanation, from conformance.explain)
    add a heat map to the sections of their cases. ``result=None``: the page of the explanations alone
    (``explain_html``)."""
    if result is None:
        return explain_html(explanations or [])
    code = result.exit_code
    name = str(result.backend.get("name"))
    used = [s for s in result.sets if s.cases_selected]
    shown = [c for s in SHOWN for c in result.cases if c.status == s]
    anchors = anchor_ids(c.id for c in shown)
    explained = {e.id: e for e in explanations or []}
    tone = "ok" if code == 0 else "warn" if code == 5 else "bad"
    body = [f"<h1>Gemma 4 conformance: <code>{esc(name)}</code></h1>",
            f'<div class="verdict {tone}"><div class="line">{esc(exit_line(code))}</div>'
            f"<div>{esc(counts_line(result))}; profile <code>{esc(getattr(result.profile, 'name', '?'))}</code>; "
            f"fixture sets: {esc(', '.join(s.label() for s in used) or 'none')}</div></div>",
            _run_facts(result)]
    body += _sets_table(result)
    body.append("<h2>Results</h2>")
    if len(used) > 1:
        body += _table("fixture set", matrix(result.cases, lambda c: [c.set]))
    body += _table("entry point", matrix(result.cases, lambda c: [c.entry]))
    body += _table("feature", matrix(result.cases, lambda c: [f for f in c.features if f not in ENTRY_TAGS]))
    failed = [c for c in shown if c.status != "xfail"]
    known = [c for c in shown if c.status == "xfail"]
    style, classes = "", {}
    if shown:
        body += [f"<h2 id=\"failed\">Failed cases ({len(failed)}; {len(known)} known failures)</h2>",
                 '<div class="failures">']
        if len(shown) > 1:
            buttons, style, classes = _filters(shown)
            body += buttons
        body += _index(shown, anchors, classes)
    for i, c in enumerate(failed):
        body += _case_section(c, anchors[c.id], explained.pop(c.id, None), classes.get(c.id, ""), i >= OPEN_CASES)
    if known:
        body.append(f"<h2 id=\"xfail\">Known failures (xfail, {len(known)})</h2>")
        for c in known:
            body += _case_section(c, anchors[c.id], explained.pop(c.id, None), classes.get(c.id, ""), True)
    if shown:
        body.append("</div>")
    body += _expectations_section(result, anchors)
    if explained:
        body.append("<h2 id=\"explained\">Other explained cases</h2>")
        body += _explanation_sections(list(explained.values()), anchor_ids(explained, "explain-"))
    return _page(f"Gemma 4 conformance: {name}: {exit_line(code)}", body, style)


# ----------------------------------------------------------------------------------------------
# conformance explain: the error per traced point and row


def _point_label(point) -> str:
    return SHORT.get(point.sub, point.sub)


def heat_map(comparison, caption: str = "") -> list[str]:
    """The comparison (conformance.check.traces.TraceComparison) as an HTML table: a column per point in
    forward order (grouped by layer), a row per compared row (label and role), the background the magma colour
    of log10 of the error; the cells of the first divergence outlined; the colour bar with the floor below."""
    points = [p for p in comparison.points if p.sub != "router.experts"]
    if not points:
        return ['<p class="mut">no point was compared</p>']
    rows = list(comparison.rows)[:MAX_HEAT_ROWS]
    logs = [[_log10(p.errors[i]) for p in points] for i in range(len(rows))]
    finite = [v for r in logs for v in r if v is not None]
    vmax = max([1.0] + finite)
    first = comparison.first_divergence
    boxed = set(first["rows"]) if first else set()
    groups: list[tuple[str, int]] = []
    for p in points:
        key = "" if p.layer is None else f"layer {p.layer}"
        if groups and groups[-1][0] == key and key:
            groups[-1] = (key, groups[-1][1] + 1)
        else:
            groups.append((key, 1))
    head1 = "".join(f'<th class="lay" colspan="{n}">{esc(k.removeprefix("layer "))}</th>' for k, n in groups)
    head2 = "".join(f'<th class="v" title="{esc(p.name)}">{esc(_point_label(p))}</th>' for p in points)
    out = [f'<div class="scroll"><table class="heat" aria-label="{esc(caption or "error per point and row")}">',
           f'<thead><tr><th class="row">layer</th>{head1}</tr><tr><th class="row">row (role)</th>{head2}</tr></thead>'
           "<tbody>"]
    starts = {sum(n for _, n in groups[:k]) for k in range(len(groups))}
    for i, label in enumerate(rows):
        role = comparison.roles[i] if i < len(comparison.roles) else ""
        cells = []
        for j, (p, v) in enumerate(zip(points, logs[i], strict=False)):
            cls = "c" + (" l0" if j in starts else "")
            title = f"{label} ({role}) at {p.name}: " + ("no value" if v is None else f"error {10 ** v:.3g}")
            if first is not None and p.name == first["point"] and label in boxed:
                cls += " first"
                title += " (first divergence)"
            style = "" if v is None else f' style="background:{heat_colour(v, vmax)}"'
            cells.append(f'<td class="{cls if v is not None else cls + " na"}"{style} title="{esc(title)}"></td>')
        out.append(f'<tr><th class="row">{esc(label)} ({esc(role)})</th>{"".join(cells)}</tr>')
    out.append("</tbody></table></div>")
    if len(comparison.rows) > MAX_HEAT_ROWS:
        out.append(f'<p class="mut">the first {MAX_HEAT_ROWS} of {len(comparison.rows)} rows</p>')
    return out + _colour_bar(vmax, comparison.floor)


def _log10(e: float) -> float | None:
    e = float(e)
    if math.isnan(e):
        return None
    return min(math.log10(max(e, 1e-36)), 12.0) if math.isfinite(e) else 12.0


def _colour_bar(vmax: float, floor: float) -> list[str]:
    stops = ", ".join(f"{c} {100 * k / (len(MAGMA) - 1):.1f}%" for k, c in enumerate(MAGMA))

    def pos(v: float) -> float:  # percent along the bar
        return 100 * min(max((v - VMIN) / (vmax - VMIN), 0.0), 1.0)

    ticks = [t for t in (VMIN, -24.0, -16.0, -8.0, 0.0) if t < vmax - 0.08 * (vmax - VMIN)] + [round(vmax, 1)]
    labels = "".join(f'<span style="left:{pos(t):.1f}%">{t:g}</span>' for t in ticks)
    mark = f'<i style="left:{pos(math.log10(max(floor, 1e-36))):.1f}%" title="the floor {floor:.3g}"></i>'
    return [f'<div class="mut" style="font-size:12px">log10 error (the cyan mark: the floor {esc(f"{floor:.3g}")}; '
            "outlined: the first divergence; hatched: no value)</div>",
            f'<div class="bar" style="background:linear-gradient(to right, {stops})">{labels}{mark}</div>']


def _explanation_body(e) -> list[str]:
    out = [f'<p class="msg">{_badge(e.status)} {esc(e.message)}</p>']
    c = e.comparison
    if c is None:
        return out
    first = c.first_divergence
    facts = [("floor", esc(f"{c.floor:.3g}")), ("traced", esc(c.traced)), ("points served", esc(len(e.served))),
             ("first divergence", None if first is None else esc(
                 f"{first['point']} ({SUB_BLOCKS.get(first['sub_block'], first['what'])}) on "
                 f"{', '.join(first['rows'][:8])}{' ...' if len(first['rows']) > 8 else ''}; error "
                 f"{first['error']:.3g}")),
             ("missing points", esc(", ".join(c.missing[:12])) or None),
             ("router", esc("; ".join(f"layer {d['layer']}: other experts for {', '.join(d['rows'])}"
                                      for d in c.router_differs())) or None)]
    out += [_facts(facts)] + heat_map(c, e.id)
    growth = c.growth()
    if growth:
        out.append('<details><summary>worst row error per point from the first divergence</summary><table>'
                   "<thead><tr><th>point</th><th>worst</th></tr></thead><tbody>" + "".join(
                       f'<tr><td class="mono">{esc(g["point"])}</td><td class="n">{esc(fmt(g["worst"]))}</td></tr>'
                       for g in growth) + "</tbody></table></details>")
    if e.returned is not None:
        out += ["<h4>On the case's own returned rows</h4>"] + heat_map(e.returned, e.id + " (returned rows)")
    return out


def _explanation_sections(explanations: Sequence, anchors: dict[str, str]) -> list[str]:
    out = []
    for e in explanations:
        anchor = anchors[e.id]
        out += [f'<section class="case s-{esc(e.status)}" id="{esc(anchor)}">',
                f'<h3>{_badge(e.status)} <a href="#{esc(anchor)}"><code>{esc(e.id)}</code></a></h3>',
                _facts([("set", esc(e.set)), ("kind", esc(e.kind))])] + _explanation_body(e) + ["</section>"]
    return out


def explain_html(explanations: Sequence, *, backend: str | None = None, profile: str | None = None) -> str:
    """The page of ``conformance explain --html``: per explained case (conformance.explain.CaseExplanation) its
    verdict, first divergence and heat map, each in a section ``id="case-<slug>"``."""
    explanations = list(explanations)
    counts = {s: sum(1 for e in explanations if e.status == s)
              for s in ("diverges", "within", "error", "not-claimed", "skipped")}
    line = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no case"
    tone = "bad" if counts["diverges"] or counts["error"] else "ok"
    anchors = anchor_ids(e.id for e in explanations)
    body = [f"<h1>Gemma 4 conformance explain: <code>{esc(backend or '?')}</code></h1>",
            f'<div class="verdict {tone}"><div class="line">{esc(line)}</div><div>{len(explanations)} cases explained'
            + (f"; profile <code>{esc(profile)}</code> (its nmse is the floor)" if profile else "") + "</div></div>",
            "<table class=\"index\"><thead><tr><th>status</th><th>case</th><th>first "
            "divergence</th></tr></thead><tbody>"]
    for e in explanations:
        first = e.first_divergence
        body.append(f"<tr><td>{_badge(e.status)}</td><td><a href=\"#{esc(anchors[e.id])}\"><code>{esc(e.id)}</code>"
                    f"</a></td><td class=\"mono\">{esc(first['point'] if first else '-')}</td></tr>")
    body.append("</tbody></table>")
    unique = {e.id: e for e in explanations}
    body += _explanation_sections(list(unique.values()), anchors)
    return _page(f"Gemma 4 conformance explain: {backend or '?'}: {line}", body)


def write_html(result: RunResult, path: str | Path, explanations: Sequence | None = None) -> Path:
    """Write ``html_report(result, explanations)`` to ``path`` (``-``: standard output)."""
    return write_output(path, html_report(result, explanations))


def write_explain_html(explanations: Sequence, path: str | Path, *, backend: str | None = None,
                       profile: str | None = None) -> Path:
    """Write ``explain_html(...)`` to ``path`` (``-``: standard output)."""
    return write_output(path, explain_html(explanations, backend=backend, profile=profile))
