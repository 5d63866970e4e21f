"""Gemma 4 video prompts (gemma4-multimodal-spec.md section 2, trap 27; the Unified spec A4): sampled frames.

A video reaches the decoder as its sampled frames, each an image of its own:

    frames (RGB uint8 [h, w, 3], all of one size) and the frame rate
      --sample_frame_indices--> the frames the processor keeps: i * total // n for i < n (n = ``num_frames``,
        32 by default: transformers' ``default_sample_indices_fn``; a video of fewer frames than n is refused, as
        there)
      --frame_timestamps--> "mm:ss" of each kept frame (index / fps, minutes and whole seconds)
      --refimpl.image.preprocess_image (or the Unified one)--> each frame through the image path with the video
        processor's own budget (``max_soft_tokens`` 70 by default) and its resize (torchvision's on a uint8 tensor:
        ``refimpl.resample.resize_bicubic_torch``, not the image processor's Pillow rule; ``ImageFrontEnd
        .preprocess_frame``): the same resized size for every frame
      --video_ids--> the frames' tokens: "mm:ss " + boi + video_token x N + eoi, frames joined by one space,
        each timestamp's text tokenized on its own (it sits between two special tokens, or begins the run)

In the decoder the video tokens are vision tokens like image tokens (token type 2): their soft tokens replace
their rows unscaled, their per-layer-embedding rows are the pad row, and on a checkpoint with
``use_bidirectional_attention == "vision"`` each frame is its own vision block (its boi/eoi and the timestamps
between frames are text). ``refimpl.multimodal.multimodal_inputs(..., video_soft_tokens=...)`` merges them.

transformers' video processors resize with torchvision on uint8 tensors (``torch.nn.functional.interpolate``,
bicubic, antialiased), which rounds otherwise than the image processors' Pillow rule (by a unit or two of 255 at
about one pixel value in a hundred): ``resize_bicubic_torch`` is that rule, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .config_fields import read_json
from .errors import ConfigError, InputError, check_choice
from .image import (
    SUPPORTED_SOFT_TOKENS,
    aspect_ratio_preserving_size,
    check_image_array,
    check_soft_token_budget,
    read_image,
)
from .multimodal import MultimodalTokens, placeholder_positions, splice

DEFAULT_VIDEO_SOFT_TOKENS = 70  # transformers' Gemma4VideoProcessor.max_soft_tokens
DEFAULT_NUM_FRAMES = 32  # its num_frames (do_sample_frames True)
FRAME_SUFFIXES = (".png", ".ppm", ".pgm", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")

__all__ = ["DEFAULT_NUM_FRAMES", "DEFAULT_VIDEO_SOFT_TOKENS", "Video", "VideoSettings", "check_frames",
           "expand_video_placeholders", "frame_timestamps", "load_video_settings", "preprocess_video",
           "read_video_frames", "sample_frame_indices", "video_frame_size", "video_ids"]


@dataclass(frozen=True)
class VideoSettings:
    """The video processor's settings: its soft-token budget per frame and the frames it samples."""

    max_soft_tokens: int = DEFAULT_VIDEO_SOFT_TOKENS
    num_frames: int = DEFAULT_NUM_FRAMES


def load_video_settings(model_dir: str | Path) -> VideoSettings:
    """processor_config.json's "video_processor" (``max_soft_tokens``, ``num_frames``), else the defaults."""
    path = Path(model_dir) / "processor_config.json"
    raw = read_json(path).get("video_processor", {}) if path.is_file() else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} ['video_processor']: expected a JSON object")
    budget = raw.get("max_soft_tokens") or DEFAULT_VIDEO_SOFT_TOKENS
    frames = raw.get("num_frames") or DEFAULT_NUM_FRAMES
    check_choice("'max_soft_tokens'", budget, SUPPORTED_SOFT_TOKENS, who=f"{path} ['video_processor']",
                 error=ConfigError)
    if isinstance(frames, bool) or not isinstance(frames, int) or frames <= 0:
        raise ConfigError(f"{path} ['video_processor']: 'num_frames' must be a positive integer, got {frames!r}")
    return VideoSettings(budget, frames)


def read_video_frames(directory: str | Path) -> list[np.ndarray]:
    """The frames of a video given as a directory of images, in file-name order (RGB uint8 each)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: a video is given as a directory of its frames (image files); no such "
                         "directory")
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in FRAME_SUFFIXES)
    if not files:
        raise InputError(f"{directory}: the video has no frames (no image file: {', '.join(FRAME_SUFFIXES)})")
    return [read_image(p) for p in files]


def check_frames(frames: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The frames as RGB uint8 arrays of one size (InputError: none, not images, or sizes that differ: the
    processor stacks a video's frames into one tensor)."""
    frames = [check_image_array(f) for f in frames]
    if not frames:
        raise InputError("the video has no frames")
    sizes = sorted({f.shape[:2] for f in frames})
    if len(sizes) > 1:
        raise InputError(f"the video's frames differ in size ({', '.join(f'{h}x{w}' for h, w in sizes)}, HxW); "
                         "a video's frames must all have one size")
    return frames


def sample_frame_indices(total: int, num_frames: int) -> np.ndarray:
    """The frames the processor keeps of ``total``: i * total // num_frames for i < num_frames."""
    if total <= 0:
        raise InputError("the video has no frames")
    if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or num_frames <= 0:
        raise InputError(f"num_frames must be a positive integer, got {num_frames!r}")
    if num_frames > total:
        raise InputError(f"the video has {total} frame(s), fewer than the {num_frames} the processor samples; "
                         f"give num_frames <= {total} (--num-frames)")
    return np.arange(num_frames, dtype=np.int64) * total // num_frames


def frame_timestamps(indices: Sequence[int], fps: float) -> list[str]:
    """"mm:ss" of each frame index at ``fps`` frames a second (whole minutes, whole seconds of the rest)."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float, np.floating)) or not np.isfinite(fps) or fps <= 0:
        raise InputError(f"the frame rate must be a positive number of frames a second, got {fps!r}")
    seconds = [int(i) / fps for i in indices]
    return [f"{int(s // 60):02d}:{int(s % 60):02d}" for s in seconds]


def video_frame_size(height: int, width: int, patch_size: int, pooling_kernel_size: int,
                     settings: VideoSettings = VideoSettings()) -> tuple[int, int]:
    """(H', W') every frame of a video of that size is resized to (the image rule at the video budget)."""
    return aspect_ratio_preserving_size(height, width, patch_size, settings.max_soft_tokens, pooling_kernel_size)


@dataclass(frozen=True)
class Video:
    """A video's kept frames, their timestamps and their processed input (one per frame)."""

    indices: np.ndarray  # int64 [F]: the frames kept
    timestamps: list[str]  # "mm:ss" per kept frame
    processed: list  # refimpl.image.ProcessedImage (or the Unified image) per kept frame
    num_soft_tokens: int  # per frame

    @property
    def frames(self) -> int:
        return len(self.processed)


def preprocess_video(frames: Sequence[np.ndarray], fps: float, preprocess: Callable[[np.ndarray], object],
                     settings: VideoSettings = VideoSettings(), num_frames: int | None = None) -> Video:
    """Sample, time-stamp and preprocess a video's frames. ``preprocess``: one frame -> its processed input at
    the video budget with the video processor's resize
    (``refimpl.frontends.ImageFrontEnd.with_budget(settings.max_soft_tokens).preprocess_frame``)."""
    check_soft_token_budget(settings.max_soft_tokens)
    frames = check_frames(frames)
    indices = sample_frame_indices(len(frames), settings.num_frames if num_frames is None else num_frames)
    stamps = frame_timestamps(indices, fps)
    processed = [preprocess(frames[int(i)]) for i in indices]
    return Video(indices, stamps, processed, int(processed[0].num_soft_tokens))


def video_ids(video: Video, tokens: MultimodalTokens, encode: Callable[[str], list[int]]) -> np.ndarray:
    """The tokens of one video in the prompt: per frame "mm:ss " + boi + video_token x N + eoi, frames joined by
    one space (``encode``: text -> ids without BOS; each timestamp's text on its own)."""
    out: list[int] = []
    for k, stamp in enumerate(video.timestamps):
        out += list(encode(f"{stamp} " if k == 0 else f" {stamp} "))
        out += [tokens.boi_token_id] + [tokens.video_token_id] * video.num_soft_tokens + [tokens.eoi_token_id]
    return np.asarray(out, dtype=np.int64)


def expand_video_placeholders(ids: Sequence[int] | np.ndarray, videos: Sequence[np.ndarray],
                              tokens: MultimodalTokens) -> np.ndarray:
    """Each video placeholder of ``ids`` (one per video, in order) replaced by that video's tokens (``video_ids``).
    Run after the images' expansion (``refimpl.multimodal.expand_image_placeholders`` refuses the boi/eoi markers
    this puts in)."""
    ids = np.asarray(ids, dtype=np.int64)
    at = placeholder_positions(ids, tokens.video_token_id, len(videos), "video", "video", "video(s)", "<|video|>")
    return splice(ids, at, videos)
