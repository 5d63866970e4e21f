"""Video prompts (refimpl.video + refimpl.multimodal) against transformers' ``Gemma4ForConditionalGeneration``,
float64 with the float32 spots patched (issue 58, part 1).

The checkpoints of tests/oracle/towers/test_image_merge.py's kind (a tiny vision tower; text: hidden 64, 3 layers
sliding/sliding/full, window 8, PLE), one with vision blocks and one causal. A video of 84 x 120 frames (the size
the video budget of 70 soft tokens keeps: no resize, so the pixels are the processor's whatever its resize
rounds) sampled to 3 frames; the prompt ``text + "mm:ss " + boi + video x 70 + eoi + " mm:ss " + ... + text``;
transformers gets input_ids, pixel_values_videos (float64), video_position_ids, num_frames_per_video and
mm_token_type_ids (2 at the video tokens). Every row of the logits is compared. Also: each frame is its own
vision block, the timestamps and markers outside; the layout against transformers' own processor rules
(frame sampling, timestamps, the replacement text, the resize rule at the video budget); the bad inputs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_towers import TINY_TEXT, TINY_TOKEN_IDS, tiny_vision_checkpoints, vision_float64_exact
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl.errors import ConfigError, InputError
from refimpl.image import preprocess_image
from refimpl.model import Gemma4, KVCache
from refimpl.multimodal import MultimodalTokens, load_multimodal_tokens, multimodal_inputs, multimodal_logits
from refimpl.resample import resize_bicubic, resize_bicubic_torch
from refimpl.video import (
    VideoSettings,
    check_frames,
    frame_timestamps,
    load_video_settings,
    preprocess_video,
    sample_frame_indices,
    video_frame_size,
    video_ids,
)
from refimpl.vision import load_vision_tower, vision_tower, vision_tower_batch

EXACT_BOUND = 5e-12  # as for image prompts (tests/oracle/towers/test_image_merge.py)

TEXT, TOKEN_IDS = TINY_TEXT, TINY_TOKEN_IDS
VID, BOI, EOI = TOKEN_IDS["video_token_id"], TOKEN_IDS["boi_token_id"], TOKEN_IDS["eoi_token_id"]
FRAME = (84, 120)  # 21 x 30 patches of 4 = 630 = 70 x 3^2: kept as it is at the video budget
FPS = 0.8  # 7 frames: kept 0, 2, 4 -> 00:00, 00:02, 00:05


def encode(text: str) -> list[int]:
    """A stand-in tokenizer for the timestamps (the forward only needs ids): one id a character."""
    return [3 + (ord(c) % 400) for c in text]


@pytest.fixture(scope="module")
def env(torch_one_thread):
    return torch_one_thread


@pytest.fixture(scope="module")
def video():
    rng = np.random.default_rng(58)
    frames = [rng.integers(0, 256, (*FRAME, 3), dtype=np.uint8) for _ in range(7)]
    return preprocess_video(frames, FPS, lambda f: preprocess_image(f, 4, 3, 70, resize_bicubic_torch),
                            VideoSettings(70, 3))


@pytest.fixture(scope="module")
def checkpoints(env, tmp_path_factory):
    """{name: (dir, float64 HF model)} for "vision" (bidirectional blocks) and "causal"."""
    return tiny_vision_checkpoints(env, tmp_path_factory, "video", seed=5)


def _prompt(video, tokens: MultimodalTokens) -> np.ndarray:
    rng = np.random.default_rng(3)
    return np.concatenate([[2], rng.integers(3, 480, 5), video_ids(video, tokens, encode),
                           rng.integers(3, 480, 6)]).astype(np.int64)


def _hf_logits(env, hf, ids, video):
    torch, mg, hf_reference = env
    pixels = np.stack([p.pixel_values for p in video.processed])  # [F, 630, 48]
    positions = np.stack([p.positions for p in video.processed])  # [F, 630, 2]
    types = np.where(ids == VID, 2, 0)[None]
    with torch.no_grad(), vision_float64_exact(torch, mg, hf_reference):
        out = hf(input_ids=torch.from_numpy(ids[None]), pixel_values_videos=torch.from_numpy(pixels),
                 video_position_ids=torch.from_numpy(positions), num_frames_per_video=torch.tensor([video.frames]),
                 mm_token_type_ids=torch.from_numpy(types), use_cache=False)
    return out.logits[0].numpy()


@pytest.mark.hf
@pytest.mark.parametrize("name", ["vision", "causal"])
def test_video_prompt_logits_equal_transformers(name, checkpoints, video, env):
    path, hf = checkpoints[name]
    tokens = load_multimodal_tokens(path)
    ids = _prompt(video, tokens)
    frames = list(vision_tower_batch(np.stack([p.pixel_values for p in video.processed]),
                                     np.stack([p.positions for p in video.processed]), *load_vision_tower(path)))
    model = Gemma4(path)
    ours = multimodal_logits(model, ids, [], tokens, video_soft_tokens=frames)
    theirs = _hf_logits(env, hf, ids, video)
    diff = float(np.abs(ours - theirs).max())
    print(f"\n{name}: {video.frames} frames of {video.num_soft_tokens} soft tokens, T={len(ids)}: "
          f"max |refimpl - transformers| = {diff:.2e} (logits up to {np.abs(theirs).max():.1f})")
    assert ours.shape == theirs.shape == (len(ids), TEXT["vocab_size"]) and diff < EXACT_BOUND
    m = multimodal_inputs(model, ids, [], tokens, video_soft_tokens=frames)
    if name == "vision":  # each frame its own block; markers and timestamps outside
        assert sorted(set(m.vision_blocks.tolist())) == [-1, 0, 1, 2]
        assert (m.vision_blocks[ids != VID] == -1).all()
        one_block = np.where(ids == VID, 0, -1)  # the frames as one block: another function
        wrong = model.forward(m.ids, embeddings=m.embeddings, vision_blocks=one_block)
        assert np.abs(wrong - theirs).max() > 0.1
    else:
        assert m.vision_blocks is None
    assert (m.ids[ids == VID] == 0).all()  # the pad row of the per-layer table


def _processor_text(indices, fps: float, soft_tokens: int) -> str:
    """transformers' own replacement text of one video (Gemma4Processor.replace_video_token, its timestamps from
    VideoMetadata.timestamps), called on a stand-in processor that has only the three token strings it reads."""
    from types import SimpleNamespace

    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata

    me = SimpleNamespace(boi_token="<|image>", video_token="<|video|>", eoi_token="<image|>")
    meta = VideoMetadata(total_num_frames=int(max(indices)) + 1, fps=fps, frames_indices=list(indices))
    return Gemma4Processor.replace_video_token(me, {"num_soft_tokens_per_video": [soft_tokens],
                                                    "video_metadata": [meta]}, 0)


def test_the_layout_follows_the_processors_rules():
    """Frame sampling, timestamps and the frame size: transformers' own functions (the video processor's size rule
    is a copy of the image processor's, marked so; its module needs torchvision to import)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    for total, n in [(7, 3), (100, 32), (32, 32), (5, 1)]:
        meta = VideoMetadata(total_num_frames=total, fps=24.0)
        assert sample_frame_indices(total, n).tolist() == default_sample_indices_fn(meta, num_frames=n).tolist()
    idx = [0, 31, 1440, 1499, 86400]
    for fps in (24.0, 0.8, 29.97):
        stamps = [part.split()[0] for part in _processor_text(idx, fps, 1).split("<image|>")[:-1]]
        assert frame_timestamps(idx, fps) == stamps
    assert frame_timestamps([0, 2, 4], FPS) == ["00:00", "00:02", "00:05"]
    for h, w in [(84, 120), (480, 640), (1080, 1920), (30, 400)]:
        assert video_frame_size(h, w, 16, 3) == get_aspect_ratio_preserving_size(h, w, 16, 70 * 9, 3)


def test_the_frames_tokens_are_the_processors_replacement(video):
    """The ids of one video: transformers' replacement text ("mm:ss " + boi + video x N + eoi, joined by one space)
    with the timestamps tokenized between the special tokens."""
    tokens = MultimodalTokens(**{k.replace("eoa_token_index", "eoa_token_id"): v for k, v in TOKEN_IDS.items()})
    ids = video_ids(video, tokens, encode).tolist()
    pieces = {BOI: "<|image>", VID: "<|video|>", EOI: "<image|>"}
    rendered, run = "", []
    for i in ids:
        if i in pieces:
            rendered += "".join(chr((c - 3) % 400) for c in run) + pieces[i]
            run = []
        else:
            run.append(i)
    assert rendered == _processor_text(video.indices.tolist(), FPS, video.num_soft_tokens)
    assert video.timestamps == ["00:00", "00:02", "00:05"]


def test_bad_videos_are_one_line_errors():
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
    cases = [
        (lambda: check_frames([]), r"^the video has no frames$"),
        (lambda: check_frames([frame, frame[:6]]), r"frames differ in size \(6x12, 12x12, HxW\)"),
        (lambda: sample_frame_indices(4, 32), r"has 4 frame\(s\), fewer than the 32 the processor samples; give "
                                              r"num_frames <= 4 \(--num-frames\)"),
        (lambda: frame_timestamps([0, 1], 0), r"frame rate must be a positive number .* got 0"),
        (lambda: frame_timestamps([0, 1], float("nan")), r"frame rate must be a positive number"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def test_the_video_processor_settings_of_a_checkpoint(tmp_path):
    """processor_config.json's "video_processor": its budget and frame count, else the processor's defaults."""
    assert load_video_settings(tmp_path) == VideoSettings(70, 32)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"max_soft_tokens": 140,
                                                                                    "num_frames": 8}}))
    assert load_video_settings(tmp_path) == VideoSettings(140, 8)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"max_soft_tokens": 71}}))
    with pytest.raises(ConfigError, match=r"\['video_processor'\]: 'max_soft_tokens' must be one of 70, 140, 280, "
                                          r"560, 1120, got 71$"):
        load_video_settings(tmp_path)


@pytest.mark.parametrize("h, w, budget, patch", [(40, 56, 70, 4), (200, 120, 70, 4), (17, 23, 280, 16),
                                                 (480, 640, 70, 16), (1080, 1920, 280, 16), (300, 7, 70, 16)])
def test_frames_resize_as_the_video_processor_does(h, w, budget, patch):
    """resize_bicubic_torch is torch's interpolate(uint8, bicubic, antialias) bit for bit (what torchvision's resize
    of a uint8 frame runs on the CPU), up- and downscaling; Pillow's rule (the image processors') is not."""
    torch = pytest.importorskip("torch")
    img = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    H, W = video_frame_size(h, w, patch, 3, VideoSettings(budget))
    theirs = torch.nn.functional.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None], size=(H, W),
                                             mode="bicubic", antialias=True)[0].permute(1, 2, 0).numpy()
    ours = resize_bicubic_torch(img, H, W)
    assert ours.dtype == np.uint8 and np.array_equal(ours, theirs)
    if (h, w) in [(40, 56), (200, 120)]:  # measured: Pillow's taps round a few values otherwise
        assert not np.array_equal(resize_bicubic(img, H, W), theirs)


def _hf_logits_videos(env, hf, ids, videos):
    """transformers' logits with several videos (their frames concatenated, num_frames_per_video; each frame padded
    to the budget's 630 patches with zero pixels at position (-1, -1), as the video processor pads)."""
    torch, mg, hf_reference = env

    def padded(p):
        n = 630 - len(p.pixel_values)
        return (np.concatenate([p.pixel_values, np.zeros((n, p.pixel_values.shape[1]))]),
                np.concatenate([p.positions, np.full((n, 2), -1, dtype=np.int64)]))

    frames = [padded(p) for v in videos for p in v.processed]
    pixels, positions = np.stack([f[0] for f in frames]), np.stack([f[1] for f in frames])
    types = np.where(ids == VID, 2, 0)[None]
    with torch.no_grad(), vision_float64_exact(torch, mg, hf_reference):
        out = hf(input_ids=torch.from_numpy(ids[None]), pixel_values_videos=torch.from_numpy(pixels),
                 video_position_ids=torch.from_numpy(positions),
                 num_frames_per_video=torch.tensor([v.frames for v in videos]),
                 mm_token_type_ids=torch.from_numpy(types), use_cache=False)
    return out.logits[0].numpy()


@pytest.mark.hf
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.tuples(st.integers(12, 90), st.integers(12, 90), st.integers(1, 4)), min_size=1, max_size=2),
       fps=st.sampled_from([0.5, 1.0, 24.0]), seed=st.integers(0, 2**16), name=st.sampled_from(["vision", "causal"]))
def test_drawn_videos_equal_transformers_whole_and_chunked(checkpoints, env, sizes, fps, seed, name):
    """Videos of drawn frame sizes (resized to the budget by the video processor's rule, so frames of different
    videos differ in size and soft-token count) and frame counts: the oracle's logits equal transformers' over the
    whole prompt, and the same prompt fed in chunks through the KV cache (cut at frame boundaries: a frame's block
    is never split) equals them too."""
    path, hf = checkpoints[name]
    tokens = load_multimodal_tokens(path)
    rng = np.random.default_rng(seed)
    videos = [preprocess_video([rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)], fps,
                               lambda f: preprocess_image(f, 4, 3, 70, resize_bicubic_torch), VideoSettings(70, n))
              for h, w, n in sizes]
    ids = [2, *rng.integers(3, 480, 3)]
    for v in videos:
        ids += [*video_ids(v, tokens, encode), *rng.integers(3, 480, 2)]
    ids = np.asarray(ids, dtype=np.int64)
    weights, cfg = load_vision_tower(path)
    frames = [vision_tower(p.pixel_values, p.positions, weights, cfg) for v in videos for p in v.processed]
    model = Gemma4(path)
    theirs = _hf_logits_videos(env, hf, ids, videos)
    ours = multimodal_logits(model, ids, [], tokens, video_soft_tokens=frames)
    assert np.abs(ours - theirs).max() < EXACT_BOUND
    m = multimodal_inputs(model, ids, [], tokens, video_soft_tokens=frames)
    ends = [int(e) + 1 for e in np.flatnonzero(ids == EOI)]  # after each frame's eoi
    cuts = sorted({0, *ends[:: max(1, len(ends) // 3)], len(ids)})
    cache, rows = KVCache(), []
    for a, b in zip(cuts, cuts[1:], strict=False):
        blocks = None if m.vision_blocks is None else m.vision_blocks[a:b]
        rows.append(model.forward(m.ids[a:b], cache=cache, embeddings=m.embeddings[a:b], vision_blocks=blocks))
    assert np.abs(np.concatenate(rows) - theirs).max() < EXACT_BOUND
