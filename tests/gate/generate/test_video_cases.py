"""Video cases in the fixture sets (issue 58; conformance/generate/video.py): the video bases (a synthetic video's
kept frames, each a vision block of the video token after its timestamp's text), the matrix over them, the
requests (frames among the image blocks, ``videos`` naming them), the capability, what verification catches, and
the backends that grade them: the oracle and the NumPy engine at exact-f64, transformers (its own model: token type
2 at frames, the pad row for their per-layer inputs, its own video features on Gemma 4 Unified) at fp32.

The oracle's video prompts against transformers float64 are tests/oracle/towers/test_video_merge.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_image_cases import _rewrite

from conformance.check.requests import build_request
from conformance.generate import generate_set
from conformance.generate.video import VIDEO_FPS, VIDEO_FRAMES
from conformance.protocol import Capabilities, claims, required_capabilities
from conformance.protocol.wire import request_from_json, request_to_json
from conformance.sets import load_set
from conformance.sets.integrity import read_set
from refimpl.multimodal import load_multimodal_tokens
from refimpl.tokenizer import Tokenizer
from refimpl.video import frame_timestamps


@pytest.fixture(scope="module")
def video_set(tmp_path_factory) -> Path:
    return generate_set(tmp_path_factory.mktemp("videos") / "set", preset="e2b-vision-mini", cases="videos",
                        workers=1)


def test_the_video_bases_are_the_processors_layout(video_set):
    """V0 keeps 2 frames of 4, V1 4 of 8, one second apart at VIDEO_FPS: every frame a run of the video token
    (as many as its stored soft tokens) between boi and eoi, after "mm:ss " as the tokenizer writes it (the first
    frame) or " mm:ss " (the next ones); the manifest names the video token and the processor's budget."""
    fs = load_set(video_set)
    manifest = json.loads((video_set / "manifest.json").read_text())
    assert manifest["videos"]["processor"]["max_soft_tokens"] == 70
    groups, blocks, bases = fs.video_groups(), fs.image_blocks(), fs.bases()
    assert set(groups) == {"V0", "V1"} and fs.audio_blocks() == {}
    video_token = manifest["videos"]["token_ids"]["video_token_id"]
    boi, eoi = manifest["videos"]["token_ids"]["boi_token_id"], manifest["videos"]["token_ids"]["eoi_token_id"]
    for b, (total, kept) in VIDEO_FRAMES.items():
        assert groups[b] == [(0, kept)] and len(blocks[b]) == kept
        ids = bases[b]
        stamps = frame_timestamps(np.arange(kept) * total // kept, VIDEO_FPS)
        assert stamps[:2] == ["00:00", "00:01"]
        stored = fs.image_inputs(b)
        for j, (a, n) in enumerate(blocks[b]):
            assert ids[a - 1] == boi and ids[a + n] == eoi and np.all(ids[a:a + n] == video_token)
            assert stored[j]["soft_tokens"].shape[0] == n
        info = fs.manifest["bases"][b]["videos"][0]
        assert info["timestamps"] == stamps and info["kept"] == kept


def test_the_timestamps_are_the_tokenizers_text(video_set, tmp_path):
    """Between the frames the prompt holds exactly the tokenizer's ids of " mm:ss " (before the first frame
    "mm:ss "), as transformers' processor writes the expanded text."""
    from refimpl.synth import write_checkpoint

    ckpt = write_checkpoint("e2b-vision-mini", 0, tmp_path / "ckpt")
    tok, mm = Tokenizer.from_dir(ckpt), load_multimodal_tokens(ckpt, ["image"])
    fs = load_set(video_set)
    for b, (total, kept) in VIDEO_FRAMES.items():
        ids, blocks = fs.bases()[b], fs.image_blocks()[b]
        stamps = frame_timestamps(np.arange(kept) * total // kept, VIDEO_FPS)
        ends = [0] + [a + n + 1 for a, n in blocks]  # after each eoi
        for j, (a, _) in enumerate(blocks):
            want = tok.encode(f"{stamps[j]} " if j == 0 else f" {stamps[j]} ", add_bos=False)
            got = [int(t) for t in ids[a - 1 - len(want):a - 1]]
            assert got == want, (b, j)
            if j:
                assert a - 1 - len(want) == ends[j]  # nothing else between two frames
        assert mm.video_token_id == int(ids[blocks[0][0]])


def test_the_matrix_and_the_requests(video_set, tmp_path):
    """15 cases a base with the video tags; a prompt that ends after the first frame carries one frame of the
    video, the full prompt all of them; requests need video_prompts besides image_prompts, a backend without it
    claims none, and ``videos`` survives the subprocess protocol's JSON."""
    fs = load_set(video_set)
    assert len(fs.cases) == 30
    feats = [set(c.features) for c in fs.cases]
    assert all({"video", "embeddings", "decode", "ple"} <= f for f in feats)
    for tag in ("inside-video", "after-video", "boi", "interior", "chunked"):
        assert any(tag in f for f in feats), tag
    media, bases = fs.media(), fs.bases()
    seen = set()
    for case in fs.cases:
        req = build_request(case, bases, lambda ids: None, media)
        assert req.videos and len(req.images) == len(req.image_inputs)
        (first, n), = req.videos
        assert first == 0 and n == len(req.images)
        seen.add(n)
        need = required_capabilities(req)
        assert "video_prompts" in need and "image_prompts" in need
        back = request_from_json(request_to_json(req, tmp_path), tmp_path)
        assert back.videos == req.videos and back.images == req.images
    assert seen == {1, 2, 4}  # after V0's or V1's first frame, all of V0, all of V1
    assert not claims(Capabilities(image_prompts=True, last_embeddings=True).to_dict(), "video_prompts")


@pytest.mark.parametrize("backend,profile", [("refimpl", "exact-f64"), ("numpy-engine", "exact-f64"),
                                             ("refimpl-subprocess", "exact-f64"), ("transformers", "fp32")])
def test_the_backends_pass_the_video_cases(video_set, tmp_path, backend, profile):
    from conformance.cli import main

    assert main(["check", "--backend", backend, "--fixtures", str(video_set), "--profile", profile, "-q",
                 "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [c["status"] for c in report["cases"]] == ["pass"] * 30


def test_unified_frames_through_transformers_own_video_features(tmp_path):
    """Gemma 4 Unified (12b-mini) under the all-unclamped vision mask (transformers' own rule there): transformers
    passes every video case with the request's soft tokens and with its own get_video_features."""
    from conformance.cli import main

    out = generate_set(tmp_path / "set", preset="12b-mini", cases="videos", workers=1, vision_mask="all-unclamped")
    for extra in ([], ["--backend-option", "image_tower=on"]):
        assert main(["check", "--backend", "transformers", *extra, "--fixtures", str(out), "-q",
                     "--json", str(tmp_path / "r.json")]) == 0
        cases = json.loads((tmp_path / "r.json").read_text())["cases"]
        assert len(cases) == 30 and all(c["status"] == "pass" for c in cases)
        if extra:
            assert all("(get_video_features)" in json.dumps(c["executed"]) for c in cases)


def test_verification_catches_a_frame_of_the_wrong_token_and_bad_groups(video_set, tmp_path):
    fs = load_set(video_set)
    a, n = fs.image_blocks()["V0"][1]
    boi = fs.manifest["videos"]["token_ids"]["boi_token_id"]

    def wrong_token(t):
        t["base/V0/tokens"][a:a + n] = boi

    problems, _ = read_set(_rewrite(video_set, tmp_path / "t1", wrong_token))
    assert any(f"base V0 image block 1 ({a}, {n}) holds tokens other than the video token" in p for p in problems)

    def overlapping(t):
        t["base/V1/videos"] = np.array([[0, 3], [2, 2]], dtype=np.int64)

    problems, _ = read_set(_rewrite(video_set, tmp_path / "t2", overlapping))
    assert any("base/V1/videos [(0, 3), (2, 2)] must name runs of 1 or more of the base's 4 vision blocks, none "
               "shared" in p for p in problems)


def test_bad_requests_for_videos_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^cases='videos' writes the video matrix only \(bases V0, V1 of synthetic "
                                         r"videos\): no prompts, images or audio$"):
        generate_set(tmp_path / "a", preset="e2b-vision-mini", cases="videos", images=[np.zeros((8, 8, 3), np.uint8)])
    with pytest.raises(ValueError, match=r"cases='videos' needs video bases, but .* has no vision tower"):
        generate_set(tmp_path / "b", preset="e2b-mini", cases="videos")
