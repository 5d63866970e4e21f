"""The HTML report (``conformance.report.html``): ``check --html``, the pytest plugin's ``--conformance-html``
and ``explain --html`` write one self-contained page.

* A failing run (a backend that returns row ``last_pos + 1``, with an expectations file that marks one case a
  known failure) renders the verdict, the tables, and every failed case (fail, then xfail) in a section of its
  own with its diagnosis, failing rows, metrics, top-k tokens and the expectation applied.
* Text from a backend (its name, an exception message) is escaped: a ``<script>`` in it never becomes a tag;
  the page loads nothing from outside (no ``src``/``href`` but in-page anchors, a Content-Security-Policy).
* With ``conformance explain``'s results the sections carry a heat map of the error per point and row; the
  explain-only page has one section per explained case.
* ``explain --plot`` without matplotlib refuses before any work (no backend loaded, no JSON written).
* In a real browser (headless Chromium; skipped when it is absent, a failure under
  ``GEMMA4_CONFORMANCE_REQUIRE_ENGINES=1``): the rendered DOM holds the failing case's section and the console
  shows no error, where a page that breaks the same policy does show one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import conformance.report.html as html_module
from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.expectations import parse as parse_expectations
from conformance.check.profiles import PROFILES
from conformance.check.runner import load_sets, run
from conformance.check.traces import ROUTER
from conformance.cli import build_parser, main
from conformance.cli.common import UsageError
from conformance.cli.explain import cmd_explain
from conformance.explain import explain
from conformance.registry import load_backend
from conformance.report.console import ENTRY_TAGS, counts_line, exit_line
from conformance.report.html import (
    MAGMA,
    VMIN,
    anchor_ids,
    esc,
    explain_html,
    heat_colour,
    html_report,
    write_explain_html,
    write_html,
)
from conformance.report.junit import fmt
from conformance.sets.bundled import bundled_sets

pytest_plugins = ["pytester"]

SETS = {p.name: p for p in bundled_sets()}
SHIFT = "conformance.selftest.mutants:ShiftInteriorRow"
SELECT = "e2b-mini/last/plain"
KNOWN = "e2b-mini/last/plain/A/T19/pos9"
FIRST_SHIFTED = "e2b-mini/last/plain/A/T9/pos4"  # an interior last_pos: the mutant returns row 5
EVIL = "<script>alert('x')</script> & <img src=http://evil.example/x.png>"


class EvilBackend(RefimplBackend):
    """The oracle under a name with markup, failing every request with markup in its message."""

    def __init__(self):
        super().__init__()
        self.name = "<script>alert('name')</script>"

    def run(self, request):
        raise RuntimeError(EVIL)


class CountingBackend(RefimplBackend):
    """The oracle, counting how often it is made (the plot refusal must come before)."""

    made = 0

    def __init__(self):
        type(self).made += 1
        super().__init__()


class Page(HTMLParser):
    """The tags (with attributes) and the text of an HTML page."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.text.append(data)

    def ids(self) -> set[str]:
        return {a["id"] for _, a in self.tags if "id" in a}

    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())


@pytest.fixture(scope="module")
def failing():
    """(RunResult, explanations) of the shifted-row mutant on e2b-mini's last:plain cases, one a known failure."""
    backend = load_backend(SHIFT)
    sets = load_sets([SETS["e2b-mini"]])
    expectations = parse_expectations({"entries": [
        {"match": re.escape(KNOWN) + "$", "action": "known-failure", "reason": "a <b>known</b> shift",
         "issue": "https://issues.example/1"},
        {"match": "matches-no-case", "action": "skip", "reason": "never used"}]})
    result = run(backend, sets, PROFILES["exact-f64"], expectations, SELECT)
    failed = {c.id for c in result.cases if c.status in ("fail", "xfail")}
    return result, explain(backend, sets, PROFILES["exact-f64"], ids=failed)


def test_the_page_holds_the_verdict_tables_and_every_failed_case(failing):
    result, _ = failing
    assert result.exit_code == 1
    page = html_report(result)
    doc = Page(page)
    text = doc.all_text()
    assert exit_line(1) in text and counts_line(result) in text and "mutant/shift-interior-row" in text
    assert "exact-f64" in text and "e2b-mini 1.0.0" in text
    heads = [t for t in re.findall(r"<th>([^<]*)</th>", page)]
    assert "entry point" in heads and "feature" in heads
    anchors = anchor_ids(c.id for c in result.cases)
    failed = [c for c in result.cases if c.status in ("fail", "error", "xpass", "xfail")]
    assert {c.status for c in failed} == {"fail", "xfail"} and len(failed) == 4
    sections = {a["id"]: a for t, a in doc.tags if t == "section"}
    for c in failed:
        assert anchors[c.id] in sections, c.id  # every failed case has its own section
        assert f'href="#{anchors[c.id]}"' in page  # and a link from the index
        body = page.split(f'id="{anchors[c.id]}"', 1)[1].split("</section>", 1)[0]
        row = c.first_failing_row
        assert "Diagnosis:" in body and "a shifted row" in body and "Likely B1" in body
        assert f">{row['label']}<" in body and fmt(row["metrics"]["max_abs"]) in body
        assert fmt(row["metrics"]["nmse"]) in body and fmt(row["metrics"]["kl"]) in body
        for i, piece in zip(row["top_ref"], row["top_ref_pieces"], strict=True):
            assert f"{i} {piece!r}".replace("'", "&#x27;").replace("<", "&lt;").replace(">", "&gt;") in body
        assert "<th>oracle top-k</th>" in body and "<th>backend top-k</th>" in body
    passed = [c for c in result.cases if c.status == "pass"]
    assert passed and all(anchors[c.id] not in sections for c in passed)
    # the fail cases come before the known failure
    order = [page.index(f'id="{anchors[c.id]}"') for c in failed]
    assert order[-1] == page.index(f'id="{anchors[KNOWN]}"') and order == sorted(order)


def test_a_filter_by_status_and_feature_without_script(failing):
    """Radio buttons and CSS: one button per status and per feature of the failed cases, with its count; each
    index row and section carries the classes the CSS hides it by; the buttons come first, as siblings."""
    result, _ = failing
    page = html_report(result)
    shown = [c for c in result.cases if c.status in ("fail", "error", "xpass", "xfail")]
    block = page.split('<div class="failures">', 1)[1].split("</div>\n", 1)[0]
    assert block.index('id="show-all"') < block.index('<table class="index">') < block.index("<section")
    labels = dict(re.findall(r'<label for="show-([^"]+)">[^<]*\((\d+)\)</label>', page))
    assert labels["all"] == str(len(shown))
    assert labels["st-fail"] == "3" and labels["st-xfail"] == "1" and "st-error" not in labels
    features = sorted({f for c in shown for f in c.features if f not in ENTRY_TAGS})
    anchors = anchor_ids(c.id for c in shown)
    for i, f in enumerate(features):
        have = [c for c in shown if f in c.features]
        assert labels[f"f-ft{i}"] == str(len(have)), f
        assert f'<label for="show-f-ft{i}">{esc(f)} (' in page
        assert f"#show-f-ft{i}:checked~section.case:not(.ft{i}){{display:none}}" in page
        for c in shown:  # the section and the index row of a case carry ft<i> exactly when it has the feature
            section = re.search(rf'<section class="([^"]*)" id="{re.escape(anchors[c.id])}"', page).group(1)
            row = re.search(rf'<tr class="([^"]*)"><td><span[^>]*>[A-Z]+</span></td><td><a href="#'
                            rf'{re.escape(anchors[c.id])}"', page).group(1)
            assert (f"ft{i}" in section.split()) == (f in c.features) == (f"ft{i}" in row.split()), (c.id, f)
    assert "#show-st-fail:checked~table.index tr.c:not(.s-fail)" in page
    assert "<script" not in page.lower()


def test_past_the_first_cases_the_details_are_collapsed(failing, monkeypatch):
    result, _ = failing
    monkeypatch.setattr(html_module, "OPEN_CASES", 1)
    page = html_report(result)
    failed = [c for c in result.cases if c.status == "fail"]
    anchors = anchor_ids(c.id for c in result.cases)
    bodies = [page.split(f'id="{anchors[c.id]}"', 1)[1].split("</section>", 1)[0] for c in failed]
    summary = "<details><summary>failing rows, metrics, expectation, what the backend executed</summary>"
    assert summary not in bodies[0] and "Failing rows" in bodies[0]
    assert all(summary in b and b.index(summary) < b.index("Failing rows") for b in bodies[1:])
    assert all("Diagnosis:" in b.split(summary)[0] for b in bodies[1:])  # the diagnosis stays in view


def test_the_expectations_applied_are_listed(failing):
    result, _ = failing
    page = html_report(result)
    body = page.split('id="expectations"', 1)[1]
    assert "a &lt;b&gt;known&lt;/b&gt; shift" in page and "<b>known</b>" not in page
    assert KNOWN in body and "known failure (entry 0" in body
    assert "1 entry matched no case" in body and "matches-no-case" in body and "never used" in body
    known = page.split(f'id="{anchor_ids([KNOWN])[KNOWN]}"', 1)[1].split("</section>", 1)[0]
    assert "Expectations applied" in known and "issue https://issues.example/1" in known


def test_text_from_a_backend_is_escaped_and_nothing_is_loaded(tmp_path):
    result = run(EvilBackend(), load_sets([SETS["e2b-mini"]]), PROFILES["exact-f64"], select="full/A/T9$")
    (case,) = result.cases
    assert case.status == "error" and EVIL in case.message
    path = write_html(result, tmp_path / "r.html")
    assert path == tmp_path / "r.html"
    page = path.read_text(encoding="utf-8")
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &lt;img" in page
    assert "&lt;script&gt;alert(&#x27;name&#x27;)&lt;/script&gt;" in page  # the backend's name
    doc = Page(page)
    assert "RuntimeError" in doc.all_text()  # the traceback's section
    refs = [(t, k, v) for t, a in doc.tags for k, v in a.items() if k in ("src", "href", "srcset", "action", "data")]
    assert refs and all(k == "href" and v.startswith("#") for _, k, v in refs)
    assert not any(t in ("link", "script", "iframe", "object", "embed", "img") for t, _ in doc.tags)
    assert "url(" not in page and "@import" not in page
    csp = [a["content"] for t, a in doc.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp == ["default-src 'none'; style-src 'unsafe-inline'"]


def test_explanations_add_a_heat_map_to_their_cases(failing):
    result, explanations = failing
    plain = html_report(result)
    assert 'class="heat"' not in plain
    page = html_report(result, explanations)
    anchors = anchor_ids(c.id for c in result.cases)
    for e in explanations:
        assert e.status == "diverges"
        body = page.split(f'id="{anchors[e.id]}"', 1)[1].split("</section>", 1)[0]
        assert body.count('<table class="heat"') == 1
        heat = body.split('<table class="heat"', 1)[1].split("</table>", 1)[0]
        points = [p for p in e.comparison.points if p.sub != ROUTER]
        cells = re.findall(r'<td class="c[^"]*"', heat)
        assert len(cells) == len(points) * len(e.comparison.rows)
        first = e.first_divergence
        assert len(re.findall(r'<td class="c[^"]* first"', heat)) == len(first["rows"])
        assert f"first divergence</dt><dd>{first['point']}" in body
        for label in e.comparison.rows:
            assert f">{label} (" in heat
        assert "the floor 1e-18" in body  # the colour bar's mark
    assert 'id="explained"' not in page  # every explanation found its case


def test_the_explain_page_has_a_section_per_case(failing):
    _, explanations = failing
    page = explain_html(explanations, backend="mutant/shift-interior-row", profile="exact-f64")
    assert html_report(None, explanations) == explain_html(explanations)  # a check page without a run
    doc = Page(page)
    anchors = anchor_ids(e.id for e in explanations)
    assert set(anchors.values()) <= doc.ids()
    assert f"{len(explanations)} diverges" in doc.all_text()
    assert page.count('<table class="heat"') == len(explanations)


def test_colours_and_anchors():
    assert heat_colour(VMIN, 1.0) == MAGMA[0] and heat_colour(1.0, 1.0) == MAGMA[-1]
    assert heat_colour(-100.0, 1.0) == MAGMA[0] and heat_colour(50.0, 1.0) == MAGMA[-1]
    lum = [sum(int(heat_colour(v, 1.0)[i:i + 2], 16) for i in (1, 3, 5)) for v in range(-34, 2)]
    assert lum == sorted(lum) and lum[0] < lum[-1]  # darker is smaller
    ids = anchor_ids(["a/b", "a-b", "a b", "<x>\"", "a/b"])
    assert len(set(ids.values())) == 4 and ids["a/b"] == "case-a-b"
    assert all(re.fullmatch(r"case-[A-Za-z0-9_.-]+", v) for v in ids.values())


def _explain(argv: list[str], html: str) -> int:
    """``conformance explain ARGV --html HTML``."""
    return cmd_explain(build_parser().parse_args(["explain", *argv, "--html", html]))


def test_explain_html_writes_the_page(tmp_path, capsys):
    out = tmp_path / "e.html"
    argv = ["--backend", SHIFT, "--fixtures", str(SETS["e2b-mini"]), "--match", "last/plain/A/T7/pos3$", "-q"]
    assert _explain(argv, str(out)) == 1
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.err and "diverges: first leaves the floor" in captured.out
    page = out.read_text(encoding="utf-8")
    slug = anchor_ids(["e2b-mini/last/plain/A/T7/pos3"])["e2b-mini/last/plain/A/T7/pos3"]
    assert f'id="{slug}"' in page and '<table class="heat"' in page and "1 diverges" in page
    with pytest.raises(UsageError, match="--html: the directory"):
        _explain(argv, str(tmp_path / "no" / "such" / "e.html"))
    with pytest.raises(UsageError, match="--html needs a file name"):
        _explain(argv, "-")


def test_explain_plot_without_matplotlib_refuses_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    CountingBackend.made = 0
    report = tmp_path / "e.json"
    code = main(["explain", "--backend", "test_html_report:CountingBackend", "--fixtures", str(SETS["e2b-mini"]),
                 "--match", "full/A/T9$", "-q", "--json", str(report), "--plot", str(tmp_path / "e.png")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == "conformance: error: --plot needs matplotlib: pip install 'gemma4-conformance[plot]'\n"
    assert captured.out == ""
    assert CountingBackend.made == 0 and not report.exists() and not (tmp_path / "e.png").exists()


# ----------------------------------------------------------------------------------------------
# in a real browser


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("GEMMA4_CONFORMANCE_REQUIRE_ENGINES") == "1":
            pytest.fail("GEMMA4_CONFORMANCE_REQUIRE_ENGINES=1, but chromium is not installed (apt-get install "
                        "chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def _browse(chromium: str, page: Path, tmp_path: Path, *extra: str) -> tuple[str, list[str]]:
    """(the rendered DOM, the console's messages) of ``page`` in headless Chromium."""
    proc = subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox",
                           f"--user-data-dir={tmp_path / 'ud'}", "--enable-logging=stderr", "--v=0", *extra,
                           "--dump-dom", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


def test_the_page_renders_in_chromium_without_console_errors(failing, tmp_path):
    chromium = _chromium()
    result, explanations = failing
    path = write_html(result, tmp_path / "report.html", explanations)
    dom, console = _browse(chromium, path, tmp_path)
    assert console == []
    rendered = Page(dom)
    anchors = anchor_ids(c.id for c in result.cases)
    failed = [c for c in result.cases if c.status in ("fail", "xfail")]
    assert {anchors[c.id] for c in failed} <= rendered.ids()
    assert "a shifted row" in rendered.all_text() and exit_line(1) in rendered.all_text()
    # the capture sees a broken page: the same policy, one external image
    control = tmp_path / "control.html"
    control.write_text(path.read_text(encoding="utf-8").replace("</main>", '<img src="https://example.org/x.png"></main>'),
                       encoding="utf-8")
    _, console = _browse(chromium, control, tmp_path)
    assert any("Content Security Policy" in line for line in console)


def test_check_html_renders_the_failing_run_in_chromium(tmp_path, capsys):
    # the command line end to end: check --html on a failing run, opened in the browser
    page = tmp_path / "check.html"
    code = main(["check", "-q", "--backend", SHIFT, "--fixtures", str(SETS["e2b-mini"]), "-k", "last:plain",
                 "--html", str(page)])
    assert code == 1 and f"wrote HTML report {page}" in capsys.readouterr().err
    dom, console = _browse(_chromium(), page, tmp_path)
    assert console == []
    rendered = Page(dom)
    assert anchor_ids([FIRST_SHIFTED])[FIRST_SHIFTED] in rendered.ids()
    assert "Likely B1" in rendered.all_text() and exit_line(1) in rendered.all_text()


def test_the_pytest_plugin_writes_the_same_page(tmp_path, pytester):
    ini = pytester.makeini("[pytest]\n")
    page = tmp_path / "plugin.html"
    result = pytester.runpytest("-p", "no:cacheprovider", "-c", str(ini), "--rootdir", str(pytester.path),
                                "--conformance-backend", SHIFT, "--conformance-fixtures", str(SETS["e2b-mini"]),
                                "-k", "last:plain", "--conformance-html", str(page))
    assert result.ret == 1
    assert f"conformance: HTML report written to {page}" in result.stdout.str()
    doc = Page(page.read_text(encoding="utf-8"))
    assert anchor_ids([FIRST_SHIFTED])[FIRST_SHIFTED] in doc.ids() and "Likely B1" in doc.all_text()


def test_the_page_has_a_screenshot(failing, tmp_path):
    chromium = _chromium()
    result, explanations = failing
    path = write_explain_html(explanations, tmp_path / "explain.html", backend="b", profile="exact-f64")
    shot = tmp_path / "shot.png"
    proc = subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox",
                           f"--user-data-dir={tmp_path / 'ud'}", f"--screenshot={shot}", "--window-size=1280,1600",
                           path.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == 1280 and int.from_bytes(data[20:24], "big") == 1600
    assert len(data) > 50_000  # a page with tables and heat maps, not a blank one
