"""The video mutants (issue 58; docs/bug-classes.md, "Video prompts"): the numpy engine with a video's frames
handled wrongly, listed with the rest of the zoo in ``mutants.py``. A frame is a vision block of the video token
(``conformance.generate.video``); each mutant replaces the backend's ``_one_sequence`` (how one call's tokens
become an engine batch), so the engine itself is unchanged.

Not planted, with the reason: an engine that drops the frames' timestamps or preprocesses frames at the image
budget builds a prompt of its own, while the gate's requests hand it the processor's tokens and each frame's
patches and block length: such an engine cannot even take the request (a block of another length), which the
gate reports, and its prompt is outside what a request grades.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from .backend import NumpyEngineBackend
from .planting import planted
from .state import Batch, CacheSet

__all__ = ["VIDEO_SET_PLE", "VIDEO_SET_UNIFIED", "VIDEO_SETS", "VideoFramesNotVision", "VideoFramesOneBlock"]

#: the bundled video sets: frames causal with PLE (E-series), and frames as vision blocks on sliding layers (Unified)
VIDEO_SET_PLE = "e2b-vision-mini-video"
VIDEO_SET_UNIFIED = "12b-mini-video"
VIDEO_SETS = (VIDEO_SET_PLE, VIDEO_SET_UNIFIED)


def _frames(self, ids: Sequence[int], images: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The blocks of ``images`` that are video frames (their tokens the video token)."""
    token = None if self.tokens is None else self.tokens.video_token_id
    return [(s, n) for s, n in images if token is not None and int(ids[s]) == token]


def _image_token_only(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int],
                      x0: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
                      audio: Sequence[tuple[int, int]] = ()) -> Batch:
    frames = set(_frames(self, ids, images))
    kept = [b for b in images if b not in frames]  # the frames' soft tokens stay in x0, their positions text
    return NumpyEngineBackend._one_sequence(self, caches, seq, ids, rows, x0, kept, audio)


def _one_block(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int],
               x0: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
               audio: Sequence[tuple[int, int]] = ()) -> Batch:
    batch = NumpyEngineBackend._one_sequence(self, caches, seq, ids, rows, x0, images, audio)
    frames = _frames(self, ids, images)
    for s, n in frames[1:]:
        batch.block[s:s + n] = batch.block[frames[0][0]]  # every frame of the call in the first frame's block
    return batch


VideoFramesNotVision = planted(
    "video-frames-not-vision",
    "Video prompts: only image_token_id positions are vision, so a frame's tokens take the video token's own "
    "per-layer row and stay causal (its soft tokens still merged).",
    backend={"_one_sequence": _image_token_only})

VideoFramesOneBlock = planted(
    "video-frames-one-block",
    "Video prompts: a video's frames form one vision block, so on vision-block checkpoints a frame sees the later "
    "frames of its video.",
    backend={"_one_sequence": _one_block})
