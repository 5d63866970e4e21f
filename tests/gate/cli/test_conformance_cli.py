"""The conformance gate end to end, through ``conformance.cli.main``: exit codes, statuses, reports.

A small fixture set is generated once per session (``generate_set`` on a synthetic preset); the
bundled sets are used for the self-check. Broken backends are written here as subclasses of the
refimpl backend and loaded through ``--backend test_harness:Name``, as a user's would be.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.expectations import ExpectationsError
from conformance.check.expectations import parse as parse_expectations
from conformance.cli import main
from conformance.protocol import Capabilities
from conformance.report import load_schema, validate

HERE = __name__  # the module name the backends below are loaded under (module:attr)
PRESET = "e2b-mini"


# ----------------------------------------------------------------------------------------------
# backends under test


class ShiftedInteriorBackend(RefimplBackend):
    """(a) B1: on interior last-logits rows, answers the next row instead of the requested one."""

    def __init__(self):
        super().__init__()
        self.name = "shifted-interior"

    def run(self, request):
        if request.kind == "last" and request.last_pos < len(request.tokens) - 1:
            request = dataclasses.replace(request, last_pos=request.last_pos + 1)
        return super().run(request)


class NoSoftcapBackend(RefimplBackend):
    """(b) B2: the single-row last-logits path drops the final softcap (the full path keeps it)."""

    def __init__(self):
        super().__init__()
        self.name = "no-softcap"

    def run(self, request):
        resp = super().run(request)
        if request.kind == "last":
            cap = self.model.cfg.final_logit_softcapping
            raw = cap * np.arctanh(np.asarray(resp.logits, dtype=np.float64) / cap)
            resp = dataclasses.replace(resp, logits=raw)
        return resp


class NaNBackend(RefimplBackend):
    """(c) returns a NaN in the first logits row of every request."""

    def __init__(self):
        super().__init__()
        self.name = "nan"

    def run(self, request):
        resp = super().run(request)
        logits = np.array(resp.logits, dtype=np.float64)
        logits[0, 7] = np.nan
        return dataclasses.replace(resp, logits=logits)


class RaisesOnMultiBackend(RefimplBackend):
    """(d) raises on multi-sequence requests only."""

    def __init__(self):
        super().__init__()
        self.name = "raises-on-multi"

    def run(self, request):
        if request.kind == "multi":
            raise RuntimeError("multi-sequence batch not implemented")
        return super().run(request)


class FullOnlyBackend(RefimplBackend):
    """Claims the full forward only (no decode)."""

    def __init__(self):
        super().__init__()
        self.name = "full-only"
        self.capabilities = Capabilities(full_forward=True, default_profile="exact-f64")


class NothingBackend(RefimplBackend):
    """Claims nothing any case can use."""

    def __init__(self):
        super().__init__()
        self.name = "nothing"
        self.capabilities = Capabilities(full_forward=False, default_profile="exact-f64")


class FullDecodeBackend(RefimplBackend):
    """Claims the full forward and decode."""

    def __init__(self):
        super().__init__()
        self.name = "full-decode"
        self.capabilities = Capabilities(full_forward=True, decode=True, default_profile="exact-f64")


class NotAResponseBackend(RefimplBackend):
    """Returns a bare array instead of a Response."""

    def run(self, request):
        return np.asarray(super().run(request).logits)


class CannotOpenBackend(RefimplBackend):
    def open(self, model_dir):
        raise OSError("device not found")


# ----------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="session")
def small_set(tmp_path_factory) -> Path:
    from conformance.generate import generate_set

    out = tmp_path_factory.mktemp("sets") / PRESET
    return Path(generate_set(out, preset=PRESET, seed=0))


def check(capsys, *argv):
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def check_json(capsys, tmp_path, *argv, name="report.json"):
    path = tmp_path / name
    code, out, err = check(capsys, *argv, "--json", str(path))  # the whole summary (-q would print the verdict only)
    report = json.loads(path.read_text()) if path.exists() else None
    return code, out, err, report


def statuses(report) -> dict[str, str]:
    return {c["id"]: c["status"] for c in report["cases"]}


def backend(name: str) -> list[str]:
    return ["--backend", f"{HERE}:{name}"]


# ----------------------------------------------------------------------------------------------
# the oracle passes everything


def test_refimpl_passes_the_generated_set_exactly(small_set, capsys, tmp_path):
    junit = tmp_path / "junit.xml"
    code, out, err, report = check_json(capsys, tmp_path, "--backend", "refimpl", "--fixtures", str(small_set),
                                        "--profile", "exact-f64", "--junit-xml", str(junit))
    assert code == 0, out + err
    assert report["exit_code"] == 0
    counts = report["summary"]["by_status"]
    assert counts["pass"] == len(report["cases"]) > 30
    assert counts["fail"] == counts["error"] == counts["not-claimed"] == 0
    # every entry point and the main features were exercised
    entries = set(report["summary"]["by_entry"])
    assert {"full", "last:plain", "last:seq_id", "last:embeddings", "prefill", "multi"} <= entries
    feats = set(report["summary"]["by_feature"])
    assert {"interior", "ubatch", "chunked", "decode", "generation"} <= feats
    # the console summary has the tables and the exit line
    assert "entry point" in out and "last:embeddings" in out and "exit 0" in out
    # reports: the JSON validates against the schema, the JUnit XML has the right counts
    assert validate(report) == []
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    assert int(root.get("tests")) == len(report["cases"])
    assert int(root.get("failures")) == 0 and int(root.get("errors")) == 0
    suites = root.findall("testsuite")
    assert len(suites) == 1 and suites[0].get("name") == report["fixture_sets"][0]["name"]
    tc = suites[0].find("testcase")
    assert tc.get("classname").startswith(report["fixture_sets"][0]["name"] + "/")
    # the fixture set is recorded with its manifest digest
    fs = report["fixture_sets"][0]
    assert len(fs["manifest_sha256"]) == 64 and fs["path"] == str(small_set)
    assert report["profile"]["name"] == "exact-f64" and "max_abs" in report["profile"]


def test_refimpl_passes_every_bundled_set(capsys, tmp_path):
    from conformance.sets import bundled_sets

    sets = bundled_sets()
    assert sets, "no bundled fixture sets"
    code, out, err, report = check_json(capsys, tmp_path, "--backend", "refimpl")
    assert code == 0, out + err
    assert report["profile"]["name"] == "exact-f64"  # the backend's default profile
    assert {s["name"] for s in report["fixture_sets"]} == {json.loads((Path(p) / "manifest.json").read_text())["name"]
                                                           for p in sets}
    # every case passes but those of the GGUF sets, made under ggml's activation convention, which the oracle
    # backend does not declare unless its option activations names it
    gguf = [c for c in report["cases"] if c["set"] in ("e2b-256-mini-q4km", "e2b-mini-q4-0")]
    assert len(gguf) == 104 and {c["status"] for c in gguf} == {"not-claimed"}
    assert {tuple(c["missing"]) for c in gguf} == {("activation_conventions=ggml-cpu/x86/f16-kv/gelu-table",),
                                                  ("activation_conventions=ggml-cpu/x86/gelu-table",)}
    assert report["summary"]["by_status"]["pass"] == len(report["cases"]) - len(gguf)
    assert validate(report) == []


# ----------------------------------------------------------------------------------------------
# broken backends are caught, by the right check


def test_shifted_interior_row_fails_identity(small_set, capsys, tmp_path):
    code, out, err, report = check_json(capsys, tmp_path, *backend("ShiftedInteriorBackend"), "--fixtures",
                                        str(small_set), "--profile", "exact-f64", "-k", "/last/")
    assert code == 1
    assert report["exit_code"] == 1
    for c in report["cases"]:
        if "interior" in c["features"]:
            assert c["status"] == "fail" and c["check"] == "identity", c
        else:
            assert c["status"] == "pass", c
    # the console names the first failing case, its first failing row, and the top tokens
    first = next(c for c in report["cases"] if c["status"] == "fail")
    assert f"FAIL: {first['id']}" in out
    assert "first failing row" in out and "oracle  top-" in out and "backend top-" in out
    assert validate(report) == []


def test_dropped_softcap_fails_closeness_not_top1(small_set, capsys, tmp_path):
    code, out, err, report = check_json(capsys, tmp_path, *backend("NoSoftcapBackend"), "--fixtures",
                                        str(small_set), "--profile", "exact-f64", "-k", "/last/plain/")
    assert code == 1
    failed = [c for c in report["cases"] if c["status"] == "fail"]
    assert failed and len(failed) == len(report["cases"])
    for c in failed:
        assert c["check"] in ("max_abs", "max_rel", "nmse", "cosine"), c["check"]
        row = next(r for r in c["rows"] if r["status"] == "fail")
        assert row["top_ref"][0] == row["top_got"][0]  # softcap is monotone: argmax alone cannot see it


def test_nan_is_nonfinite(small_set, capsys, tmp_path):
    code, out, err, report = check_json(capsys, tmp_path, *backend("NaNBackend"), "--fixtures", str(small_set),
                                        "--profile", "exact-f64", "--match", "/full/|/multi/")
    assert code == 1
    assert report["cases"] and all(c["status"] == "fail" and c["check"] == "nonfinite" for c in report["cases"])
    assert validate(report) == []  # NaN metrics are written as strings the schema allows
    json.dumps(report, allow_nan=False)


def test_backend_exception_is_an_error_and_the_run_goes_on(small_set, capsys, tmp_path):
    junit = tmp_path / "junit.xml"
    code, out, err, report = check_json(capsys, tmp_path, *backend("RaisesOnMultiBackend"), "--fixtures",
                                        str(small_set), "--profile", "exact-f64", "--match", "/multi/|/full/",
                                        "--junit-xml", str(junit))
    assert code == 1
    st = statuses(report)
    multi = [i for i in st if "/multi/" in i]
    full = [i for i in st if "/full/" in i]
    assert multi and full
    assert all(st[i] == "error" for i in multi)
    assert all(st[i] == "pass" for i in full)
    err_case = next(c for c in report["cases"] if c["status"] == "error")
    assert err_case["error"]["type"] == "RuntimeError"
    assert "multi-sequence batch not implemented" in err_case["message"]
    assert "Traceback" in err_case["error"]["traceback"] or "raise RuntimeError" in err_case["error"]["traceback"]
    assert "ERROR: " in out and "RuntimeError" in out
    root = ET.parse(junit).getroot()
    assert int(root.get("errors")) == len(multi) and int(root.get("failures")) == 0
    errors = root.findall(".//testcase/error")
    assert len(errors) == len(multi) and errors[0].get("type") == "RuntimeError"


def test_a_response_that_is_not_a_response_is_an_error(small_set, capsys, tmp_path):
    code, out, err, report = check_json(capsys, tmp_path, *backend("NotAResponseBackend"), "--fixtures",
                                        str(small_set), "-k", "/full/A/")
    assert code == 1
    c = report["cases"][0]
    assert c["status"] == "error" and "not conformance.protocol.Response" in c["message"]


def test_unclaimed_cases_are_never_passed(small_set, capsys, tmp_path):
    junit = tmp_path / "j.xml"
    code, out, err, report = check_json(capsys, tmp_path, *backend("FullDecodeBackend"), "--fixtures",
                                        str(small_set), "--junit-xml", str(junit))
    assert code == 0, out + err
    for c in report["cases"]:
        if c["kind"] == "full":
            assert c["status"] == "pass"
        else:
            assert c["status"] == "not-claimed" and c["missing"], c
            assert "not claimed" in c["message"]
    assert "n/c" in out
    root = ET.parse(junit).getroot()
    n_nc = sum(c["status"] == "not-claimed" for c in report["cases"])
    assert sum(int(s.get("skipped")) for s in root) == n_nc and int(root.get("failures")) == 0
    assert len(root.findall(".//testcase/skipped")) == n_nc
    # without decode, the full forward's rows are still graded and the decode steps reported as not claimed
    code, out, err, report = check_json(capsys, tmp_path, *backend("FullOnlyBackend"), "--fixtures", str(small_set),
                                        name="r1.json")
    assert code == 0, out + err
    full = [c for c in report["cases"] if c["kind"] == "full"]
    assert full and all(c["status"] == "pass" and c["missing"] == ["decode"] for c in full)
    assert all("decode not claimed" in c["message"] for c in full)
    assert all(len(c["rows"]) == len([r for r in c["rows"] if r["label"].startswith("row ")]) for c in full)
    # claiming nothing that any case can use: nothing runs, which is not a pass
    code, out, err, report = check_json(capsys, tmp_path, *backend("NothingBackend"), "--fixtures", str(small_set),
                                        name="r2.json")
    assert code == 5
    assert set(statuses(report).values()) == {"not-claimed"}
    assert report["exit_code"] == 5 and validate(report) == []
    assert "no case was run" in out


# ----------------------------------------------------------------------------------------------
# usage, fixture and backend errors


def test_tampered_fixture_is_exit_3(small_set, capsys, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(small_set, bad)
    name = next(f for f in json.loads((bad / "manifest.json").read_text())["files"] if f != "cases.json")
    f = bad / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(bad))
    assert code == 3 and "Traceback" not in err
    assert name in err and "sha256 mismatch" in err
    assert main(["verify", str(bad)]) == 3
    out, _ = capsys.readouterr()
    assert "problem" in out and name in out
    assert main(["verify", str(small_set)]) == 0
    assert "ok" in capsys.readouterr().out


def test_no_case_selected_is_exit_5(small_set, capsys):
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(small_set), "-k", "no-such-case")
    assert code == 5 and "no case selected" in err and "Traceback" not in err


def test_backend_errors_are_exit_4(small_set, capsys):
    code, out, err = check(capsys, "--backend", "no-such-backend", "--fixtures", str(small_set))
    assert code == 4 and "no-such-backend" in err and "Traceback" not in err
    code, out, err = check(capsys, "--backend", "no_such_module:Thing", "--fixtures", str(small_set))
    assert code == 4 and "Traceback" not in err
    code, out, err = check(capsys, *backend("CannotOpenBackend"), "--fixtures", str(small_set), "-k", "/full/")
    assert code == 4 and "device not found" in err


@pytest.mark.parametrize("argv, needle", [
    (["--profile", "no-such-profile"], "unknown profile"),
    (["--match", "("], "regular expression"),
    (["-k", "("], "-k: the expression '(' ends where a word was expected"),
    (["-k", "(last"], "-k: a '(' without its ')' in '(last'"),
    (["-k", "/full/|/multi/"], "looks like a regular expression"),
    (["--backend-option", "novalue"], "KEY=VALUE"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_usage_errors_are_exit_2(small_set, capsys, argv, needle):
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(small_set), *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_missing_backend_argument_is_exit_2(capsys):
    assert main(["check"]) == 2
    assert "--backend" in capsys.readouterr().err
    assert main([]) == 2
    capsys.readouterr()


def test_backend_options_reach_the_backend(small_set, capsys, tmp_path):
    code, out, err, report = check_json(capsys, tmp_path, "--backend", "refimpl", "--fixtures", str(small_set),
                                        "--backend-option", "dtype=float32", "--profile", "fp32", "-k", "/full/")
    assert code == 0, out + err
    assert report["backend"]["name"] == "refimpl-float32"
    assert report["backend"]["options"] == {"dtype": "float32"}
    assert report["profile"]["name"] == "fp32"


# ----------------------------------------------------------------------------------------------
# expectations


def write(tmp_path, name, obj) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def test_known_failure_turns_fail_into_xfail(small_set, capsys, tmp_path):
    exp = write(tmp_path, "exp.json", {"backend": "nan", "entries": [
        {"match": "/full/", "action": "known-failure", "reason": "NaN in row 0", "issue": "https://example/1"}]})
    code, out, err, report = check_json(capsys, tmp_path, *backend("NaNBackend"), "--fixtures", str(small_set),
                                        "--profile", "exact-f64", "-k", "/full/", "--expectations", exp)
    assert code == 0, out + err
    assert set(statuses(report).values()) == {"xfail"}
    c = report["cases"][0]
    assert c["expectation"]["known_failure"]["reason"] == "NaN in row 0"
    assert c["check"] == "nonfinite"
    assert validate(report) == []


def test_known_failure_that_passes_is_xpass(small_set, capsys, tmp_path):
    exp = write(tmp_path, "exp.json", {"entries": [
        {"match": "/full/A/", "action": "known-failure", "reason": "stale"}]})
    junit = tmp_path / "j.xml"
    code, out, err, report = check_json(capsys, tmp_path, "--backend", "refimpl", "--fixtures", str(small_set),
                                        "-k", "/full/", "--expectations", exp, "--junit-xml", str(junit))
    assert code == 1
    st = statuses(report)
    assert {st[i] for i in st if "/full/A/" in i} == {"xpass"}
    assert {st[i] for i in st if "/full/A/" not in i} == {"pass"}
    assert "XPASS" in out
    assert int(ET.parse(junit).getroot().get("failures")) == sum(s == "xpass" for s in st.values())


def test_skip_tolerance_expired_and_unused_entries(small_set, capsys, tmp_path):
    yesterday = (dt.date.today() - dt.timedelta(days=1)).isoformat()
    tomorrow = (dt.date.today() + dt.timedelta(days=1)).isoformat()
    exp = write(tmp_path, "exp.json", {"entries": [
        {"match": "/last/embeddings/", "action": "skip", "reason": "embeddings not wired", "expires": tomorrow},
        {"match": "/last/plain/", "action": "tolerance", "reason": "loose head", "tolerance": {"max_abs": 1e3,
                                                                                               "nmse": 1.0}},
        {"match": "/last/seq_id/", "action": "known-failure", "reason": "old bug", "expires": yesterday},
        {"match": "^nothing-matches-this$", "action": "skip", "reason": "stale entry"},
    ]})
    code, out, err, report = check_json(capsys, tmp_path, "--backend", "refimpl", "--fixtures", str(small_set),
                                        "-k", "/last/", "--expectations", exp)
    assert code == 0, out + err
    for c in report["cases"]:
        if "/last/embeddings/" in c["id"]:
            assert c["status"] == "skipped" and "embeddings not wired" in c["message"]
        else:
            assert c["status"] == "pass"  # the expired known-failure no longer applies
        if "/last/plain/" in c["id"]:
            assert c["expectation"]["tolerance"] == {"max_abs": 1e3, "nmse": 1.0}
    ex = report["expectations"]
    assert [e["index"] for e in ex["expired"]] == [2]
    assert [e["index"] for e in ex["unused"]] == [3]
    assert "expired" in out and "matched no case" in out
    assert validate(report) == []


def test_tolerance_override_changes_the_grading(small_set, capsys, tmp_path):
    loose = {"max_abs": 100, "max_rel": 100, "nmse": 1, "cosine_min": 0, "kl_max": 100, "kl_mean": 100,
             "delta_p": 1, "identity_ratio": 1}
    exp = write(tmp_path, "exp.json", {"entries": [
        {"match": "/last/plain/A/", "action": "tolerance", "reason": "head without softcap", "tolerance": loose}]})
    code, out, err, report = check_json(capsys, tmp_path, *backend("NoSoftcapBackend"), "--fixtures",
                                        str(small_set), "--profile", "exact-f64", "-k", "/last/plain/",
                                        "--expectations", exp)
    assert code == 1  # the cases on base G are not covered by the entry
    for c in report["cases"]:
        if "/last/plain/A/" in c["id"]:
            assert c["status"] == "pass" and c["expectation"]["tolerance"]["max_abs"] == 100.0
        else:
            assert c["status"] == "fail" and c["expectation"] is None
    assert report["profile"]["max_abs"] == 1e-9  # the report's profile is the one asked for


def test_fixture_directories_expand_to_their_sets(small_set, capsys, tmp_path):
    code, out, err, report = check_json(capsys, tmp_path, "--backend", "refimpl", "--fixtures",
                                        str(small_set.parent), "-k", "/full/A/")
    assert code == 0
    assert [s["path"] for s in report["fixture_sets"]] == [str(small_set)]
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(tmp_path / "nope"))
    assert code == 2 and "no such directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(empty))
    assert code == 3 and "manifest.json" in err


def test_progress_output(small_set, capsys):
    import io

    from conformance.report import ProgressBar

    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(small_set), "-k", "/full/")
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and "pass" in lines[0] and "/full/" in lines[0]  # one plain line per case

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = ProgressBar(stream)
    bar(0, 4, "set/full/A/T9")
    bar(2, 4, "set/last/plain/A/T7/pos3")
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") >= 3 and "\n" not in text
    assert "2/4" in text and "set/last/plain/A/T7/pos3" in text and "#" in text


@pytest.mark.parametrize("entry, needle", [
    ({"match": "x", "action": "skip"}, "entry 0: 'reason' is required"),
    ({"match": "x", "action": "skip", "reason": "  "}, "entry 0: 'reason' is required"),
    ({"match": "x", "action": "ignore", "reason": "r"}, "entry 0: unknown 'action' 'ignore'"),
    ({"match": "(", "action": "skip", "reason": "r"}, "entry 0: 'match' is not a valid regular expression"),
    ({"match": "x", "action": "skip", "reason": "r", "expires": "2026-13-01"}, "entry 0: 'expires'"),
    ({"match": "x", "action": "skip", "reason": "r", "colour": 1}, "entry 0: unknown field(s) 'colour'"),
    ({"match": "x", "action": "tolerance", "reason": "r", "tolerance": {"maxabs": 1}}, "'tolerance.maxabs'"),
    ({"match": "x", "action": "tolerance", "reason": "r", "tolerance": {"max_abs": "big"}}, "must be a number"),
    ({"match": "x", "action": "tolerance", "reason": "r"}, "'tolerance' is required"),
])
def test_bad_expectations_are_usage_errors(small_set, capsys, tmp_path, entry, needle):
    exp = write(tmp_path, "exp.json", {"entries": [{"match": "ok", "action": "skip", "reason": "fine"}, entry]})
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(small_set), "--expectations", exp)
    assert code == 2 and needle.replace("entry 0", "entry 1") in err and "Traceback" not in err


def test_expectations_file_errors(tmp_path, capsys, small_set):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(small_set), "--expectations", str(p))
    assert code == 2 and "not valid JSON" in err
    code, out, err = check(capsys, "--backend", "refimpl", "--fixtures", str(small_set), "--expectations",
                           str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read" in err
    with pytest.raises(ExpectationsError, match="missing 'entries'"):
        parse_expectations({})


def test_toml_expectations(tmp_path):
    from conformance.check.expectations import load

    p = tmp_path / "exp.toml"
    p.write_text('backend = "x"\n[[entries]]\nmatch = "/full/"\naction = "skip"\nreason = "r"\n'
                 'expires = 2030-01-01\n')
    e = load(p)
    assert e.entries[0].expires == dt.date(2030, 1, 1)
    assert e.decide("s/full/A/T9").skip is e.entries[0]


# ----------------------------------------------------------------------------------------------
# list / generate / verify, and the schema itself


def test_list_commands(small_set, capsys):
    assert main(["list", "backends"]) == 0
    assert "refimpl" in capsys.readouterr().out
    assert main(["list", "profiles"]) == 0
    out = capsys.readouterr().out
    assert "exact-f64" in out and "fp32" in out
    assert main(["list", "cases", "--fixtures", str(small_set), "-k", "/multi/"]) == 0
    out = capsys.readouterr().out
    assert out.strip() and all("/multi/" in line for line in out.strip().splitlines())
    assert main(["list", "cases", "--fixtures", str(small_set), "-k", "zzz"]) == 5
    capsys.readouterr()


def test_generate_refuses_to_overwrite_and_checks_arguments(small_set, capsys, tmp_path):
    assert main(["generate", "--preset", PRESET, "--out", str(small_set), "-q"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main(["generate", "--out", str(tmp_path / "x")]) == 2
    assert main(["generate", "--preset", "no-such-preset", "--out", str(tmp_path / "y"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "no-such-preset" in err and "Traceback" not in err


def test_schema_rejects_malformed_reports(small_set, capsys, tmp_path):
    code, out, err, report = check_json(capsys, tmp_path, "--backend", "refimpl", "--fixtures", str(small_set),
                                        "-k", "/full/")
    assert code == 0 and validate(report) == []
    schema = load_schema()
    bad = json.loads(json.dumps(report))
    bad["cases"][0]["status"] = "passed"
    del bad["summary"]
    bad["schema_version"] = 2
    problems = validate(bad, schema)
    assert any("cases[0].status" in p for p in problems)
    assert any("summary" in p for p in problems)
    assert any("schema_version" in p for p in problems)


# ----------------------------------------------------------------------------------------------
# expectations a backend ships for its configuration


class ShippedExpectationsBackend(NaNBackend):
    """NaN rows, with an expectations file shipped by the backend (given here as an option)."""

    def __init__(self, expectations_file: str):
        super().__init__()
        self.expectations_file = Path(expectations_file)


def test_shipped_expectations_apply_unless_overridden(small_set, capsys, tmp_path):
    shipped = write(tmp_path, "shipped.json", {"backend": "nan", "entries": [
        {"match": "/full/", "action": "known-failure", "reason": "this engine writes NaN in row 0"}]})
    argv = [*backend("ShippedExpectationsBackend"), "--backend-option", f"expectations_file={shipped}",
            "--fixtures", str(small_set), "--profile", "exact-f64", "-k", "/full/"]
    code, out, err, report = check_json(capsys, tmp_path, *argv)
    assert code == 0, out + err
    assert set(statuses(report).values()) == {"xfail"}
    assert report["expectations"]["path"] == shipped
    assert report["cases"][0]["expectation"]["known_failure"]["reason"] == "this engine writes NaN in row 0"

    code, out, err = check(capsys, *argv, "--no-shipped-expectations", "-q")
    assert code == 1 and "fail" in out
    other = write(tmp_path, "other.json", {"entries": [{"match": "/full/A/", "action": "skip", "reason": "x"}]})
    code, out, err, report = check_json(capsys, tmp_path, *argv, "--expectations", other)
    assert report["expectations"]["path"] == other  # the user's file replaces the shipped one
    assert {s for i, s in statuses(report).items() if "/full/A/" not in i} == {"fail"}


def test_a_broken_shipped_expectations_file_is_a_backend_error(small_set, capsys, tmp_path):
    broken = write(tmp_path, "broken.json", {"entries": [{"match": "/full/", "action": "skip"}]})
    code, out, err = check(capsys, *backend("ShippedExpectationsBackend"), "--backend-option",
                           f"expectations_file={broken}", "--fixtures", str(small_set), "-k", "/full/")
    assert code == 4
    assert "ships a broken expectations file" in err and "reason" in err
