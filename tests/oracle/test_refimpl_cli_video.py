"""``refimpl logits|generate --video DIR`` (issue 58): a video as a directory of frames, through the command line,
equal bit for bit to refimpl.video + multimodal_logits called directly (which tests/oracle/towers/test_video_merge.py
holds against transformers), and its bad inputs as one error line with exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_refimpl_cli import run, write_png

from refimpl.chat import encode_conversation, user_turn
from refimpl.frontends import image_front_end
from refimpl.image import read_image
from refimpl.model import Gemma4
from refimpl.multimodal import load_multimodal_tokens, multimodal_logits
from refimpl.safetensors_io import TensorStore
from refimpl.tokenizer import Tokenizer
from refimpl.video import VideoSettings, load_video_settings, preprocess_video, video_ids

PRESET = "e2b-vision-mini"


@pytest.fixture(scope="module")
def frames_dir(tmp_path_factory):
    """5 frames of 30 x 50 (resized to the video budget), as PNG files."""
    root = tmp_path_factory.mktemp("video")
    rng = np.random.default_rng(9)
    for k in range(5):
        write_png(root / f"frame{k:03d}.png", rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    return root


def _metadata(path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]


@pytest.mark.parametrize("preset", [PRESET, "12b-mini"])
def test_logits_with_a_video_equal_the_library(tmp_path, preset_dirs, frames_dir, capsys, preset):
    """Gemma 4 (vision tower) and Gemma 4 Unified (encoder-free embedder) alike."""
    model_dir = preset_dirs[preset]
    out_file = tmp_path / "video.safetensors"
    prompt = "what happens in <|video|> here"
    code, out, err = run(capsys, "logits", "--model", str(model_dir), "--prompt", prompt, "--video", str(frames_dir),
                         "--fps", "0.5", "--num-frames", "3", "--rows", "all", "--out", str(out_file), "--top-k", "1")
    assert code == 0, err
    tok, mm = Tokenizer.from_dir(model_dir), load_multimodal_tokens(model_dir)
    settings = load_video_settings(model_dir)
    front = image_front_end(model_dir).with_budget(settings.max_soft_tokens)
    frames = [read_image(p) for p in sorted(frames_dir.iterdir())]
    video = preprocess_video(frames, 0.5, front.preprocess_frame, VideoSettings(settings.max_soft_tokens, 3))
    assert video.indices.tolist() == [0, 1, 3] and video.timestamps == ["00:00", "00:02", "00:06"]
    ids = tok.encode(prompt)
    at = ids.index(mm.video_token_id)
    expanded = ids[:at] + video_ids(video, mm, lambda t: tok.encode(t, add_bos=False)).tolist() + ids[at + 1:]
    soft = [front.soft_tokens(p) for p in video.processed]
    expected = multimodal_logits(Gemma4(model_dir), expanded, [], mm, rows="all", video_soft_tokens=soft)
    store = TensorStore(out_file)
    assert np.array_equal(store.get("logits"), expected)  # bit for bit
    assert store.raw("tokens").tolist() == expanded
    (info,) = json.loads(_metadata(out_file)["videos"])
    assert (info["frames"], info["kept"], info["per_frame"]) == (5, 3, video.num_soft_tokens)
    first = expanded.index(mm.video_token_id)
    last = len(expanded) - 1 - expanded[::-1].index(mm.video_token_id)
    assert info["rows"] == [first, last]
    assert f"  video 0 {frames_dir}: 3 of 5 frames at 0.5 fps, 30x50 (HxW) resized to" in out


def test_generate_with_a_video_runs_and_a_missing_fps_warns(preset_dirs, frames_dir, capsys):
    model_dir = preset_dirs[PRESET]
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "see", "--video", str(frames_dir),
                         "--num-frames", "2", "--max-new-tokens", "2")
    assert code == 0, err
    assert "warning: --fps not given: the frames are stamped at 24 frames a second" in err
    assert "  video 0 " in err and "2 of 5 frames at 24 fps" in err


def test_chat_puts_the_video_at_the_start_of_the_user_turn(tmp_path, preset_dirs, frames_dir, capsys):
    """--chat with --video: a {"type": "video"} item in front of the text, as transformers' processors pass it; the
    checkpoint without a chat template gets the hand-written Gemma 4 format, its <|video|> expanded into the frames."""
    model_dir = preset_dirs[PRESET]
    out_file = tmp_path / "chat.safetensors"
    code, out, err = run(capsys, "logits", "--model", str(model_dir), "--prompt", "what is this", "--chat", "--video",
                         str(frames_dir), "--fps", "1", "--num-frames", "2", "--out", str(out_file))
    assert code == 0, err
    tok, mm = Tokenizer.from_dir(model_dir), load_multimodal_tokens(model_dir)
    bare = encode_conversation(tok, model_dir, user_turn("what is this", ["video"])).ids
    assert bare.count(mm.video_token_id) == 1
    got = TensorStore(out_file).raw("tokens").tolist()
    at = bare.index(mm.video_token_id)
    assert got[:at] == bare[:at] and got[len(got) - (len(bare) - at - 1):] == bare[at + 1:]
    frames = got[at:len(got) - (len(bare) - at - 1)]
    assert frames.count(mm.boi_token_id) == 2 and frames[-1] == mm.eoi_token_id


@pytest.mark.parametrize("argv, message", [
    (["--video", "{empty}"], "the video has no frames (no image file: "),
    (["--video", "{mixed}"], "the video's frames differ in size (20x20, 30x50, HxW)"),
    (["--video", "{frames}", "--fps", "0", "--num-frames", "2"],
     "the frame rate must be a positive number of frames a second, got 0.0"),
    (["--video", "{frames}", "--num-frames", "9"],
     "the video has 5 frame(s), fewer than the 9 the processor samples"),
    (["--fps", "2"], "--fps applies to --video"),
    (["--video", "{frames}", "--video", "{frames}", "--prompt", "a <|video|> b"],
     "the prompt holds 1 video placeholder(s)"),
])
def test_bad_video_input_is_one_error_line_and_exit_2(tmp_path, preset_dirs, frames_dir, capsys, argv, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    rng = np.random.default_rng(1)
    write_png(mixed / "a.png", rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    write_png(mixed / "b.png", rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    argv = [a.format(empty=empty, mixed=mixed, frames=frames_dir) for a in argv]
    if "--prompt" not in argv:
        argv += ["--prompt", "x"]
    code, out, err = run(capsys, "logits", "--model", str(preset_dirs[PRESET]), *argv,
                         "--out", str(tmp_path / "o.safetensors"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err and "Traceback" not in err


def test_too_many_frames_for_the_context_is_one_line(tmp_path, preset_dirs, capsys):
    """60 frames of 70 soft tokens (4,141 tokens with the markers and timestamps) past the 4,096-token context:
    refused before any tower runs, one line, exit 2, nothing written."""
    rng = np.random.default_rng(3)
    many = tmp_path / "many"
    many.mkdir()
    for k in range(60):
        write_png(many / f"f{k:03d}.png", rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    argv = ["logits", "--model", str(preset_dirs[PRESET]), "--prompt", "x", "--video", str(many), "--fps", "1",
            "--num-frames", "60", "--out", str(tmp_path / "o.safetensors")]
    code, out, err = run(capsys, *argv)
    assert code == 2 and err == ("refimpl: error: the prompt is 4141 tokens long, beyond the checkpoint's context of "
                                 "4096 tokens (max_position_embeddings in config.json); pass --allow-beyond-context "
                                 "to run it anyway\n")
    assert not (tmp_path / "o.safetensors").exists()
