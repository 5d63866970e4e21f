"""Video bases (issue 58): text, one video's sampled frames as the video processor lays them out, more text.

A video base is ``bos``, random text ids, then per kept frame its timestamp's text ("mm:ss ", frames joined
by one space) and ``boi + video_token x M + eoi`` (M: the frame's soft tokens at the video processor's budget,
70 by default), then more text and DECODE_STEPS text ids. Every frame is a vision block of the same tower as
the images (``refimpl.video``, ``refimpl.multimodal.multimodal_inputs(video_soft_tokens=)``), so a video base
is stored as an image base whose blocks are its frames, plus ``videos`` [(first block, frames)] per video.
V0 keeps 2 frames of 4, V1 4 of 8; the frames are one synthetic image drifting a few pixels a frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from refimpl.frontends import image_front_end
from refimpl.model import Gemma4
from refimpl.multimodal import load_multimodal_tokens, multimodal_inputs, video_spans
from refimpl.tokenizer import Tokenizer
from refimpl.video import load_video_settings, preprocess_video, video_ids

from ..sets.case import DECODE_STEPS
from .media import MediaBase, VisionSide, synthetic_image, text_pool

VIDEO_TEXT = {"V0": (4, 6), "V1": (3, 5)}  # text tokens before and after the video
VIDEO_FRAMES = {"V0": (4, 2), "V1": (8, 4)}  # (frames in the video, frames the processor keeps)
VIDEO_FPS = 2.0  # the synthetic videos' frame rate: kept frames one second apart
SYNTHETIC_VIDEO_SIZE = (60, 84)  # height, width of every frame
DRIFT = 3  # pixels the scene moves right (and half that down) a frame


def synthetic_video(seed: int, b_index: int, frames: int, size: tuple[int, int] = SYNTHETIC_VIDEO_SIZE) -> list:
    """``frames`` uint8 frames [h, w, 3] of one synthetic scene (``media.synthetic_image``) drifting DRIFT
    pixels right and DRIFT // 2 down a frame (wrapping around), so consecutive frames differ."""
    scene = synthetic_image(seed, 300 + b_index, *size)
    return [np.roll(scene, (f * (DRIFT // 2), f * DRIFT), axis=(0, 1)) for f in range(frames)]


class VideoSide(VisionSide):
    """The video side of a checkpoint: the vision front end at the video processor's budget and resize, the
    video settings, the tokenizer (for the timestamps) and the placeholder ids."""

    kind, texts, rng_offset, noun = "video", VIDEO_TEXT, 30, "video"

    def __init__(self, model_dir: Path):
        self.video_settings = load_video_settings(model_dir)
        self.front = image_front_end(model_dir).with_budget(self.video_settings.max_soft_tokens)
        self.settings = self.front.settings
        self.tokens = load_multimodal_tokens(model_dir, ["image"])
        self.tokenizer = Tokenizer.from_dir(model_dir)
        if self.tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer.model: video bases need it for the frames' timestamps")

    def merge(self, model, ids: list[int], soft: list[np.ndarray]):
        return multimodal_inputs(model, ids, [], self.tokens, video_soft_tokens=soft)

    def manifest(self, bidirectional: bool) -> dict:
        """The manifest's ``videos`` section: the video token, the processor's budget and sampling, the
        synthetic videos' frame rate, whether frames are vision blocks (the rule: ``oracle.vision_mask``)."""
        return {"token_ids": {"video_token_id": self.tokens.video_token_id, "boi_token_id": self.tokens.boi_token_id,
                              "eoi_token_id": self.tokens.eoi_token_id},
                "processor": {"max_soft_tokens": self.video_settings.max_soft_tokens,
                              "num_frames": self.video_settings.num_frames, "resize": "torch bicubic, antialias"},
                "fps": VIDEO_FPS, "vision_blocks": bidirectional}


def video_jobs(side: VideoSide) -> list[tuple[str, float, int]]:
    """(base, estimated cost, index) of each video base's generation job (the planner's cost units: tokens,
    the soft tokens twice more for the tower)."""
    out = []
    for b_index, (b, (before, after)) in enumerate(VIDEO_TEXT.items()):
        m = VIDEO_FRAMES[b][1] * (side.settings.max_soft_tokens + 8)  # frames, their markers and timestamps
        out.append((b, 3.0 * (before + after + DECODE_STEPS + m) + 2.0 * m, b_index))
    return out


def make_video_base(model: Gemma4, side: VideoSide, pool: np.ndarray, bos: int, seed: int, b_index: int) -> MediaBase:
    """Video base number ``b_index`` of VIDEO_TEXT (one generation job): its synthetic video sampled,
    time-stamped and preprocessed as the video processor does, each kept frame's soft tokens from the tower, the
    prompt laid out as the processor expands the video placeholder, the oracle's inputs merged."""
    base, (before, after) = list(VIDEO_TEXT.items())[b_index]
    total, kept = VIDEO_FRAMES[base]
    frames = synthetic_video(seed, b_index, total)
    video = preprocess_video(frames, VIDEO_FPS, side.front.preprocess_frame, side.video_settings, kept)
    soft = [side.front.soft_tokens(p) for p in video.processed]
    rng = np.random.default_rng([seed, side.rng_offset + b_index])
    text = text_pool(pool, side.tokens)
    ids = [bos] + [int(x) for x in rng.choice(text, before)]
    ids += [int(t) for t in video_ids(video, side.tokens, lambda s: side.tokenizer.encode(s, add_bos=False))]
    ids += [int(x) for x in rng.choice(text, after + DECODE_STEPS)]
    spans = video_spans(ids, side.tokens)
    sources = [(frames[int(i)], {"source": "synthetic video", "frame": int(i), "timestamp": stamp})
               for i, stamp in zip(video.indices, video.timestamps, strict=True)]
    described = [{**desc, **side.sizes((px,), pr), "soft_tokens": M, "start": a}
                 for (px, desc), pr, (a, M) in zip(sources, video.processed, spans, strict=True)]
    info: dict[str, Any] = {
        "source": "videos", "length": len(ids), "rng": f"numpy default_rng([{seed}, {side.rng_offset + b_index}])",
        "text": [before, after], "images": described,
        "videos": [{"frames": total, "kept": kept, "fps": VIDEO_FPS, "size": list(SYNTHETIC_VIDEO_SIZE),
                    "indices": [int(i) for i in video.indices], "timestamps": list(video.timestamps),
                    "first_block": 0, "rng": f"numpy default_rng([{seed}, {100 + 300 + b_index}])"}]}
    return MediaBase(ids, side.merge(model, ids, soft), spans, sources, video.processed, soft, info,
                     videos=[(0, kept)])
