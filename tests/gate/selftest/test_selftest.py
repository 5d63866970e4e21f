"""``conformance selftest``: the gate run against deliberately broken backends (mutants).

The first tests use stand-in mutants written here (subclasses of the refimpl backend, float64) on a
handful of bundled cases, so they are fast and do not depend on ``conformance.mutants``. The last
test runs the real mutants of ``numpy-engine`` (``conformance.mutants.MUTANTS``) on a subset of the
bundled cases chosen so that every mutant is killed, and checks each is killed by a matching check.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from conformance import selftest as st
from conformance.backends.refimpl_backend import RefimplBackend
from conformance.cli import main
from conformance.selftest.video_mutants import VIDEO_SETS
from conformance.sets import bundled_sets
from refimpl.threads import cores

CLOSENESS = frozenset({"max_abs", "max_rel", "nmse", "cosine", "kl", "kl_mean", "delta_p"})
# two full forwards, a final and an interior last-logits row, an interior prefill row: 5 cases
FEW = r"^e2b-mini/(full/|last/plain/A/T7/|prefill/C/T19/rows-middle$)"


# ----------------------------------------------------------------------------------------------
# stand-in mutants


class ShiftInteriorRow(RefimplBackend):
    """B1: on interior last-logits rows, answers row i+1."""

    def __init__(self):
        super().__init__()
        self.name = "shift-interior-row"

    def run(self, request):
        if request.kind == "last" and request.last_pos < len(request.tokens) - 1:
            request = dataclasses.replace(request, last_pos=request.last_pos + 1)
        return super().run(request)


def _uncap(model, logits):
    cap = model.cfg.final_logit_softcapping
    x = np.asarray(logits, dtype=np.float64)
    return cap * np.arctanh(x / cap) if cap else x


class DropSoftcapLast(RefimplBackend):
    """B2: the single-row last-logits path drops the final softcap."""

    def __init__(self):
        super().__init__()
        self.name = "drop-softcap-last"

    def run(self, request):
        resp = super().run(request)
        if request.kind == "last":
            resp = dataclasses.replace(resp, logits=_uncap(self.model, resp.logits))
        return resp


class DropSoftcapFullAndShift(ShiftInteriorRow):
    """Two bugs: the full forward drops the softcap (closeness; the first cases in fixture order) and
    interior rows are shifted (identity)."""

    def run(self, request):
        resp = super().run(request)
        if request.kind == "full":
            resp = dataclasses.replace(resp, logits=_uncap(self.model, resp.logits))
        return resp


class RaisesOnLast(RefimplBackend):
    def run(self, request):
        if request.kind == "last":
            raise RuntimeError("boom")
        return super().run(request)


class Correct(RefimplBackend):
    pass


@dataclass(frozen=True)
class StandIn:
    """The interface of conformance.mutants.Mutant."""

    name: str
    breaks: str
    bug_class: str
    expected_checks: frozenset[str] | None
    cls: Any

    def backend(self):
        return self.cls()


SHIFT = StandIn("shift-interior-row", "interior last-logits rows answer row i+1", "B1", frozenset({"identity"}),
                ShiftInteriorRow)
SOFTCAP = StandIn("drop-softcap-last", "the single-row head drops the final softcap", "B2", CLOSENESS,
                  DropSoftcapLast)
CORRECT = StandIn("correct", "nothing (a correct engine)", "none", None, Correct)


def _control():
    return RefimplBackend()


@pytest.fixture(scope="module")
def sets():
    return bundled_sets()


@pytest.fixture(scope="module")
def counted(sets):
    """One self-test of the three stand-ins, counting each mutant's backend.run calls."""
    calls: dict[str, int] = {}

    @dataclass(frozen=True)
    class Counting(StandIn):
        def backend(self):
            b = self.cls()
            inner = b.run

            def run(request):
                calls[self.name] = calls.get(self.name, 0) + 1
                return inner(request)

            b.run = run
            return b

    mutants = [Counting(m.name, m.breaks, m.bug_class, m.expected_checks, m.cls) for m in (SHIFT, SOFTCAP, CORRECT)]
    result = st.run_selftest(sets, mutants, select=FEW, control=_control())
    return result, calls


def _by_name(result):
    return {m.name: m for m in result.mutants}


# ----------------------------------------------------------------------------------------------
# verdicts


def test_control_passes_and_every_profile_is_graded(counted):
    result, _ = counted
    assert result.cases == 5
    assert result.valid and result.control.passed
    assert result.control.profile == "exact-f64" and result.control.verdict.cases_run == 5
    assert result.profiles == ["fp32", "bf16", "q8"] and result.primary == "fp32"
    for m in result.mutants:
        assert list(m.verdicts) == ["fp32", "bf16", "q8"]
        assert all(v.cases_run == 5 for v in m.verdicts.values())


def test_shifted_row_is_killed_by_row_identity(counted):
    m = _by_name(counted[0])["shift-interior-row"]
    assert m.killed and m.matching and m.ok and m.problem() is None
    case, check = m.caught_by
    assert check == "identity"
    assert case == "e2b-mini/last/plain/A/T7/pos3"  # the first interior row in fixture order
    assert m.verdict.checks == {"identity": 1} and m.verdict.failing_cases == 1
    # the nearest-row rule holds at every profile
    assert not m.survives("bf16") and not m.survives("q8")


def test_dropped_softcap_is_killed_by_closeness_not_token_agreement(counted):
    m = _by_name(counted[0])["drop-softcap-last"]
    assert m.killed and m.matching
    case, check = m.caught_by
    assert check in CLOSENESS and check != "top1"
    assert m.verdict.check in CLOSENESS
    assert set(m.verdict.checks) <= CLOSENESS
    assert case == "e2b-mini/last/plain/A/T7/pos6"  # the first last-logits case
    assert m.verdict.failing_cases == 2


def test_a_correct_mutant_survives_and_fails_the_selftest(counted):
    result, _ = counted
    m = _by_name(result)["correct"]
    assert not m.killed and not m.matching and m.survives("fp32") and m.survives("bf16") and m.survives("q8")
    assert "SURVIVED" in m.problem()
    assert result.exit_code == 1
    assert result.problems() == [m.problem()]
    assert result.survivors("fp32") == ["correct"]
    table = st.console_summary(result)
    row = next(line for line in table.splitlines() if line.startswith("correct "))
    assert "SURVIVED" in row and row.split()[-2:] == ["survives", "survives"]
    assert "SELF-TEST FAILED" in table and "exit 1" in table


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork, on Linux only")
def test_forked_workers_give_the_verdicts_of_one_process(sets):
    """``workers``: each mutant in a process forked after the control; the same verdicts, in the same order, as
    one process running them one after the other, and a mutant that raises is still a broken mutant."""
    class Broken(StandIn):
        def backend(self):
            raise ImportError("no such engine")

    mutants = [SHIFT, SOFTCAP, CORRECT, Broken("broken", "cannot be built", "B1", None, None)]
    one = st.run_selftest(sets, mutants, select=FEW, control=_control())
    seen = []
    forked = st.run_selftest(sets, mutants, select=FEW, control=_control(), workers=3,
                             progress=lambda done, total, label, res: seen.append((done, label)))

    def verdicts(result):
        return [(m.name, m.error is None, {p: (v.cases_run, v.failing_cases, v.first_case, v.check, v.checks)
                                           for p, v in m.verdicts.items()}, m.run_calls) for m in result.mutants]

    assert verdicts(forked) == verdicts(one)
    assert [m.name for m in forked.mutants] == ["shift-interior-row", "drop-softcap-last", "correct", "broken"]
    assert forked.mutants[3].error == "ImportError: no such engine" and forked.exit_code == one.exit_code == 1
    assert forked.mutants[0].ok and forked.mutants[1].ok and forked.mutants[0].duration > 0
    assert seen[-1] == (5 * forked.cases, "broken")  # the progress reaches the total: the control and 4 mutants


def test_profiles_are_regraded_without_rerunning_the_backend(counted):
    result, calls = counted
    # one backend.run per case, not one per case and profile
    assert calls == {"shift-interior-row": 5, "drop-softcap-last": 5, "correct": 5}
    assert all(m.run_calls == 5 for m in result.mutants)


def test_a_kill_by_a_non_matching_check_fails_the_selftest(sets):
    wrong = dataclasses.replace(SHIFT, name="shift-expects-closeness", expected_checks=CLOSENESS)
    result = st.run_selftest(sets, [wrong, SHIFT], profiles=("fp32",), select=FEW, control=_control())
    m, ok = result.mutants
    assert m.killed and not m.matching and not m.ok
    assert "only by identity (1)" in m.problem()
    assert ok.ok
    assert result.exit_code == 1 and result.problems() == [m.problem()]
    text = st.console_summary(result)
    row = next(line for line in text.splitlines() if line.startswith("shift-expects-closeness"))
    assert "identity (!)" in row and "killed" in row
    assert "not by a check that matches the bug" in text


def test_matching_kill_is_reported_even_when_an_earlier_case_fails_another_check(sets):
    both = StandIn("two-bugs", "full forward uncapped and interior rows shifted", "B1", frozenset({"identity"}),
                   DropSoftcapFullAndShift)
    result = st.run_selftest(sets, [both], profiles=("fp32",), select=FEW, control=_control())
    (m,) = result.mutants
    assert m.verdict.first_case == "e2b-mini/full/A/T9" and m.verdict.check in CLOSENESS
    assert m.matching and m.caught_by == ("e2b-mini/last/plain/A/T7/pos3", "identity")
    assert result.exit_code == 0
    j = m.to_json()
    assert j["check"] == "identity" and j["first_failure"]["case"] == "e2b-mini/full/A/T9"


def test_a_mutant_whose_backend_raises_is_killed_with_error(sets):
    raises = StandIn("raises", "raises on last requests", "B5", None, RaisesOnLast)
    strict = dataclasses.replace(raises, name="raises-strict", expected_checks=frozenset({"identity"}))
    result = st.run_selftest(sets, [raises, strict], profiles=("fp32",), select=FEW, control=_control())
    a, b = result.mutants
    assert a.killed and a.matching and a.caught_by[1] == "error" and a.verdict.failing_cases == 2
    assert b.killed and not b.matching


def test_a_broken_mutant_fails_the_selftest_and_the_rest_still_run(sets):
    class Broken(StandIn):
        def backend(self):
            raise ImportError("no such engine")

    broken = Broken("broken", "cannot be built", "B1", None, None)
    result = st.run_selftest(sets, [broken, SHIFT], profiles=("fp32", "bf16"), select=FEW, control=_control())
    b, s = result.mutants
    assert b.error == "ImportError: no such engine" and not b.killed and not b.survives("bf16")
    assert s.ok
    assert result.exit_code == 1 and "could not run" in result.problems()[0]
    assert "ERROR" in st.format_table(result)


def test_a_failing_control_invalidates_the_run(sets):
    ran = []

    class Spy(StandIn):
        def backend(self):
            ran.append(self.name)
            return super().backend()

    result = st.run_selftest(sets, [Spy(*dataclasses.astuple(SHIFT))], select=FEW, control=ShiftInteriorRow())
    assert not result.valid and not result.control.passed
    assert ran == [] and result.mutants == []  # the mutants are not run
    assert result.exit_code == 1
    (problem,) = result.problems()
    assert "control backend 'shift-interior-row' failed 1 of 5" in problem and "proves nothing" in problem
    text = st.console_summary(result)
    assert "SELF-TEST INVALID" in text and "exit 1: self-test invalid" in text
    assert "FAILED" in next(line for line in text.splitlines() if line.startswith("(control)"))


def test_mutant_selection_by_name_or_bug_class():
    ms = [SHIFT, SOFTCAP, CORRECT]
    assert st.select_mutants(ms, None) == ms
    assert st.select_mutants(ms, "softcap") == [SOFTCAP]
    assert st.select_mutants(ms, "B1") == [SHIFT]
    assert st.select_mutants(ms, re.compile("^(correct|shift)")) == [SHIFT, CORRECT]


# ----------------------------------------------------------------------------------------------
# command line


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(st, "load_mutants", lambda: (SHIFT, SOFTCAP, CORRECT))
    monkeypatch.setattr(st, "load_equivalents", lambda: ())
    monkeypatch.setattr(st, "load_rewrites", lambda: ())
    monkeypatch.setattr(st, "default_control", lambda: (_control(), None))


def test_cli_table_json_and_exit_code(standins, tmp_path, capsys):
    out_json = tmp_path / "selftest.json"
    argv = ["selftest", "--match", FEW, "--json", str(out_json)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1  # 'correct' survives
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("mutant"))
    assert header.split() == ["mutant", "bug", "class", "breaks", "fp32", "check", "first", "case", "failing",
                              "bf16", "q8"]
    shift = next(line for line in lines if line.startswith("shift-interior-row"))
    assert "killed" in shift and "identity" in shift and "e2b-mini/last/plain/A/T7/pos3" in shift and "1/5" in shift
    assert "would survive at bf16: correct (1 of 3)" in out
    assert "mutant shift-interior-row [B1]: killed by identity" in err  # progress, one line per backend
    assert f"wrote JSON report {out_json}" in err

    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "gemma4-conformance/selftest" and doc["schema_version"] == 1
    assert doc["exit_code"] == 1 and doc["valid"] is True and doc["command"] == argv
    assert doc["profiles"] == ["fp32", "bf16", "q8"] and doc["primary_profile"] == "fp32"
    assert doc["cases"] == 5 and doc["select"] == f"--match {FEW!r}"
    assert {s["name"]: s["cases_selected"] for s in doc["fixture_sets"] if s["cases_selected"]} == {"e2b-mini": 5}
    assert doc["control"]["passed"] is True and doc["control"]["profile"] == "exact-f64"
    assert doc["control"]["cases_run"] == 5 and doc["control"]["failing_cases"] == 0
    assert doc["survivors"] == {"fp32": ["correct"], "bf16": ["correct"], "q8": ["correct"]}
    assert len(doc["problems"]) == 1 and "'correct'" in doc["problems"][0]
    mutants = {m["name"]: m for m in doc["mutants"]}
    assert list(mutants) == ["shift-interior-row", "drop-softcap-last", "correct"]
    keys = {"name", "bug_class", "breaks", "expected_checks", "killed", "matching", "ok", "check", "first_case",
            "failing_cases", "cases_run", "first_failure", "checks", "survives", "profiles", "run_calls",
            "duration", "error", "problem"}
    for m in doc["mutants"]:
        assert keys <= set(m)
        assert set(m["profiles"]) == {"fp32", "bf16", "q8"}
        assert m["run_calls"] == 5
    s = mutants["shift-interior-row"]
    assert s["killed"] and s["matching"] and s["check"] == "identity" and s["expected_checks"] == ["identity"]
    assert s["first_case"] == "e2b-mini/last/plain/A/T7/pos3" and s["failing_cases"] == 1
    assert s["survives"] == {"fp32": False, "bf16": False, "q8": False}
    assert s["profiles"]["bf16"]["killed"] is True and s["profiles"]["bf16"]["check"] == "identity"
    c = mutants["drop-softcap-last"]
    assert c["check"] in CLOSENESS and c["checks"] and set(c["checks"]) <= CLOSENESS
    assert mutants["correct"]["killed"] is False and mutants["correct"]["check"] is None
    assert mutants["correct"]["expected_checks"] is None


def test_cli_exit_zero_when_every_mutant_is_killed_by_a_matching_check(standins, capsys):
    code = main(["selftest", "--match", FEW, "--mutant", "shift|softcap", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, out
    assert err == ""
    assert "every mutant killed at fp32 by a matching check" in out and "exit 0: self-test passed" in out
    assert "correct" not in out


@pytest.mark.parametrize("argv, code, message", [
    (["selftest", "--match", "("], 2, "--match: not a valid regular expression"),
    (["selftest", "--mutant", "("], 2, "--mutant: not a valid regular expression"),
    (["selftest", "--mutant", "nope"], 2, "matches none of the 3 mutants: shift-interior-row, drop-softcap-last"),
    (["selftest", "-k", "no-such-case"], 5, "no case selected"),
    (["selftest", "--fixtures", "/no/such/dir"], 2, "--fixtures: no such directory"),
    (["selftest", "--workers", "0"], 2, "--workers must be at least 1, got 0"),
])
def test_cli_usage_errors(standins, capsys, argv, code, message):
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_cli_broken_fixture_set_exits_3(standins, tmp_path, capsys):
    import shutil

    src = next(p for p in bundled_sets() if p.name == "e2b-mini")
    dst = tmp_path / "e2b-mini"
    shutil.copytree(src, dst)
    cases = dst / "cases.json"
    cases.write_text(cases.read_text().replace("e2b-mini/full/A/T9", "e2b-mini/full/A/T99", 1))
    assert main(["selftest", "--fixtures", str(dst), "-q"]) == 3
    assert "fixture integrity" in capsys.readouterr().err


def test_cli_control_failure_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(st, "load_mutants", lambda: (SHIFT,))
    monkeypatch.setattr(st, "load_equivalents", lambda: ())
    monkeypatch.setattr(st, "load_rewrites", lambda: ())
    monkeypatch.setattr(st, "default_control", lambda: (ShiftInteriorRow(), None))
    assert main(["selftest", "--match", FEW, "-q"]) == 1
    out = capsys.readouterr().out
    assert "SELF-TEST INVALID" in out and "the mutants were not run" in out


def test_cli_help_lists_selftest(capsys):
    assert main(["--help"]) == 0
    assert "selftest" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# the real mutants of numpy-engine

# One case of each request family on the all-features set (every model feature at once): a full
# forward, final and interior rows of the plain and embeddings last-logits entries, output-row prefill
# without and with micro-batches, "none, then the last", two chunk plans and the three packs. Found
# from a full run (conformance selftest --json): every mutant is killed here by at least two cases
# with a matching check. 14 cases x 25 backends take about 10 s.
REAL_SUBSET = (r"^all-features/(full/B/T19|last/(plain|embeddings)/[AC]/T19/pos(9|18)"
               r"|prefill/[AB]/T19/rows-middle\+last(/ub5)?|prefill/B/T20/none-then-last-17\+3"
               r"|prefill/./T2[01]/chunks|multi/)")


def _assert_every_mutant_killed_by_a_matching_check(result, mutants):
    assert result.valid, result.problems()
    assert result.control.backend == "numpy-engine" and result.control.note is None
    assert [m.name for m in result.mutants] == [m.name for m in mutants]
    for m in result.mutants:
        case, check = m.caught_by
        assert m.killed and m.matching, m.problem()
        assert m.expected_checks is None or check in m.expected_checks, (m.name, check)
        # one backend.run per case of the sets it runs on (its kill sets, or all), graded three times
        runs_on = [d["cases_selected"] for d in result.sets if not m.kill_sets or d["name"] in m.kill_sets]
        assert m.run_calls == sum(runs_on)
    assert result.problems() == [] and result.exit_code == 0


def test_real_mutants_are_all_killed_at_fp32_by_a_matching_check(sets):
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    mutants = [m for m in mutants_mod.MUTANTS if not m.kill_sets]  # the image mutants need the image sets
    assert len({m.bug_class for m in mutants}) >= 8
    result = st.run_selftest(sets, mutants, select=REAL_SUBSET)
    assert result.cases == 14
    _assert_every_mutant_killed_by_a_matching_check(result, mutants)
    by = _by_name(result)
    # the two examples: a shifted row by row identity, a dropped softcap by closeness
    assert by["shift-interior-row"].caught_by[1] == "identity"
    softcap = [m for m in result.mutants if m.bug_class == "B2"]
    assert softcap and all(m.caught_by[1] in CLOSENESS for m in softcap)
    assert all(set(m.verdict.checks) <= CLOSENESS for m in softcap)  # never top1/topk


def test_equivalent_mutant_is_caught_at_exact_f64_and_reported(sets):
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    equivalents = st.select_equivalents(st.load_equivalents(), None)
    assert [m.name for m, _ in equivalents] == list(mutants_mod.EQUIVALENT)
    result = st.run_selftest(sets, [], select=REAL_SUBSET, equivalents=equivalents)
    (m,) = result.mutants
    assert m.equivalent and not m.killed  # invisible at fp32 ...
    assert m.verdicts["exact-f64"].killed  # ... but caught at exact-f64
    assert result.problems() == [] and result.exit_code == 0
    assert "equivalent*" in st.format_table(result)


def _missing_kill_sets(mutants_mod, mutants=None) -> set[str]:
    """The kill sets the mutants (default: all) declare that are not bundled (yet)."""
    bundled = {p.name for p in bundled_sets()}
    return {s for m in (mutants_mod.MUTANTS if mutants is None else mutants) for s in m.kill_sets} - bundled


def _image_mutants(mutants_mod) -> list:
    return [m for m in mutants_mod.MUTANTS if set(m.kill_sets) & set(mutants_mod.IMAGE_SETS)]


def _audio_mutants(mutants_mod) -> list:
    return [m for m in mutants_mod.MUTANTS if mutants_mod.AUDIO_SET in m.kill_sets]


WORKERS = min(8, max(2, cores()))  # the full self-test's mutants at a time (forked processes)


@pytest.mark.slow  # 6.6 of the suite's 14.8 minutes; the subsets below kill every mutant (docs/testing.md)
def test_real_mutants_full_selftest(tmp_path, capsys):
    """The issue's claim, on every bundled case, in two runs: the mutants of the forward on every case but the
    MTP ones (whose target rows take the prefill path the other cases kill them on already, and which cost a
    drafter and verification rounds each), then the MTP mutants on their MTP sets (``conformance selftest``
    runs them all at once)."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    mtp = [m.name for m in mutants_mod.MUTANTS if set(m.kill_sets) & set(mutants_mod.MTP_SETS)]
    others = [m.name for m in mutants_mod.MUTANTS if m.name not in mtp] + list(mutants_mod.EQUIVALENT)
    docs = []
    for names, cases in ((others, r"^(?!.*/mtp/)"), (mtp, r"/mtp/")):
        out_json = tmp_path / f"selftest-{len(docs)}.json"
        argv = ["selftest", "-q", "--json", str(out_json), "--match", cases, "--workers", str(WORKERS),
                "--mutant", "^(" + "|".join(map(re.escape, names)) + ")$"]
        assert main(argv) == 0, capsys.readouterr().out
        docs.append(json.loads(out_json.read_text()))
    assert all(d["exit_code"] == 0 and d["control"]["passed"] for d in docs)
    assert docs[0]["cases"] >= 462 and docs[1]["cases"] == 144
    assert {m["name"] for d in docs for m in d["mutants"]} == {m.name for m in mutants_mod.MUTANTS} | set(
        mutants_mod.EQUIVALENT)
    regular = [m for d in docs for m in d["mutants"] if m["equivalent"] is None]
    assert len(regular) >= 50 and all(m["ok"] and m["killed"] for m in regular)
    assert all(m["problem"] is None for d in docs for m in d["mutants"])


# ----------------------------------------------------------------------------------------------
# the image mutants: only the bundled image sets can kill them


def test_image_mutants_declare_the_sets_that_kill_them():
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    image = {m.name: m for m in _image_mutants(mutants_mod)}
    assert image["soft-tokens-scaled"].kill_sets == ("e2b-vision-mini", "31b-vision-mini", "12b-mini")
    assert image["ple-placeholder-row"].kill_sets == ("e2b-vision-mini",)
    for name in ("vision-blocks-on-full-layers", "vision-blocks-missing", "vision-window-unclamped",
                 "image-split-across-ubatches"):  # every vision-block set: the 31B's tower and Gemma 4 Unified
        assert image[name].kill_sets == ("31b-vision-mini", "12b-mini"), name
    assert len(image) == 6


def test_a_survivor_without_its_kill_sets_is_told_so(sets):
    """A text-only selection cannot kill an image mutant; the self-test fails (a survivor is a survivor)
    and says which sets were needed."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    m = next(x for x in mutants_mod.MUTANTS if x.name == "vision-blocks-missing")
    result = st.run_selftest(sets, [m], profiles=("fp32",), select=FEW)
    (r,) = result.mutants
    assert not r.killed and r.kill_sets == ("31b-vision-mini", "12b-mini") and r.sets_run == ("e2b-mini",)
    assert "SURVIVED" in r.problem()
    assert ("only the fixture set(s) 31b-vision-mini, 12b-mini can kill it, and none of their cases was selected"
            in r.problem())
    assert r.to_json()["kill_sets"] == ["31b-vision-mini", "12b-mini"]
    assert result.exit_code == 1


# per image set: a row inside the image block and one right after it (last:embeddings), and an
# output-row prefill with image and last rows; a full run (60 image cases) kills the four image mutants in
# 60, 30, 14 and 30 cases; blocks-on-full-layers only by rows inside a block, as the full layer is last
IMAGE_SUBSET = (r"^(?:(e2b|31b)-vision-mini/(last/embeddings/I0/T70/pos(6|37)|prefill/I0/T76/rows-image\+last)"
                r"|12b-mini/(last/embeddings/I0/T71/pos(6|38)|prefill/I0/T77/rows-image\+last))$")


def test_image_mutants_are_killed_by_their_bundled_sets(sets):
    """Each image mutant on the image cases of the bundled image sets (skipped until they exist)."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    image = _image_mutants(mutants_mod)
    missing = _missing_kill_sets(mutants_mod, image)
    if missing:
        pytest.skip(f"bundled image sets not there yet: {', '.join(sorted(missing))}")
    result = st.run_selftest(sets, image, profiles=("fp32",), select=IMAGE_SUBSET)
    assert result.cases == 9
    _assert_every_mutant_killed_by_a_matching_check(result, image)
    for m in result.mutants:  # killed on every set it declares, and only there
        killed_on = {case.split("/")[0] for case, _ in m.verdict.failing}
        assert killed_on == set(m.kill_sets), (m.name, killed_on)
        assert m.verdict.failing_cases >= 2 * len(m.kill_sets), m.name


# ----------------------------------------------------------------------------------------------
# the audio mutants: only the bundled audio set can kill them

# an audio row inside the first clip, a row inside the second clip (both last:embeddings, with decode),
# and a chunked prefill split at a block boundary; a full run of the 30 audio cases kills each of the four
# audio mutants in 30/30 (the missing logit cap: 24 at bf16, 6 at q8)
AUDIO_SUBSET = (r"^e2b-audio-mini/(last/embeddings/S0/T26/pos12|last/embeddings/S1/T44/pos34"
                r"|prefill/S1/T44/chunks-29\+15)$")


def test_audio_mutants_declare_the_set_that_kills_them():
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    audio = {m.name: m for m in _audio_mutants(mutants_mod)}
    assert set(audio) == {"audio-chunking-wrong", "audio-logit-cap-missing", "audio-soft-tokens-scaled",
                          "audio-ple-placeholder-row"}
    assert all(m.kill_sets == ("e2b-audio-mini",) for m in audio.values())
    assert audio["audio-chunking-wrong"].bug_class == "mm trap 24"


def test_audio_mutants_are_killed_by_the_bundled_audio_set(sets):
    """Each audio mutant on three audio cases of e2b-audio-mini (skipped until the set exists)."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    audio = _audio_mutants(mutants_mod)
    missing = _missing_kill_sets(mutants_mod, audio)
    if missing:
        pytest.skip(f"bundled audio set not there yet: {', '.join(sorted(missing))}")
    result = st.run_selftest(sets, audio, profiles=("fp32",), select=AUDIO_SUBSET)
    assert result.cases == 3
    _assert_every_mutant_killed_by_a_matching_check(result, audio)
    for m in result.mutants:
        assert m.verdict.failing_cases == 3, (m.name, m.verdict.failing)


# ----------------------------------------------------------------------------------------------
# the Unified embedder mutants: only 12b-mini (Gemma 4 Unified) can kill them

# an image base's first block (I0), a second image whose block must not hold the first one's padding (I1), an
# audio clip (S0)
UNIFIED_SUBSET = (r"^12b-mini/(last/embeddings/I0/T71/pos(6|38)|prefill/I1/T146/rows-image\+last"
                  r"|last/embeddings/S0/T26/pos12)$")


def test_unified_mutants_are_killed_by_the_bundled_unified_set(sets):
    """The mutants whose only kill set is 12b-mini (the Unified vision and audio embedders), each killed by a
    matching check on four of its cases: with the other subsets of this file, every mutant of the catalogue
    is killed without the full self-test (the opt-in ``slow`` test)."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    unified = [m for m in mutants_mod.MUTANTS if m.kill_sets == (mutants_mod.UNIFIED_SET,)]
    assert {m.name for m in unified} == {"patch-layernorm-eps-1e-6", "patch-rmsnorm", "patch-order-chw",
                                         "position-axes-swapped", "padding-rows-kept", "audio-frames-not-normed"}
    result = st.run_selftest(sets, unified, profiles=("fp32",), select=UNIFIED_SUBSET)
    assert result.cases == 4
    _assert_every_mutant_killed_by_a_matching_check(result, unified)
    assert _by_name(result)["padding-rows-kept"].caught_by[0] == "12b-mini/prefill/I1/T146/rows-image+last"


# ----------------------------------------------------------------------------------------------
# the video mutants: only the bundled video sets can kill them

# a row after the first video (V0, e2b-vision-mini-video: the frames' per-layer rows) and the rows inside every frame
# of V0 on 12b-mini-video (its frames open on sliding layers); the full run kills video-frames-not-vision in 60/60,
# video-frames-one-block in 17/30 of 12b-mini-video and video-timestamps-dropped in 30/60
VIDEO_SUBSET = r"^(e2b-vision-mini-video/last/embeddings/V0/T154/pos153|12b-mini-video/last/embeddings/V0/T154/pos153)$"


def test_video_mutants_are_killed_by_the_bundled_video_sets(sets):
    """The video mutants on one video case of each bundled video set, each killed by a matching check; the
    frames-one-block mutant only on 12b-mini-video (frames are causal on e2b-vision-mini-video)."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    video = [m for m in mutants_mod.MUTANTS if set(m.kill_sets) & set(VIDEO_SETS)]
    assert {m.name: m.kill_sets for m in video} == {
        "video-frames-not-vision": ("e2b-vision-mini-video", "12b-mini-video"),
        "video-frames-one-block": ("12b-mini-video",),
        "video-timestamps-dropped": ("e2b-vision-mini-video", "12b-mini-video")}
    result = st.run_selftest(sets, video, profiles=("fp32",), select=VIDEO_SUBSET)
    assert result.cases == 2
    _assert_every_mutant_killed_by_a_matching_check(result, video)
    got = _by_name(result)
    assert got["video-frames-not-vision"].verdict.failing_cases == 2
    assert [c for c, _ in got["video-frames-one-block"].verdict.failing] == [
        "12b-mini-video/last/embeddings/V0/T154/pos153"]


def test_the_subsets_cover_every_mutant():
    """What lets the full self-test be opt-in: every mutant of the catalogue is in one of the subset tests above
    (no kill set: REAL_SUBSET; image, audio, MTP, Unified and video kill sets: their own subsets; the PLE-fold
    mutants: tests/gate/selftest/test_ple_fold.py)."""
    m = pytest.importorskip("conformance.selftest.mutants")
    groups = [[x for x in m.MUTANTS if not x.kill_sets], _image_mutants(m), _audio_mutants(m),
              [x for x in m.MUTANTS if set(x.kill_sets) & set(m.MTP_SETS)],
              [x for x in m.MUTANTS if x.kill_sets == (m.UNIFIED_SET,)],
              [x for x in m.MUTANTS if x.kill_sets == (m.PLE_EPS_SET,)],
              [x for x in m.MUTANTS if set(x.kill_sets) & set(VIDEO_SETS)]]
    assert {x.name for g in groups for x in g} == {x.name for x in m.MUTANTS}


# ----------------------------------------------------------------------------------------------
# the MTP mutants: only the bundled MTP sets can kill them

# per MTP set, base M0 (a partial acceptance, a full one, a rejection of all, then two of three; a prompt
# shorter than W - 1 that grows past the window): the rounds case and the generate case under target-cache/P
# and transformers/P, on each of the three MTP sets
MTP_SUBSET = r"^(e2b-assistant|12b-assistant|mtp-layout)-mini/mtp/(rounds|generate)/M0/(target-cache|transformers)/P$"


def test_mtp_mutants_are_killed_by_the_bundled_mtp_sets(sets):
    """Each MTP mutant on 12 MTP cases, run on its kill sets only (the text sets hold no MTP request)."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    mtp = [m for m in mutants_mod.MUTANTS if set(m.kill_sets) & set(mutants_mod.MTP_SETS)
           and m.bug_class not in ("mtp M14", "mtp M15")]  # (after media, batched: their tests below)
    assert len(mtp) == 12 and not _missing_kill_sets(mutants_mod, mtp)
    result = st.run_selftest(sets, mtp, profiles=("fp32",), select=MTP_SUBSET)
    assert result.cases == 12
    _assert_every_mutant_killed_by_a_matching_check(result, mtp)
    by = _by_name(result)
    assert by["mtp-centroid-top-k-minus-1"].run_calls == 4  # the centroid-head set only
    assert by["mtp-no-rollback"].killed and by["mtp-position-p-minus-1"].killed


# MTP after media: the image (and audio) base's rounds and generate cases under target-cache/P on the two sets
MTP_MEDIA_SUBSET = r"^(12b-assistant|e2b-vision-assistant)-mini/mtp/(rounds|generate)/M[45]/target-cache/P$"


def test_mtp_media_mutants_are_killed_after_an_image_and_an_audio_prompt(sets):
    """The drafter's state not advanced past a media chunk, and its positions counted without the soft tokens: killed
    on the MTP-after-media cases of both pairs (6 cases: image and audio on the Unified pair, image on E2B), by the
    draft rows of the white-box rounds and by the drafts of the engine's own loop."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    media = [m for m in mutants_mod.MUTANTS if m.kill_sets == mutants_mod.MTP_MEDIA_SETS]
    assert {m.name for m in media} == {"mtp-media-state-not-advanced", "mtp-media-positions-without-soft-tokens"}
    result = st.run_selftest(sets, media, profiles=("fp32",), select=MTP_MEDIA_SUBSET)
    assert result.cases == 6
    _assert_every_mutant_killed_by_a_matching_check(result, media)
    for m in _by_name(result).values():
        assert m.verdict.failing_cases == 6, (m.name, m.verdict.failing)


# batched MTP: the three text bases drafting concurrently, rounds and generate under target-cache/P
MTP_BATCH_SUBSET = r"^(e2b-assistant|12b-assistant)-mini/mtp/(rounds|generate)/batch-M0\+M1\+M3/target-cache/P$"


def test_mtp_batch_mutant_is_killed_by_the_batched_cases(sets):
    """The drafter's state as one slot for the whole batch: it passes every solo case (one sequence, one state) and
    fails the batched ones, each sequence graded against its solo rows; the failure names the sequence."""
    mutants_mod = pytest.importorskip("conformance.selftest.mutants")
    (batch,) = [m for m in mutants_mod.MUTANTS if m.bug_class == "mtp M15"]
    assert batch.name == "mtp-batch-shared-state"
    result = st.run_selftest(sets, [batch], profiles=("fp32",), select=MTP_BATCH_SUBSET)
    assert result.cases == 4
    _assert_every_mutant_killed_by_a_matching_check(result, [batch])
    assert _by_name(result)["mtp-batch-shared-state"].verdict.failing_cases == 4
    solo = st.run_selftest(sets, [batch], profiles=("fp32",), select=MTP_SUBSET)
    assert solo.cases == 12 and not _by_name(solo)["mtp-batch-shared-state"].killed
