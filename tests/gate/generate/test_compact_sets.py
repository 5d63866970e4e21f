"""Compact fixture sets (schema 2, issue 16): one file per base, hidden states and row summaries instead of
full logits, the logits rebuilt through the checkpoint's head at check time; sets given as a .tar; sets of
schema 1 still read. On a checkpoint with the published vocabulary (262,144) and a tiny hidden size."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bigvocab import PUBLISHED_VOCAB, write_bigvocab_checkpoint

from conformance.check import materialise
from conformance.cli import main
from conformance.generate.run import generate_set
from conformance.sets import head, load_set
from conformance.sets.format import MANIFEST, sha256_file
from conformance.sets.head import TOP_K, RebuiltLogits, head_bound, lse_bound, row_summary, summary_problem
from conformance.sets.integrity import check_set
from refimpl.model import Gemma4
from refimpl.safetensors_io import TensorStore, write_safetensors

REPO = Path(__file__).resolve().parents[3]
SCHEMA1 = REPO / "tests" / "data" / "schema1" / "e2b-mini"  # fixtures/e2b-mini as bundled before schema 2


@pytest.fixture(scope="module")
def bigvocab(tmp_path_factory) -> dict[str, Path]:
    """The checkpoint and two sets of its text matrix: stored as hidden states (the default) and as logits."""
    root = tmp_path_factory.mktemp("compact")
    ckpt = write_bigvocab_checkpoint(root / "ckpt")
    return {"ckpt": ckpt,
            "hidden": generate_set(root / "hidden", model_dir=ckpt, cases="text", workers=1, name="bigvocab"),
            "logits": generate_set(root / "logits", model_dir=ckpt, cases="text", workers=1, store="logits",
                                   name="bigvocab")}


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir())


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rehash(set_dir: Path, model_files: dict[str, Path] | None = None) -> None:
    """Update the manifest's digests of the set's files (and of the given checkpoint files), so that only
    the content checks can object."""
    m = json.loads((set_dir / MANIFEST).read_text())
    for f in m["files"]:
        m["files"][f] = sha256_file(set_dir / f)
    for name, path in (model_files or {}).items():
        m["model"]["sha256"][name] = sha256_file(path)
        if "size" in m["model"]:
            m["model"]["size"][name] = path.stat().st_size
    (set_dir / MANIFEST).write_text(json.dumps(m, indent=1))


def test_layout_and_size(bigvocab):
    hidden, logits = load_set(bigvocab["hidden"]), load_set(bigvocab["logits"])
    for fs, storage in ((hidden, "hidden"), (logits, "logits")):
        assert fs.schema_version == 2 and fs.storage == storage
        assert sorted(fs.base_files()) == ["A", "B", "C", "G"]
        assert sorted(p.name for p in fs.path.iterdir()) == sorted(["manifest.json", "cases.json",
                                                                   *fs.base_files().values()])
    assert [c.to_json() for c in hidden.cases] == [c.to_json() for c in logits.cases]
    assert {b: a.shape for b, a in hidden.hidden_states().items()} == \
        {b: (len(ids), 16) for b, ids in hidden.bases().items()}
    assert TensorStore(bigvocab["hidden"] / "base-A.safetensors").names == \
        ["hidden", "lse", "margin", "tokens", "top_ids", "top_logits"]
    assert "logits" in TensorStore(bigvocab["logits"] / "base-A.safetensors").names
    assert _size(bigvocab["hidden"]) <= 0.01 * _size(bigvocab["logits"])


@pytest.mark.parametrize("where", ["memory", "file"])
def test_rebuilt_rows_equal_the_stored_logits_within_the_head_bound(bigvocab, tmp_path, monkeypatch, where):
    """Rebuilt in memory, or (a base above IN_MEMORY_BYTES) into a read-only memory-mapped file under the
    workdir, a block of rows at a time."""
    if where == "file":
        monkeypatch.setattr(head, "IN_MEMORY_BYTES", 0)
        monkeypatch.setattr(head, "ROW_BLOCK_BYTES", 7 * 8 * PUBLISHED_VOCAB)  # 7 rows a block
    fs = load_set(bigvocab["logits"])
    model = Gemma4(bigvocab["ckpt"])
    rebuilt = RebuiltLogits(model, fs.hidden_states(), fs.summaries(), tmp_path, "set")
    stored = fs.base_logits()
    for b in stored:
        d = float(np.max(np.abs(rebuilt[b] - stored[b])))
        assert d <= rebuilt.bounds[b] < 1e-9, (b, d, rebuilt.bounds[b])
        assert rebuilt[b].shape == (len(fs.bases()[b]), PUBLISHED_VOCAB) and not rebuilt[b].flags.writeable
        assert isinstance(rebuilt[b], np.memmap) == (where == "file")
    assert len(list(tmp_path.glob("rebuilt-*.npy"))) == (4 if where == "file" else 0)


def test_bundled_sets_rebuild_their_stored_logits(tmp_path):
    """Every bundled set that stores logits stores hidden states too: its rows rebuilt through the head equal the
    stored logits within ``head_bound`` (stated in docs/profiles.md). The video sets store hidden states only (their
    frames' patches are most of them): they are graded by rebuilding (tests/gate/generate/test_video_cases.py)."""
    from conformance.sets import bundled_sets

    compact = {p.name for p in bundled_sets() if load_set(p).storage == "hidden"}
    assert compact == {"e2b-vision-mini-video", "12b-mini-video"}
    for path in bundled_sets():
        fs = load_set(path)
        if fs.name in compact:
            continue
        model = Gemma4(materialise(fs, tmp_path / fs.name), activations=fs.activations)
        rebuilt = RebuiltLogits(model, fs.hidden_states(), fs.summaries(), tmp_path, fs.name)
        for b, stored in fs.base_logits().items():
            assert float(np.max(np.abs(rebuilt[b] - stored))) <= rebuilt.bounds[b], (fs.name, b)


def test_check_passes_a_compact_set_at_exact_f64(bigvocab, capsys, tmp_path):
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(bigvocab["hidden"]),
                          "--json", str(tmp_path / "r.json"))
    assert code == 0, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    n = len(load_set(bigvocab["hidden"]).cases)
    assert report["summary"]["by_status"]["pass"] == report["summary"]["total"] == n > 40


def test_verify_recompute_passes_a_compact_set(bigvocab, capsys):
    code, out, err = _run(capsys, "verify", "--recompute", str(bigvocab["hidden"]))
    assert code == 0, out + err


def test_an_embedding_row_that_differs_is_caught_by_the_summaries(bigvocab, tmp_path, capsys):
    """A checkpoint whose embedding differs in one row, recorded as the set's own (its digests updated):
    the rebuilt logits do not reproduce the stored top-k, so check stops with exit 3 (an integrity error,
    not a backend failure)."""
    fs = load_set(bigvocab["hidden"])
    token = int(fs.summaries()["A"]["top_ids"][5, 0])  # the top-1 token of row 5 of base A
    ckpt = _copy(bigvocab["ckpt"], tmp_path / "ckpt")
    store = TensorStore(ckpt / "model.safetensors")
    tensors = {n: np.array(store.raw(n)) for n in store.names}
    del store
    tensors["model.embed_tokens.weight"][token] *= 0.5
    write_safetensors(ckpt / "model.safetensors", tensors, "F32")
    s = _copy(bigvocab["hidden"], tmp_path / "set")
    m = json.loads((s / MANIFEST).read_text())
    m["model"]["path"] = str(ckpt)
    (s / MANIFEST).write_text(json.dumps(m, indent=1))
    _rehash(s, {"model.safetensors": ckpt / "model.safetensors"})
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(s))
    assert code == 3, out + err
    assert "the checkpoint's head does not reproduce the set" in err and f"token {token} (stored top-1)" in err
    assert "Traceback" not in err


def test_a_change_outside_the_top_k_is_caught_by_the_log_sum_exp():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 4096)) * 3
    stored = row_summary(z)
    assert summary_problem(z, stored, 1e-12, range(0, 3)) is None
    low = int(np.argmin(z[1]))  # far outside the top-k
    w = z.copy()
    w[1, low] += 5.0
    why = summary_problem(w, stored, 1e-12, range(0, 3))
    assert why is not None and why.startswith("row 1: the rebuilt log-sum-exp") and f"top-{TOP_K}" in why
    # a tie swapped by rounding is no problem: the logits at the stored ids agree within the bound
    t = np.zeros((1, 64))
    t[0, :2] = 1.0
    s = row_summary(t)
    assert list(s["top_ids"][0, :2]) == [0, 1] and s["margin"][0] == 0.0
    t2 = t.copy()
    t2[0, 1] += 1e-15
    assert summary_problem(t2, s, 1e-14, range(0, 1)) is None


def test_lse_bound_grows_with_the_vocabulary():
    assert lse_bound(0.0, PUBLISHED_VOCAB, 10.0) > lse_bound(0.0, 512, 10.0) > 0
    assert lse_bound(1e-12, 512, 1.0) > 1e-12


def test_head_bound_scales_with_the_norms(bigvocab):
    model = Gemma4(bigvocab["ckpt"])
    x = np.random.default_rng(1).normal(size=(4, 16))
    assert head_bound(model, x, 2.0) == pytest.approx(2 * head_bound(model, x, 1.0), rel=1e-6)


def test_a_tampered_hidden_state_file_fails_integrity(bigvocab, tmp_path, capsys):
    s = _copy(bigvocab["hidden"], tmp_path / "set")
    f = s / "base-B.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor (top_logits)
    f.write_bytes(bytes(data))
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(s))
    assert code == 3 and "base-B.safetensors" in err and "sha256 mismatch" in err
    code, out, _ = _run(capsys, "verify", str(s))
    assert code == 3 and "base-B.safetensors" in out


def test_hidden_states_edited_with_their_digest_fail_the_rebuild(bigvocab, tmp_path, capsys):
    """Hidden states changed and the manifest's digest updated: the rebuilt rows no longer match the
    summaries, exit 3."""
    s = _copy(bigvocab["hidden"], tmp_path / "set")
    f = s / "base-C.safetensors"
    store = TensorStore(f)
    tensors = {n: np.array(store.raw(n)) for n in store.names}
    del store
    tensors["hidden"][7] = tensors["hidden"][8]
    write_safetensors(f, tensors, "F64")
    _rehash(s)
    assert check_set(s) == []  # the set is self-consistent on its own
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(s))
    assert code == 3 and "base C" in err and "row 7" in err and "does not reproduce the set" in err


def test_a_schema_1_set_still_passes(capsys):
    fs = load_set(SCHEMA1)
    assert fs.schema_version == 1 and fs.storage == "logits" and fs.base_files() == {}
    assert set(fs.summaries()) == {"A", "B", "C", "G"}
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(SCHEMA1))
    assert code == 0 and "52 pass" in out + err
    assert _run(capsys, "verify", str(SCHEMA1))[0] == 0


def test_a_set_as_a_tar(bigvocab, tmp_path, capsys):
    for inner in ("", "myset"):
        tar = tmp_path / f"set{inner}.tar"
        with tarfile.open(tar, "w") as t:
            for p in sorted(bigvocab["hidden"].iterdir()):
                t.add(p, arcname=f"{inner}/{p.name}" if inner else p.name)
        code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(tar), "-k", "/full/")
        assert code == 0, out + err
        assert _run(capsys, "verify", str(tar))[0] == 0


def test_a_tar_with_a_link_or_a_parent_name_is_refused(bigvocab, tmp_path, capsys):
    link = tmp_path / "link.tar"
    with tarfile.open(link, "w") as t:
        t.add(bigvocab["hidden"] / MANIFEST, arcname=MANIFEST)
        info = tarfile.TarInfo("cases.json")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(info)
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(link))
    assert code == 3 and "member 'cases.json' is not a plain file or directory" in err
    up = tmp_path / "up.tar"
    with tarfile.open(up, "w") as t:
        t.add(bigvocab["hidden"] / MANIFEST, arcname="../manifest.json")
    code, out, err = _run(capsys, "verify", str(up))
    assert code == 3 and "member '../manifest.json' is not a plain relative path (it has a '..' component)" in out


def test_generate_refuses_an_unknown_store(tmp_path):
    with pytest.raises(ValueError, match="store must be one of hidden, logits, got 'half'"):
        generate_set(tmp_path / "s", preset="e2b-mini", store="half")


def test_a_checkpoint_the_oracle_cannot_read_is_exit_3(bigvocab, tmp_path, capsys):
    """A set stored as hidden states needs its checkpoint's head: weights refimpl cannot read (here a
    truncated safetensors header, recorded as the set's own) are a fixture error, not a traceback."""
    ckpt = _copy(bigvocab["ckpt"], tmp_path / "ckpt")
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    s = _copy(bigvocab["hidden"], tmp_path / "set")
    _rehash(s, {"model.safetensors": ckpt / "model.safetensors"})
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(s), "--model", str(ckpt))
    assert code == 3 and "Traceback" not in err, err
    assert "the set stores hidden states, and rebuilding its logits needs the checkpoint's head, which the oracle " \
        "cannot read" in err


def test_a_head_with_a_nan_is_exit_3(bigvocab, tmp_path, capsys):
    """A NaN in the head matrix (recorded as the set's own): the rebuild stops with a fixture error naming
    the tensor, not a traceback."""
    ckpt = _copy(bigvocab["ckpt"], tmp_path / "ckpt")
    store = TensorStore(ckpt / "model.safetensors")
    tensors = {n: np.array(store.raw(n)) for n in store.names}
    del store
    tensors["model.embed_tokens.weight"][1234, 3] = np.nan
    write_safetensors(ckpt / "model.safetensors", tensors, "F32")
    s = _copy(bigvocab["hidden"], tmp_path / "set")
    _rehash(s, {"model.safetensors": ckpt / "model.safetensors"})
    code, out, err = _run(capsys, "check", "--backend", "refimpl", "--fixtures", str(s), "--model", str(ckpt))
    assert code == 3 and "Traceback" not in err, err
    assert "the checkpoint's head cannot rebuild the set's logits" in err and "embed_tokens.weight" in err
