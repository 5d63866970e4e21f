"""Audio cases in the fixture sets (``generate_image_cases(..., kind="audio")``, the audio bases of
conformance/generate/): the matrix, the structural rules, what verification catches, generation from
WAV files, the requests (features travel with the embeddings), and a text-only backend.

That every audio case's rows equal the oracle driven by its request is
tests/gate/generate/test_generate_sets.py ``test_expected_rows_equal_the_oracle_run_directly`` (which covers
e2b-audio-mini);
that the refimpl backend, which runs its own audio tower from the request's features, passes the bundled
audio set is below.
"""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_image_cases import _rewrite, _TextOnly

from conformance.check.profiles import PROFILES
from conformance.check.requests import build_request
from conformance.check.runner import run
from conformance.generate import generate_set, synthetic_waveform, verify_set
from conformance.protocol import required_capabilities
from conformance.sets import bundled_set, load_set, sha256_file
from conformance.sets.case import DECODE_STEPS, Case, check_case

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def audio_set() -> Path:
    return bundled_set("e2b-audio-mini")


def _wav(path: Path, samples: np.ndarray, rate: int = 16_000) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def test_audio_matrix_and_requests(audio_set):
    fs = load_set(audio_set)
    blocks = fs.audio_blocks()
    assert set(blocks) == {"S0", "S1"} and len(blocks["S0"]) == 1 and len(blocks["S1"]) == 2
    assert fs.image_blocks() == {}
    feats = [set(c.features) for c in fs.cases]
    for tag in ("inside-audio", "after-audio", "boa", "interior", "chunked", "no-output-piece"):
        assert any(tag in f for f in feats), tag
    assert all({"audio", "embeddings", "decode", "ple"} <= f and "vision-blocks" not in f for f in feats)
    media = fs.media()
    for case in fs.cases:
        req = build_request(case, fs.bases(), lambda ids: None, media)
        assert set(required_capabilities(req)) >= {"audio_prompts", "decode"}
        assert "image_prompts" not in required_capabilities(req)
        assert len(req.audio_inputs) == len(req.audio) >= 1
        for (_, n), clip in zip(req.audio, req.audio_inputs, strict=True):
            T = clip.features.shape[0]
            assert clip.mask.dtype == bool and clip.mask.shape == (T,) and clip.features.shape[1] == 128
            assert (int(clip.mask[::4].sum()) == n)  # a soft token per valid 4th frame (two stride-2 convs)


def test_check_case_rules_name_the_audio_block(audio_set):
    fs = load_set(audio_set)
    lengths = {b: len(t) for b, t in fs.bases().items()}
    blocks = fs.audio_blocks()
    (a, n), = blocks["S0"]
    ok = Case("s/last/embeddings/S0", "last", "S0", a + n + 1, entry="embeddings", last_pos=a, seq_id=1,
              decode_len=DECODE_STEPS)
    assert check_case(ok, lengths, blocks) == []
    cut = replace(ok, length=a + 2, decode_len=0)
    assert check_case(cut, lengths, blocks) == [
        f"case {cut.id}: the audio block at {a} ({n} tokens) is cut by the prompt's end or a piece boundary"]
    plain = replace(ok, entry="plain")
    assert check_case(plain, lengths, blocks) == [
        f"case {plain.id}: a case on an audio base must be a 'last' or 'prefill' case with entry 'embeddings'"]


def test_verify_catches_broken_audio_tensors(audio_set, tmp_path):
    assert verify_set(audio_set, recompute=True, workdir=tmp_path / "w") == []

    def soft(t):
        t["audio/S0/0/soft_tokens"][2, 3] += 1e-3

    problems = verify_set(_rewrite(audio_set, tmp_path / "soft", soft), recompute=True, workdir=tmp_path / "w")
    assert any("base S0: audio 0: the audio tower now gives other soft tokens" in p for p in problems)

    def wave_(t):
        t["audio/S1/1/waveform"][100] += 0.25

    problems = verify_set(_rewrite(audio_set, tmp_path / "wave", wave_), recompute=True, workdir=tmp_path / "w")
    assert any("base S1: audio 1: feature extraction of the stored waveform no longer gives the stored features"
               in p for p in problems)

    def shift(t):
        t["base/S1/audio"][1, 0] += 1

    (a, n) = load_set(audio_set).audio_blocks()["S1"][1]
    assert any(f"base S1 audio block 1 ({a + 1}, {n}) holds tokens other than the audio token" in p
               for p in verify_set(_rewrite(audio_set, tmp_path / "shift", shift)))

    def drop(t):
        del t["audio/S0/0/mask"]

    assert any("audio/S0/0/mask is missing" in p for p in verify_set(_rewrite(audio_set, tmp_path / "drop", drop)))


def test_generate_from_wav_files(tmp_path):
    a = _wav(tmp_path / "a.wav", synthetic_waveform(5, 0, 0.6))
    b = _wav(tmp_path / "b.wav", synthetic_waveform(5, 1, 0.4))
    out = generate_set(tmp_path / "set", preset="e2b-audio-mini", cases="audio", audio=[a, b])
    fs = load_set(out)
    s0, s1 = fs.manifest["bases"]["S0"]["audio"], fs.manifest["bases"]["S1"]["audio"]
    assert [x["name"] for x in s0] == ["a.wav"] and [x["name"] for x in s1] == ["b.wav", "a.wav"]
    assert s0[0]["sha256"] == sha256_file(a) and s0[0]["samples"] == 9600
    assert verify_set(out, recompute=True, workdir=tmp_path / "w") == []
    cmd = [sys.executable, "-m", "conformance.cli", "generate", "--preset", "e2b-audio-mini", "--cases", "audio",
           "--audio", str(tmp_path / "nope.wav"), "--out", str(tmp_path / "set2"), "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip() == f"conformance: error: --audio: no such file: {tmp_path / 'nope.wav'}"


def test_generate_refuses_impossible_audio_requests(tmp_path):
    with pytest.raises(ValueError, match="cases='audio' needs audio bases, but .* has no audio tower"):
        generate_set(tmp_path / "a", preset="31b-vision-mini", cases="audio")
    with pytest.raises(ValueError, match="audio was given, but cases='images' writes no audio base"):
        generate_set(tmp_path / "b", preset="e2b-audio-mini", cases="images", audio=[np.zeros(8000)])
    with pytest.raises(ValueError, match="prompts make text bases, but cases='audio'"):
        generate_set(tmp_path / "c", preset="e2b-audio-mini", cases="audio", prompts=[{"tokens": [2, 5]}])
    with pytest.raises(ValueError, match=r"audio clip 0 must be a WAV path or a float array \[n\]"):
        generate_set(tmp_path / "d", preset="e2b-audio-mini", cases="audio", audio=[np.zeros((2, 8))])
    sr = _wav(tmp_path / "sr.wav", synthetic_waveform(1, 0, 0.5, 8000), rate=8000)
    with pytest.raises(Exception, match="16000"):
        generate_set(tmp_path / "e", preset="e2b-audio-mini", cases="audio", audio=[sr])


def test_refimpl_runs_its_own_tower_and_a_text_only_backend_is_not_opened(audio_set, tmp_path):
    from conformance.backends.refimpl_backend import RefimplBackend

    result = run(RefimplBackend(), [audio_set], PROFILES["exact-f64"], workdir=tmp_path)
    assert {c.status for c in result.cases} == {"pass"}
    assert all('"audio_soft_tokens": "refimpl audio tower"' in json.dumps(c.executed) for c in result.cases)
    result = run(_TextOnly(), [audio_set], PROFILES["fp32"], workdir=tmp_path)
    assert {c.status for c in result.cases} == {"not-claimed"}
    assert all("audio_prompts" in c.missing for c in result.cases)
