"""Checkpoint identity by content (issue 16, item 1): an external set records its checkpoint's files by
relative name, size and sha256, the path only as provenance; ``check --model DIR``, ``verify --model DIR``
and the pytest plugin's ``--conformance-model DIR`` take the checkpoint from anywhere; ``verify`` without a
checkpoint checks the set itself and says that the checkpoint was not checked; digests are cached by file
identity (``--rehash`` reads the files again).

The move / --model / changed-byte tests run on a checkpoint with the published vocabulary (262,144) and a
tiny hidden size (tests/bigvocab.py); the cache and manifest tests on a micro checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from bigvocab import PUBLISHED_VOCAB, write_bigvocab_checkpoint
from helpers import micro_checkpoint, micro_config

from conformance.check import materialise
from conformance.cli import main
from conformance.generate.run import generate_set
from conformance.sets import checkpoint
from conformance.sets.checkpoint import CACHE_ENV, CACHE_NAME, MODEL_HINT, DigestCache, file_digests
from conformance.sets.format import MANIFEST, FixtureError, sha256_file
from conformance.sets.integrity import load_set

NAMES = ("config.json", "model.safetensors", "tokenizer.model")
ONE_CASE = ["-k", "/full/A/"]  # one case: enough to show that the checkpoint was found and used
PAST = time.time_ns() - 3600 * 10**9  # an mtime well outside the digest cache's racy window


def _age(ckpt: Path, when: int = PAST) -> None:
    """Give every file of ``ckpt`` the mtime ``when`` (as a checkpoint that was not just written)."""
    for f in ckpt.iterdir():
        os.utime(f, ns=(when, when))


def _not_there(s: Path, recorded: Path, names=NAMES) -> str:
    return (f"{s}: the checkpoint is not at the path the set records ({recorded}), so none of its {len(names)} "
            f"recorded files ({', '.join(names)}) could be checked; {MODEL_HINT}")


def _note(recorded: Path, names=NAMES) -> str:
    return (f"the checkpoint was NOT checked: it is not at the path the set records ({recorded}); {MODEL_HINT} "
            f"to check its {len(names)} recorded files ({', '.join(names)})")


@pytest.fixture(scope="module")
def bigvocab(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(set, checkpoint now, recorded path): a text set of the big-vocabulary checkpoint, whose checkpoint
    was then moved away from the path the set records."""
    root = tmp_path_factory.mktemp("bigvocab")
    made = write_bigvocab_checkpoint(root / "made")
    s = generate_set(root / "set", model_dir=made, workers=1, cases="text")
    moved = root / "moved"
    os.rename(made, moved)
    return s, moved, made


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, Path]:
    """(set, checkpoint): a text set of a micro checkpoint (no tokenizer), the checkpoint where it was made."""
    root = tmp_path_factory.mktemp("small")
    ckpt = micro_checkpoint(root / "ckpt", micro_config(sliding_window=3, num_hidden_layers=4), 0)
    return generate_set(root / "set", model_dir=ckpt, workers=1), ckpt


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The checkpoint files the digest cache reads (real paths), in order."""
    calls: list[str] = []
    real = checkpoint.sha256_file

    def counting(path):
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(checkpoint, "sha256_file", counting)
    return calls


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A digest cache of this test alone: the path of its digests.json."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / CACHE_NAME


# ----------------------------------------------------------------------------------------------
# a checkpoint that moved: --model


def test_the_manifest_records_the_checkpoint_by_content(bigvocab):
    s, moved, made = bigvocab
    model = json.loads((s / MANIFEST).read_text())["model"]
    assert model == {"kind": "external", "path": str(made),
                     "sha256": {n: sha256_file(moved / n) for n in NAMES},
                     "size": {n: (moved / n).stat().st_size for n in NAMES}}
    assert json.loads((moved / "config.json").read_text())["vocab_size"] == PUBLISHED_VOCAB


def test_a_moved_checkpoint_is_found_with_model(bigvocab, capsys):
    s, moved, made = bigvocab
    assert main(["check", "--backend", "refimpl", "--fixtures", str(s), "--model", str(moved), "-q", *ONE_CASE]) == 0
    assert "1 cases: 1 pass" in capsys.readouterr().out

    assert main(["check", "--backend", "refimpl", "--fixtures", str(s), "-q", *ONE_CASE]) == 3
    assert capsys.readouterr().err == f"conformance: error: fixture integrity: {_not_there(s, made)}\n"

    assert main(["check", "--backend", "refimpl", "--fixtures", str(s), "--model", str(s / "nowhere"), "-q"]) == 2
    assert capsys.readouterr().err == f"conformance: error: --model: no such directory: {s / 'nowhere'}\n"

    fs = load_set(s)
    assert materialise(fs, s / "unused", model=moved) == moved
    with pytest.raises(FixtureError) as e:
        materialise(fs, s / "unused")
    assert str(e.value) == _not_there(s, made)
    assert fs.checkpoint_problems() == [_not_there(s, made)] and fs.checkpoint_problems(model=moved) == []


def test_verify_without_the_checkpoint_says_it_was_not_checked(bigvocab, capsys):
    s, moved, made = bigvocab
    assert main(["verify", str(s)]) == 0
    assert capsys.readouterr().out == f"{s}: ok\n  note: {_note(made)}\n"
    assert main(["verify", str(s), "--model", str(moved)]) == 0
    assert capsys.readouterr().out == f"{s}: ok\n"


def test_verify_with_model_names_a_changed_byte(bigvocab, tmp_path, capsys):
    s, moved, _ = bigvocab
    copy = shutil.copytree(moved, tmp_path / "copy")
    weights = copy / "model.safetensors"
    want = sha256_file(weights)
    with open(weights, "r+b") as f:  # one byte of the weights, the size unchanged
        f.seek(weights.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    got = sha256_file(weights)
    problem = (f"{s}: model.safetensors in the checkpoint directory {copy} (--model) differs from the set's: "
               f"sha256 {got}, the set records {want}; {MODEL_HINT}, or regenerate the set for this checkpoint")
    assert main(["verify", str(s), "--model", str(copy)]) == 3
    assert capsys.readouterr().out == f"{s}: 1 problem(s)\n  - {problem}\n"
    assert main(["check", "--backend", "refimpl", "--fixtures", str(s), "--model", str(copy), "-q"]) == 3
    assert capsys.readouterr().err == f"conformance: error: fixture integrity: {problem}\n"


def test_a_missing_or_resized_file_is_named_without_reading_the_others(small, tmp_path, capsys, hashed, cache):
    s, ckpt = small
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    model = json.loads((s / MANIFEST).read_text())["model"]
    size, sha = model["size"], model["sha256"]
    (copy / "config.json").unlink()
    with open(copy / "model.safetensors", "ab") as f:
        f.write(b"\0")
    problems = [
        f"{s}: config.json is missing from the checkpoint directory {copy} (--model): the set records it "
        f"({size['config.json']} bytes, sha256 {sha['config.json']}); {MODEL_HINT}",
        f"{s}: model.safetensors in the checkpoint directory {copy} (--model) differs from the set's: "
        f"{size['model.safetensors'] + 1} bytes, the set records {size['model.safetensors']} bytes, sha256 "
        f"{sha['model.safetensors']}; {MODEL_HINT}, or regenerate the set for this checkpoint"]
    assert main(["verify", str(s), "--model", str(copy)]) == 3
    assert capsys.readouterr().out == f"{s}: 2 problem(s)\n" + "".join(f"  - {p}\n" for p in problems)
    assert hashed == []  # sizes are compared before anything is read
    with pytest.raises(FixtureError) as e:
        materialise(load_set(s), tmp_path / "w", model=copy)
    assert str(e.value) == f"{problems[0]} (and 1 more problem)"


def test_the_recorded_path_is_still_tried(small, capsys):
    s, ckpt = small
    assert main(["verify", str(s)]) == 0
    assert capsys.readouterr().out == f"{s}: ok\n"  # the checkpoint is where it was made: checked, no note
    assert materialise(load_set(s), ckpt / "unused") == ckpt


# ----------------------------------------------------------------------------------------------
# the digest cache


def test_a_second_check_reads_no_checkpoint_file(small, tmp_path, capsys, hashed, cache):
    s, ckpt = small
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    _age(copy)
    files = [os.path.realpath(copy / n) for n in ("config.json", "model.safetensors")]
    check = ["check", "--backend", "refimpl", "--fixtures", str(s), "--model", str(copy), "-q", *ONE_CASE]
    assert main(check) == 0 and sorted(hashed) == files  # the order: the threads'
    entries = json.loads(cache.read_text())["files"]
    assert sorted(entries) == sorted(files)
    st = os.stat(files[1])
    assert entries[files[1]] == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev,
                                 "sha256": sha256_file(Path(files[1]))}
    hashed.clear()
    assert main(check) == 0 and hashed == []  # from the cache

    assert main([*check, "--rehash"]) == 0 and sorted(hashed) == files  # --rehash reads them all again
    hashed.clear()
    os.utime(copy / "config.json", ns=(PAST + 10**9, PAST + 10**9))  # another mtime: another file for the cache
    assert main(check) == 0 and hashed == files[:1]
    hashed.clear()
    assert main(["verify", str(s), "--model", str(copy)]) == 0 and hashed == []  # verify reads the same cache

    cache.write_text("{not json")  # a corrupt cache is ignored, then replaced
    assert main(check) == 0 and sorted(hashed) == files  # the order: the threads'
    assert sorted(json.loads(cache.read_text())["files"]) == sorted(files)
    capsys.readouterr()


def test_an_unwritable_cache_leaves_the_digests_uncached(small, tmp_path, monkeypatch, capsys, hashed):
    s, ckpt = small
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    _age(copy)
    for _ in range(2):
        assert main(["verify", str(s), "--model", str(copy)]) == 0
    assert capsys.readouterr().out == f"{s}: ok\n" * 2
    assert len(hashed) == 4 and sorted(os.listdir(tmp_path)) == ["copy", "file"]


def test_digests_follow_the_file_identity(tmp_path, hashed, cache):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x" * 1000)
    assert file_digests(tmp_path, ["weights.bin"]) == {"weights.bin": sha256_file(f)}
    assert file_digests(tmp_path, ["weights.bin"]) and len(hashed) == 2  # just written: not trusted yet
    _age(tmp_path)
    file_digests(tmp_path, ["weights.bin"])
    file_digests(tmp_path, ["weights.bin"])
    assert len(hashed) == 3  # now cached
    link = tmp_path / "sub"
    link.mkdir()
    (link / "w").symlink_to(f)  # a link (a Hugging Face snapshot's) shares its target's entry
    assert file_digests(link, ["w"]) == {"w": sha256_file(f)} and len(hashed) == 3

    f.write_bytes(b"x" * 1001)  # another size, then the old mtime back: hashed again
    _age(tmp_path)
    assert file_digests(tmp_path, ["weights.bin"]) == {"weights.bin": sha256_file(f)} and len(hashed) == 4
    g = tmp_path / "other.bin"  # the same bytes and mtime in another file (another inode): hashed
    shutil.copy2(f, g)
    assert file_digests(tmp_path, ["other.bin"]) == {"other.bin": sha256_file(f)} and len(hashed) == 5
    assert file_digests(tmp_path, ["weights.bin"], rehash=True) and len(hashed) == 6

    cache.write_text(json.dumps({"schema": "something else", "files": {}}))
    assert DigestCache().sha256(f) == sha256_file(f) and len(hashed) == 7  # not a digest cache: ignored
    with pytest.raises(OSError):
        file_digests(tmp_path, ["gone.bin"])


def test_the_shards_are_hashed_side_by_side(tmp_path, monkeypatch, cache):
    """A sharded checkpoint's files are read on threads at once (each call here waits until the other has
    started: one after another, the barrier breaks); a file that cannot be read is named with its error and
    the others are still hashed; the digests land in the cache as before."""
    shards = [tmp_path / f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for i, f in enumerate(shards):
        f.write_bytes(bytes([i]) * 100_000)
    _age(tmp_path)
    together = threading.Barrier(2, timeout=20)
    real = checkpoint.sha256_file

    def meeting(path):
        if Path(path).name.startswith("model-00002"):
            raise PermissionError(13, "Permission denied")
        together.wait()  # the other two shards meet here
        return real(path)

    monkeypatch.setattr(checkpoint, "cores", lambda: 2)
    monkeypatch.setattr(checkpoint, "sha256_file", meeting)
    got = DigestCache().sha256_all(shards)
    assert [got[0], got[2]] == [real(shards[0]), real(shards[2])]
    assert isinstance(got[1], PermissionError) and got[1].strerror == "Permission denied"
    with pytest.raises(PermissionError):
        file_digests(tmp_path, [f.name for f in shards])
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: pytest.fail(f"{path} read again"))
    assert file_digests(tmp_path, [shards[0].name, shards[2].name]) == {  # cached by the call before
        shards[0].name: real(shards[0]), shards[2].name: real(shards[2])}


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert checkpoint.cache_path() == tmp_path / "mine" / CACHE_NAME
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert checkpoint.cache_path() == tmp_path / "xdg" / "gemma4-conformance" / CACHE_NAME
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert checkpoint.cache_path() == tmp_path / "home" / ".cache" / "gemma4-conformance" / CACHE_NAME


# ----------------------------------------------------------------------------------------------
# the manifest's size map; older sets


def _with_model(small, tmp_path: Path, **change) -> Path:
    """A copy of the small set whose manifest's model record has ``change`` (None: the key removed)."""
    s = shutil.copytree(small[0], tmp_path / "set")
    manifest = json.loads((s / MANIFEST).read_text())
    for k, v in change.items():
        if v is None:
            manifest["model"].pop(k)
        else:
            manifest["model"][k] = v
    (s / MANIFEST).write_text(json.dumps(manifest))
    return s


def test_a_set_without_sizes_still_loads_and_checks(small, tmp_path, capsys):
    s = _with_model(small, tmp_path, size=None, path="ckpt-on-another-machine")
    assert load_set(s).checkpoint_problems(model=small[1]) == []
    assert main(["verify", str(s), "--model", str(small[1])]) == 0
    assert main(["verify", str(s)]) == 0
    names = ("config.json", "model.safetensors")
    # a relative recorded path is inside the set (FixtureSet.model_record)
    assert capsys.readouterr().out == f"{s}: ok\n{s}: ok\n  note: {_note(s / 'ckpt-on-another-machine', names)}\n"


@pytest.mark.parametrize("size", [{"config.json": 1}, {"config.json": 1, "model.safetensors": -1},
                                  {"config.json": 1, "model.safetensors": True}, [1, 2]])
def test_a_bad_size_map_is_refused(small, tmp_path, size):
    s = _with_model(small, tmp_path, size=size)
    with pytest.raises(FixtureError) as e:
        load_set(s)
    assert str(e.value) == f"{s / MANIFEST}: model.size must map the files of model.sha256 to their sizes in bytes"


# ----------------------------------------------------------------------------------------------
# synthetic sets and the pytest plugin


def test_a_synthetic_set_takes_a_matching_model(tmp_path, capsys):
    from refimpl.synth import write_checkpoint

    s = generate_set(tmp_path / "set", preset="31b-mini", cases="text", workers=1)
    fs = load_set(s)
    mine = write_checkpoint("31b-mini", 0, tmp_path / "mine")
    assert materialise(fs, tmp_path / "w", model=mine) == mine and not (tmp_path / "w").exists()
    other = write_checkpoint("31b-mini", 1, tmp_path / "other")
    want, got = (fs.manifest["model"]["sha256"]["model.safetensors"], sha256_file(other / "model.safetensors"))
    with pytest.raises(FixtureError) as e:
        materialise(fs, tmp_path / "w", model=other)
    assert str(e.value) == (f"{s}: model.safetensors in the checkpoint directory {other} (--model) differs from the "
                            f"set's: sha256 {got}, the set records {want}; {MODEL_HINT}, or regenerate the set for "
                            "this checkpoint")
    # the command line's --model is for external sets: a synthetic set regenerates its checkpoint
    assert main(["check", "--backend", "refimpl", "--fixtures", str(s), "--model", str(other), "-q", *ONE_CASE]) == 0
    assert capsys.readouterr().err == ("conformance: warning: --model applies to external fixture sets only; every "
                                       "set given is synthetic (its checkpoint is regenerated from preset and seed)\n")
    assert main(["verify", str(s), "--model", str(other)]) == 0


def _pytest(tmp_path: Path, *args: str) -> tuple[int, str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's configuration
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", "pytest.ini",
                           "--rootdir", str(tmp_path), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_plugin_takes_the_checkpoint_from_anywhere(small, tmp_path):
    s, ckpt = small
    moved = shutil.copytree(ckpt, tmp_path / "moved")
    s = _with_model(small, tmp_path, path=str(tmp_path / "gone"))
    run = ["--conformance-backend", "refimpl", "--conformance-fixtures", str(s), "-q", "-k", "full/A/"]
    rc, out = _pytest(tmp_path, *run, "--conformance-model", str(moved), "--conformance-rehash")
    assert rc == 0 and "1 passed" in out, out
    rc, out = _pytest(tmp_path, *run)
    hint = MODEL_HINT.replace("--model DIR", "--conformance-model DIR")
    assert rc == 1 and f"could be checked; {hint}" in out, out
    rc, out = _pytest(tmp_path, *run, "--conformance-model", str(tmp_path / "nowhere"))
    assert rc == 4 and f"--conformance-model: no such directory: {tmp_path / 'nowhere'}" in out, out
