"""A fixture set as the gate reads it (conformance/sets/): what a case is and the rows it returns (``case.py``:
``row_groups``, the strict JSON of a case) and the integrity checks of ``load_set`` / ``verify_set`` (``integrity.py``):
one byte of a base file, an edited case, an edited manifest hash, a consistent but impossible case, manifest
schema problems and missing files are each found and named. The tampering starts from a copy of the bundled
31b-mini set; generating sets is tests/gate/generate/test_generate_sets.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conformance.check.requests import response_groups
from conformance.generate import verify_set
from conformance.protocol import Response
from conformance.sets import CASES, MANIFEST, FixtureError, bundled_set, load_set, sha256_file
from conformance.sets.case import Case, row_groups

BASE_B = "base-B.safetensors"  # one base's file in a set


@pytest.fixture(scope="module")
def small_set() -> Path:
    return Path(bundled_set("31b-mini"))


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_row_groups_labels_and_response_groups():
    case = Case("s/prefill/A/T20/x", "prefill", "A", 20, pieces=((17, ()), (3, (2,))), decode_len=2)
    groups = row_groups(case)
    assert [(g, [(r.label, r.position) for r in rows]) for g, rows in groups] == [
        ("logits", [("piece 1 row 2", 19)]), ("decode", [("decode 0", 20), ("decode 1", 21)])]
    resp = Response(np.zeros((1, 4)), np.ones((2, 4)))
    got = response_groups(case, resp)
    assert got[0].shape == (1, 4) and got[1].shape == (2, 4)
    assert response_groups(case, Response(np.zeros((1, 4))))[1] is None
    multi = Case("s/multi/x", "multi", "A", 3, sequences=(("A", 3, 1, 1), ("B", 4, 2, 1)))
    assert [g for g, _ in row_groups(multi)] == ["logits", "decode seq 0", "decode seq 1"]
    assert [r.label for _, rows in row_groups(multi) for r in rows] == [
        "seq 0 last", "seq 1 last", "seq 0 decode 0", "seq 1 decode 0"]
    got = response_groups(multi, Response(np.zeros((2, 4)), [np.ones((1, 4))]))
    assert got[1].shape == (1, 4) and got[2] is None
    got = response_groups(multi, Response(np.zeros((2, 4)), np.ones((2, 1, 4))))
    assert got[2].shape == (1, 4)


def test_case_json_round_trip_and_strictness(small_set):
    for case in load_set(small_set).cases:
        assert Case.from_json(json.loads(json.dumps(case.to_json()))) == case
    d = load_set(small_set).cases[0].to_json()
    with pytest.raises(ValueError, match="unknown field 'bogus'"):
        Case.from_json({**d, "bogus": 1})
    with pytest.raises(ValueError, match="'length' must hold integers"):
        Case.from_json({**d, "length": "9"})
    with pytest.raises(ValueError, match="required field 'kind'"):
        Case.from_json({k: v for k, v in d.items() if k != "kind"})


def _problems_and_error(path: Path) -> tuple[list[str], str]:
    problems = verify_set(path)
    with pytest.raises(FixtureError) as e:
        load_set(path)
    return problems, str(e.value)


@pytest.mark.parametrize("where", ["header", "data", "last"])
def test_one_byte_of_a_base_file_is_detected(small_set, tmp_path, where):
    path = _copy(small_set, tmp_path)
    f = path / BASE_B
    data = bytearray(f.read_bytes())
    at = {"header": 20, "data": len(data) // 2, "last": len(data) - 1}[where]
    data[at] ^= 0x01
    f.write_bytes(bytes(data))
    problems, message = _problems_and_error(path)
    assert problems and all(BASE_B in p for p in problems)
    assert BASE_B in message and "sha256 mismatch" in message


def test_an_edited_case_is_detected(small_set, tmp_path):
    path = _copy(small_set, tmp_path)
    doc = json.loads((path / CASES).read_text())
    doc["cases"][3]["last_pos"] = 0
    (path / CASES).write_text(json.dumps(doc, indent=1) + "\n")
    problems, message = _problems_and_error(path)
    assert len(problems) == 1 and CASES in problems[0] and CASES in message


def test_an_edited_manifest_hash_is_detected(small_set, tmp_path):
    path = _copy(small_set, tmp_path)
    m = json.loads((path / MANIFEST).read_text())
    m["files"][BASE_B] = "0" * 64
    (path / MANIFEST).write_text(json.dumps(m))
    problems, message = _problems_and_error(path)
    assert len(problems) == 1 and BASE_B in message and MANIFEST in message and "0" * 64 in message


def test_consistent_but_wrong_case_is_detected(small_set, tmp_path):
    """A case edited and its hash updated: the structural checks still catch impossible cases."""
    path = _copy(small_set, tmp_path)
    doc = json.loads((path / CASES).read_text())
    doc["cases"][3]["last_pos"] = 99
    (path / CASES).write_text(json.dumps(doc))
    m = json.loads((path / MANIFEST).read_text())
    m["files"][CASES] = sha256_file(path / CASES)
    (path / MANIFEST).write_text(json.dumps(m))
    problems, message = _problems_and_error(path)
    assert "last_pos 99 is outside" in message and CASES in message


@pytest.mark.parametrize("edit, expect", [
    (lambda m: m.update(schema_version=3), "newer than this harness reads"),
    (lambda m: m.update(schema_version=0), "schema_version 0 is not supported (this harness reads 1, 2)"),
    (lambda m: m.update(storage="half"), "storage must be one of hidden, logits, got 'half'"),
    (lambda m: m["files"].update({"expected.safetensors": "0" * 64}), "'expected.safetensors' is not a file name of "
                                                                      "the set"),
    (lambda m: m.update(schema="something/else"), "not a conformance fixture set"),
    (lambda m: m.update(version="1.0"), "not a semantic version"),
    (lambda m: m["files"].update({"../evil": "0" * 64}), "not a file name of the set"),
    (lambda m: m["model"].update(preset="nope"), "is not a preset"),
])
def test_manifest_schema_problems(small_set, tmp_path, edit, expect):
    path = _copy(small_set, tmp_path)
    m = json.loads((path / MANIFEST).read_text())
    edit(m)
    (path / MANIFEST).write_text(json.dumps(m))
    problems, message = _problems_and_error(path)
    assert expect in message and MANIFEST in message


def test_missing_files_are_detected(small_set, tmp_path):
    path = _copy(small_set, tmp_path)
    (path / CASES).unlink()
    problems, message = _problems_and_error(path)
    assert CASES in message and "missing" in message
    (path / MANIFEST).unlink()
    assert "not a fixture set" in _problems_and_error(path)[1]
    assert verify_set(tmp_path / "nowhere")[0].endswith("not a directory (a fixture set is a directory with "
                                                        "manifest.json, or a .tar of one)")
