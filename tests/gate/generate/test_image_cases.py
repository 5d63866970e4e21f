"""Image cases in the fixture sets (conformance/generate/matrix.py ``generate_image_cases``, conformance/generate/
image bases): the structural rules, what verification catches, generation from image files, and how
the runner treats a backend that does not serve image prompts.

The rows of every image case equal the oracle driven directly by its request: that is
tests/gate/generate/test_generate_sets.py ``test_expected_rows_equal_the_oracle_run_directly`` (parametrised over the
vision presets too). Here: why a case must never cut an image block (on a bidirectional checkpoint the
rows of a cut block differ from the base's), and the rest.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conformance.check import materialise
from conformance.check.profiles import PROFILES
from conformance.check.runner import run
from conformance.generate import generate_set, synthetic_image, verify_set
from conformance.protocol import Capabilities, Response
from conformance.sets import MANIFEST, FixtureError, load_set, sha256_file
from conformance.sets.case import DECODE_STEPS, Case, check_case
from refimpl.model import Gemma4
from refimpl.multimodal import multimodal_inputs
from refimpl.safetensors_io import TensorStore, write_safetensors

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def image_sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image-sets")
    return {p: generate_set(root / p, preset=p, cases="images") for p in ("e2b-vision-mini", "31b-vision-mini")}


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of set ``src`` whose stored tensors went through ``change(tensors)`` (in place; named as in
    one schema 1 file: base/<id>/<leaf>, image/<id>/<j>/<leaf>), with the manifest's hashes updated so only
    the content checks can object."""
    import shutil

    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST).read_text())
    files = {f[len("base-"):-len(".safetensors")]: f for f in m["files"] if f.startswith("base-")}
    tensors = {}
    for b, f in files.items():
        store = TensorStore(dst / f)
        for n in store.names:
            kind, _, rest = n.partition("/")
            tensors[f"{kind}/{b}/{rest}" if kind in ("image", "audio") and rest else f"base/{b}/{n}"] = \
                np.array(store.raw(n))
    change(tensors)
    for b, f in files.items():
        mine = {}
        for n, a in tensors.items():
            kind, base, rest = n.split("/", 2)
            if base == b:
                mine[rest if kind == "base" else f"{kind}/{rest}"] = a
        write_safetensors(dst / f, mine, "F64")
        m["files"][f] = sha256_file(dst / f)
    (dst / MANIFEST).write_text(json.dumps(m))
    return dst


# ----------------------------------------------------------------------------------------------
# the matrix and its rules


def test_image_matrix_covers_the_rows_the_issue_names(image_sets):
    for preset, path in image_sets.items():
        fs = load_set(path)
        blocks = fs.image_blocks()
        assert set(blocks) == {"I0", "I1"} and len(blocks["I0"]) == 1 and len(blocks["I1"]) == 2
        feats = [set(c.features) for c in fs.cases]
        for tag in ("inside-image", "after-image", "boi", "interior", "chunked", "no-output-piece", "multi-row"):
            assert any(tag in f for f in feats), (preset, tag)
        assert all({"image", "embeddings", "decode"} <= f for f in feats)
        assert all(("vision-blocks" in f) == (preset == "31b-vision-mini") for f in feats)
        assert {c.kind for c in fs.cases} == {"last", "prefill"}
        assert all(c.ubatch is None and c.decode_len == DECODE_STEPS for c in fs.cases)
        # a last row right after the block (the prompt ends at eoi) and rows inside it, per base
        for b, spans in blocks.items():
            a, n = spans[0]
            ends = {(c.length, c.last_pos) for c in fs.cases if c.base == b and c.kind == "last"}
            assert (a + n + 1, a + n) in ends and (a + n + 1, a) in ends and (a + n + 1, a + n - 1) in ends


def test_check_case_refuses_what_would_make_expected_rows_wrong(image_sets):
    fs = load_set(image_sets["31b-vision-mini"])
    lengths = {b: len(t) for b, t in fs.bases().items()}
    blocks = fs.image_blocks()
    (a, n), = blocks["I0"]
    ok = Case("s/last/embeddings/I0", "last", "I0", a + n + 1, entry="embeddings", last_pos=a, seq_id=1,
              decode_len=DECODE_STEPS)
    assert check_case(ok, lengths, blocks) == []
    cut = replace(ok, length=a + 5, decode_len=0)
    assert check_case(cut, lengths, blocks) == [
        f"case {cut.id}: the image block at {a} ({n} tokens) is cut by the prompt's end or a piece boundary"]
    into = replace(ok, length=a - 2, last_pos=a - 3)  # decode tokens a-2, a-1 (boi), a: an image token
    assert check_case(into, lengths, blocks) == [
        f"case {into.id}: its decode tokens run into the image block at {a}; decode tokens must be text"]
    plain = replace(ok, entry="seq_id")
    assert check_case(plain, lengths, blocks) == [
        f"case {plain.id}: a case on an image base must be a 'last' or 'prefill' case with entry 'embeddings'"]
    pieces = ((a + 3, (a + 2,)), (n + 1 - 3, (0,)))
    split = Case("s/prefill/I0", "prefill", "I0", a + n + 1, entry="embeddings", pieces=pieces, decode_len=0)
    assert check_case(split, lengths, blocks) == [
        f"case {split.id}: the image block at {a} ({n} tokens) is cut by the prompt's end or a piece boundary"]
    ub = replace(split, pieces=((a + n + 1, (a,)),), ubatch=8)
    assert check_case(ub, lengths, blocks) == [
        f"case {ub.id}: an image case cannot split its prompt into micro-batches (ubatch)"]


def test_a_cut_block_changes_rows_only_on_the_bidirectional_checkpoint(image_sets, tmp_path):
    """Why prompts never cut a block: with vision blocks, an image row sees the later tokens of its block, so
    the prefix forward of a cut block differs from the base row; on a causal checkpoint it does not."""
    for preset, path in image_sets.items():
        fs = load_set(path)
        model = Gemma4(materialise(fs, tmp_path / preset))
        (a, n), = fs.image_blocks()["I0"]
        media = fs.media()["I0"]
        ids = fs.bases()["I0"]
        inputs = multimodal_inputs(model, ids[:a + n // 2], [fs.image_inputs("I0")[0]["soft_tokens"][:n // 2]],
                                   _tokens(fs))
        assert np.array_equal(inputs.embeddings, media.embeddings[:a + n // 2])
        cut = model.forward(inputs.ids, rows=[a + 2], embeddings=inputs.embeddings, vision_blocks=inputs.vision_blocks)
        diff = float(np.abs(cut[0] - fs.oracle_logits(model, tmp_path / preset / "rebuilt")["I0"][a + 2]).max())
        if preset == "31b-vision-mini":
            assert diff > 0.1, diff
        else:
            assert diff < 1e-12, diff


def _tokens(fs):
    from refimpl.multimodal import MultimodalTokens

    t = fs.manifest["images"]["token_ids"]
    return MultimodalTokens(t["image_token_id"], t["boi_token_id"], t["eoi_token_id"], -1, -1)


def test_media_in_the_raw_convention(image_sets):
    fs = load_set(image_sets["e2b-vision-mini"])
    scaled, raw = fs.media("scaled")["I1"], fs.media("raw")["I1"]
    H = scaled.embeddings.shape[1]
    assert raw.images == scaled.images == tuple(fs.image_blocks()["I1"])
    assert np.allclose(raw.embeddings * math.sqrt(H), scaled.embeddings, rtol=1e-15, atol=0)


# ----------------------------------------------------------------------------------------------
# verification


def test_verify_catches_broken_image_tensors(image_sets, tmp_path):
    src = image_sets["e2b-vision-mini"]
    assert verify_set(src, recompute=True, workdir=tmp_path / "w") == []

    def shift(t):
        t["base/I0/images"][0, 0] -= 2  # the block now starts at boi's predecessor (text)

    bad = _rewrite(src, tmp_path / "shift", shift)
    (a, n), = load_set(src).image_blocks()["I0"]
    assert any(f"base I0 image block 0 ({a - 2}, {n}) holds tokens other than the image token" in p
               for p in verify_set(bad))

    def drop(t):
        del t["image/I1/1/soft_tokens"]

    assert any("image/I1/1/soft_tokens is missing" in p for p in verify_set(_rewrite(src, tmp_path / "drop", drop)))

    def soft(t):
        t["image/I0/0/soft_tokens"][3, 5] += 1e-3

    problems = verify_set(_rewrite(src, tmp_path / "soft", soft), recompute=True, workdir=tmp_path / "w")
    assert any("image 0: the vision tower now gives soft tokens that differ by 0.001" in p for p in problems)

    def emb(t):
        t["base/I1/embeddings"][70, 0] += 1e-3

    problems = verify_set(_rewrite(src, tmp_path / "emb", emb), recompute=True, workdir=tmp_path / "w")
    assert any("base I1: the merged input embeddings differ from the stored ones" in p for p in problems)

    def pixels(t):
        t["image/I0/0/pixels"][0, 0, 0] ^= 1

    problems = verify_set(_rewrite(src, tmp_path / "px", pixels), recompute=True, workdir=tmp_path / "w")
    assert any("preprocessing the stored image no longer gives the stored patches" in p for p in problems)
    with pytest.raises(FixtureError, match="holds tokens other than the image token"):
        load_set(bad)


# ----------------------------------------------------------------------------------------------
# generation


def _png(path: Path, img: np.ndarray) -> Path:
    """A minimal 8-bit RGB PNG (filter 0 on every row), written without any imaging library."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    head = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw))
                     + chunk(b"IEND", b""))
    return path


def test_generate_from_image_files_records_and_reuses_them(tmp_path):
    a = _png(tmp_path / "a.png", synthetic_image(7, 0, 40, 90))
    b = _png(tmp_path / "b.png", synthetic_image(7, 1, 120, 30))
    out = generate_set(tmp_path / "set", preset="31b-vision-mini", cases="images", images=[a, b])
    fs = load_set(out)
    i0, i1 = fs.manifest["bases"]["I0"]["images"], fs.manifest["bases"]["I1"]["images"]
    assert [x["name"] for x in i0] == ["a.png"] and [x["name"] for x in i1] == ["b.png", "a.png"]
    assert i0[0]["sha256"] == sha256_file(a) and i0[0]["size"] == [40, 90]
    assert np.array_equal(fs.image_inputs("I0")[0]["pixels"], synthetic_image(7, 0, 40, 90))
    assert np.array_equal(fs.image_inputs("I1")[1]["pixel_values"], fs.image_inputs("I0")[0]["pixel_values"])
    assert verify_set(out, recompute=True, workdir=tmp_path / "w") == []


def test_generate_refuses_impossible_requests(tmp_path):
    with pytest.raises(ValueError, match="cases='images' needs image bases, but .* has no vision tower"):
        generate_set(tmp_path / "a", preset="31b-mini", cases="images")
    with pytest.raises(ValueError, match="prompts make text bases, but cases='images'"):
        generate_set(tmp_path / "b", preset="31b-vision-mini", cases="images", prompts=[{"tokens": [2, 5, 6]}])
    with pytest.raises(ValueError, match="images were given, but cases='text'"):
        generate_set(tmp_path / "c", preset="31b-vision-mini", cases="text", images=[np.zeros((9, 9, 3), np.uint8)])
    with pytest.raises(ValueError, match="cases must be one of auto, text, images, audio, videos, mtp, all"):
        generate_set(tmp_path / "d", preset="31b-vision-mini", cases="pictures")
    with pytest.raises(ValueError, match=r"image 0 must be a file path or a uint8 array \[h, w, 3\]"):
        generate_set(tmp_path / "e", preset="31b-vision-mini", cases="images", images=[np.zeros((9, 9))])
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # nothing left behind


def test_generate_all_holds_text_and_image_cases(tmp_path):
    fs = load_set(generate_set(tmp_path / "all", preset="e2b-vision-mini"))  # auto: a vision tower -> all
    bases = set(fs.bases())
    assert {"A", "B", "C", "G", "I0", "I1"} == bases
    image = [c for c in fs.cases if "image" in c.features]
    assert image and len(image) < len(fs.cases)
    assert all(c.base in ("I0", "I1") for c in image)


def test_generate_cli_with_an_image(tmp_path):
    img = _png(tmp_path / "x.png", synthetic_image(3, 0, 30, 30))
    cmd = [sys.executable, "-m", "conformance.cli", "generate", "--preset", "31b-vision-mini", "--cases", "images",
           "--image", str(img), "--out", str(tmp_path / "set"), "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert load_set(tmp_path / "set").manifest["bases"]["I0"]["images"][0]["name"] == "x.png"
    cmd[cmd.index(str(img))] = str(tmp_path / "nope.png")
    cmd[cmd.index(str(tmp_path / "set"))] = str(tmp_path / "set2")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip() == f"conformance: error: --image: no such file: {tmp_path / 'nope.png'}"


# ----------------------------------------------------------------------------------------------
# the runner


class _TextOnly:
    """A backend that serves the embeddings entry point for text but not image prompts; opening it fails,
    so the test shows the runner never makes it load an image set's checkpoint."""

    name = "text-only"
    capabilities = Capabilities(last_plain=True, last_seq_id=True, last_embeddings=True, interior_rows=True,
                                output_rows=True, chunked_prefill=True, decode=True)

    def open(self, model_dir):
        raise AssertionError("opened an image set although it claims none of its cases")

    def run(self, request):  # pragma: no cover - never reached
        return Response(np.zeros((1, 1)))

    def close(self):
        pass


def test_image_sets_are_not_claimed_by_a_text_only_backend(image_sets, tmp_path):
    result = run(_TextOnly(), [image_sets["31b-vision-mini"]], PROFILES["fp32"], workdir=tmp_path)
    assert {c.status for c in result.cases} == {"not-claimed"}
    assert all("image_prompts" in c.missing for c in result.cases)
    assert result.exit_code == 5
