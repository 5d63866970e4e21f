"""The numpy engine's image and audio encoders (``conformance.selftest.engine.Engine`` inherits them), one
hook per step, so that a planted mutant replaces one step (``conformance/selftest/mutants.py``).

* Images: Gemma 4 Unified's encoder-free embedder step by step (``patch_values``, ``patch_norm``,
  ``patch_position_embedding``, ``real_patches``; gemma4-unified-and-mtp-spec.md A6), or the oracle's vision
  tower for the other families.
* Audio: the oracle's conformer with its local-attention geometry and cap from hooks (``audio_config``,
  ``audio_chunk_size``, ``audio_context``, ``audio_logit_cap``), or Unified's raw-waveform embedder
  (``audio_frame_norm``, then the projection).

The engine sets ``image`` (a ``refimpl.frontends.ImageFrontEnd`` or None), ``audio_weights`` and
``audio_cfg`` (the conformer's, or Unified's audio embedder's) and ``dtype``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from refimpl.audio import AudioConfig
from refimpl.audio import audio_tower as refimpl_audio_tower
from refimpl.ops import linear
from refimpl.schedule import layer_norm, rms_norm
from refimpl.unified import AUDIO_PROJECTION, LAYER_NORM_EPS, UnifiedAudioConfig

__all__ = ["MediaEncoders"]


class MediaEncoders:
    """Image and audio soft tokens, computed by the engine itself from the requests' model inputs."""

    # -- the image tower or embedder ------------------------------------------------------------

    def image_soft_tokens(self, pixel_values: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One image's soft tokens [M, H] (unscaled) from its patches and positions: Gemma 4 Unified's
        embedder run here step by step (``unified_vision``), or the oracle's vision tower."""
        if self.image is None:
            raise ValueError("this checkpoint has no vision tower or embedder (no 'vision_config' in config.json)")
        if not self.image.unified:
            return self.image.embed(pixel_values, positions)
        return self.unified_vision(np.asarray(pixel_values, dtype=self.dtype), np.asarray(positions, dtype=np.int64))

    def unified_vision(self, pv: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """[R, C] patches, [R, 2] (x, y) -> soft tokens of the real rows: LN -> dense + bias -> LN -> + the
        position rows -> LN -> weightless RMSNorm -> projection."""
        w = self.image.weights
        h = self.patch_norm(self.patch_values(pv), w.tensor("patch_ln1", "weight"), w.tensor("patch_ln1", "bias"))
        h = linear(h, w.tensor("patch_dense", "weight")) + w.tensor("patch_dense", "bias")
        h = self.patch_norm(h, w.tensor("patch_ln2", "weight"), w.tensor("patch_ln2", "bias"))
        h = self.patch_norm(h + self.patch_position_embedding(pos), w.tensor("pos_norm", "weight"),
                            w.tensor("pos_norm", "bias"))
        e = linear(rms_norm(h, None, self.image.cfg.rms_norm_eps), w.tensor("projection"))
        return self.real_patches(e, pos)

    def patch_values(self, pv: np.ndarray) -> np.ndarray:
        """Each patch's values as the dense layer reads them: (row, column, channel), as given."""
        return pv

    def patch_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """The embedder's LayerNorms: mean and bias, torch's default eps 1e-5."""
        return layer_norm(x, weight, bias, LAYER_NORM_EPS)

    def patch_position_embedding(self, pos: np.ndarray) -> np.ndarray:
        """[R, E] = T[x, 0] + T[y, 1], an axis at -1 adding nothing."""
        valid = pos != -1
        rows = self.image.weights.position_rows(np.where(valid, pos, 0))  # [R, 2, E]
        return np.sum(rows * valid[:, :, None], axis=1)

    def real_patches(self, e: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The rows of real patches (padding rows have a -1 coordinate)."""
        return e[(pos != -1).all(axis=1)]

    # -- the audio tower or embedder ------------------------------------------------------------

    @property
    def unified_audio(self) -> bool:
        return isinstance(self.audio_cfg, UnifiedAudioConfig)

    def audio_soft_tokens(self, features: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One clip's soft tokens [M, H] (text width, unscaled) from its features [T, F] and frame mask [T]:
        the oracle's conformer (``refimpl.audio.audio_tower``) run with ``audio_config()`` over log-mel
        features, or Gemma 4 Unified's embedder over raw frames (``audio_frame_norm``, projection)."""
        if self.audio_weights is None:
            raise ValueError("this checkpoint has no audio tower or embedder (no 'audio_config' in config.json)")
        if self.unified_audio:
            frames = np.asarray(features, dtype=self.dtype)[np.asarray(mask, dtype=bool)]
            return linear(self.audio_frame_norm(frames), self.audio_weights[AUDIO_PROJECTION])
        return self.audio_tower(features, mask, self.audio_config())

    def audio_frame_norm(self, frames: np.ndarray) -> np.ndarray:
        """Unified: the weightless RMSNorm over each frame's samples."""
        return rms_norm(frames, None, self.audio_cfg.rms_norm_eps)

    def audio_tower(self, features: np.ndarray, mask: np.ndarray, cfg: AudioConfig) -> np.ndarray:
        return refimpl_audio_tower(features, mask, self.audio_weights, cfg)

    def audio_config(self) -> AudioConfig:
        """The tower's config with the local attention's geometry and cap taken from the hooks below."""
        past, future = self.audio_context()
        return dataclasses.replace(self.audio_cfg, attention_chunk_size=self.audio_chunk_size(),
                                   attention_context_left=past + 1, attention_context_right=future,
                                   attention_logit_cap=self.audio_logit_cap())

    def audio_chunk_size(self) -> int:
        """W: queries per block of the local attention."""
        return self.audio_cfg.attention_chunk_size

    def audio_context(self) -> tuple[int, int]:
        """(past, future) keys of each block's context: L = attention_context_left - 1 and
        attention_context_right. The mask admits ``0 <= q - k < L`` (trap 24: only context_left - 1 keys,
        self + context_left - 2 past) or ``0 < k - q < R``."""
        return self.audio_cfg.max_past, self.audio_cfg.attention_context_right

    def audio_logit_cap(self) -> float | None:
        """cap of the local attention's logit soft cap ``cap * tanh(x / cap)``."""
        return self.audio_cfg.attention_logit_cap

