"""The video mutants (issue 58; docs/bug-classes.md, "Video prompts"): the numpy engine with a video's frames
handled wrongly, listed with the rest of the zoo in ``mutants.py``. A frame is a vision block of the video token
(``conformance.generate.video``); each mutant replaces the backend's ``one_sequence`` (how one call's tokens
become an engine batch), so the engine itself is unchanged.

Not planted, with the reason: an engine that preprocesses frames at the image budget. The gate's requests hand
it each frame's patches and block length, so its processor never runs: at the published budgets (280 and 70) it
could not take the request (a block of another length, an error the gate reports), and the miniatures' two
budgets are both 70 (docs/bug-classes.md, "Video prompts").
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Sequence

import numpy as np

from .backend import NumpyEngineBackend
from .planting import planted
from .state import Batch, CacheSet

__all__ = ["VIDEO_SET_PLE", "VIDEO_SET_UNIFIED", "VIDEO_SETS", "VideoFramesNotVision", "VideoFramesOneBlock",
           "VideoTimestampsDropped"]

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
    return NumpyEngineBackend.one_sequence(self, caches, seq, ids, rows, x0, kept, audio)


def _one_block(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int],
               x0: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
               audio: Sequence[tuple[int, int]] = ()) -> Batch:
    batch = NumpyEngineBackend.one_sequence(self, caches, seq, ids, rows, x0, images, audio)
    frames = _frames(self, ids, images)
    for s, n in frames[1:]:
        batch.block[s:s + n] = batch.block[frames[0][0]]  # every frame of the call in the first frame's block
    return batch


def _timestamps_dropped(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int],
                        x0: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
                        audio: Sequence[tuple[int, int]] = ()) -> Batch:
    rows = [int(r) for r in rows]
    frames = _frames(self, ids, images)
    drop = {t for (s0, n0), (s1, _) in itertools.pairwise(frames) for t in range(s0 + n0 + 1, s1 - 1)} - set(rows)
    keep = [t for t in range(len(ids)) if t not in drop]  # a requested row stays: harder to kill, never easier
    at = {t: k for k, t in enumerate(keep)}
    return NumpyEngineBackend.one_sequence(self, caches, seq, [ids[t] for t in keep], [at[r] for r in rows],
                                            None if x0 is None else np.asarray(x0)[keep],
                                            [(at[s], n) for s, n in images], [(at[s], n) for s, n in audio])


VideoFramesNotVision = planted(
    "video-frames-not-vision",
    "Video prompts: only image_token_id positions are vision, so a frame's tokens take the video token's own "
    "per-layer row and stay causal (its soft tokens still merged).",
    backend={"one_sequence": _image_token_only})

VideoFramesOneBlock = planted(
    "video-frames-one-block",
    "Video prompts: a video's frames form one vision block, so on vision-block checkpoints a frame sees the later "
    "frames of its video.",
    backend={"one_sequence": _one_block})

VideoTimestampsDropped = planted(
    "video-timestamps-dropped",
    "Video prompts: the frames are laid out back to back, without the timestamp text between them (as an engine "
    "that lowers frames to image tokens does), so every later token sits earlier.",
    backend={"one_sequence": _timestamps_dropped})
