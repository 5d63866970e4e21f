"""The image and audio front ends of a checkpoint, one interface for both families.

A Gemma 4 checkpoint with towers (E2B, E4B, 26B-A4B, 31B) turns an image into pooled vision-tower
soft tokens and a clip into conformer soft tokens over log-mel features; a Gemma 4 Unified checkpoint
(12B) embeds 48-pixel patches and 640-sample frames directly (``refimpl.unified``). Everything that
takes images or audio (the CLI, generation, the gate's fixture generator, the self-test engine) goes
through these two classes, so the family is decided in one place:

    front = image_front_end(model_dir)         # or audio_front_end(model_dir)
    x = front.preprocess(pixels)                # .pixels .pixel_values .positions .num_soft_tokens
    soft = front.soft_tokens(x)                 # [M, H]

    clip = audio.features(samples, rate)        # .features [F, d] .mask [F]
    audio.soft_token_count(clip)                # M, before any model weight is read
    soft = audio.soft_tokens(clip)              # [M, H]

``features`` are log-mel frames for the conformer and raw 640-sample frames for Unified; ``mask`` marks
the valid frames (all of them for Unified). The weights are loaded on first use.

A GGUF model's towers are in a projector file (``projector``: llama.cpp's mmproj GGUF, read by
``refimpl.gguf_mmproj``); its processor settings are those of a processor_config.json lying beside that file,
else transformers' defaults (280 soft tokens an image; the audio feature extractor's defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .audio import audio_tower, load_audio_tower
from .audio_features import (
    RESAMPLE_HINT,
    AudioFeatures,
    audio_features,
    audio_soft_token_count,
    check_samples,
    load_audio_feature_settings,
)
from .errors import InputError
from .gguf_mmproj import load_mmproj_tower
from .image import ImageProcessorSettings, check_soft_token_budget, load_image_processor_settings, preprocess_image
from .resample import resize_bicubic, resize_bicubic_torch
from .unified import (
    SAMPLING_RATE,
    UnifiedAudioConfig,
    UnifiedAudioWeights,
    UnifiedVisionConfig,
    UnifiedVisionWeights,
    audio_embedder,
    audio_frames,
    is_unified,
    preprocess_unified_image,
    vision_embedder,
)
from .vision import load_vision_config, load_vision_tower, vision_tower


class ImageFrontEnd:
    """Image processor settings and the model part that makes soft tokens of a checkpoint's images."""

    def __init__(self, model_dir: str | Path, dtype: str = "float64", projector: str | Path | None = None):
        self.model_dir, self.dtype = Path(model_dir), dtype
        self._weights = None
        if projector is not None:
            self._weights, self.cfg = load_mmproj_tower(projector, "vision", dtype)
            self.unified = isinstance(self.cfg, UnifiedVisionConfig)
            settings_dir = Path(projector).parent
        else:
            self.unified = is_unified(model_dir)
            self.cfg = (UnifiedVisionWeights.load_config(model_dir) if self.unified
                        else load_vision_config(model_dir))
            settings_dir = self.model_dir
        self.settings: ImageProcessorSettings = load_image_processor_settings(settings_dir, self.cfg)

    @property
    def kind(self) -> str:
        """"embedder" (Unified, encoder-free) or "tower"."""
        return "embedder" if self.unified else "tower"

    def with_budget(self, max_soft_tokens: int) -> "ImageFrontEnd":
        """The same front end with another soft-token budget (one of 70, 140, 280, 560, 1120)."""
        self.settings = ImageProcessorSettings(self.settings.patch_size, self.settings.pooling_kernel_size,
                                               check_soft_token_budget(max_soft_tokens))
        return self

    def preprocess(self, pixels: np.ndarray, resize=resize_bicubic):
        """RGB uint8 [h, w, 3] -> refimpl.image.ProcessedImage or refimpl.unified.UnifiedImage (``resize``: the
        image processors' Pillow rule; ``refimpl.resample.resize_bicubic_torch`` for a video frame)."""
        st = self.settings
        if self.unified:
            return preprocess_unified_image(pixels, st, resize)
        return preprocess_image(pixels, st.patch_size, st.pooling_kernel_size, st.max_soft_tokens, resize)

    def preprocess_frame(self, pixels: np.ndarray):
        """One video frame: ``preprocess`` with the video processors' resize (torchvision on a uint8 tensor)."""
        return self.preprocess(pixels, resize_bicubic_torch)

    @property
    def weights(self):
        if self._weights is None:
            self._weights = (UnifiedVisionWeights(self.model_dir, self.cfg, self.dtype) if self.unified
                             else load_vision_tower(self.model_dir, self.dtype)[0])
        return self._weights

    def soft_tokens(self, processed) -> np.ndarray:
        """Soft tokens [M, H] of one preprocessed image."""
        return self.embed(processed.pixel_values, processed.positions)

    def embed(self, pixel_values: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Soft tokens [M, H] from the model input of one image (patches and (x, y) positions)."""
        run = vision_embedder if self.unified else vision_tower
        return run(pixel_values, positions, self.weights, self.cfg)


@dataclass(frozen=True)
class UnifiedClip:
    features: np.ndarray  # float64 [F, A] raw frames (float32 values), the last zero-padded
    mask: np.ndarray  # bool [F], all True


class AudioFrontEnd:
    """Feature extraction and the model part that makes soft tokens of a checkpoint's audio clips."""

    def __init__(self, model_dir: str | Path, dtype: str = "float64", projector: str | Path | None = None):
        self.model_dir, self.dtype = Path(model_dir), dtype
        self._weights = None
        self.cfg = None  # the conformer's, read with its weights
        if projector is not None:
            self._weights, self.cfg = load_mmproj_tower(projector, "audio", dtype)
            self.unified = isinstance(self.cfg, UnifiedAudioConfig)
            settings_dir = Path(projector).parent
        else:
            self.unified = is_unified(model_dir)
            settings_dir = self.model_dir
            if self.unified:
                self.cfg = UnifiedAudioWeights.load_config(model_dir)
        self.settings = None if self.unified else load_audio_feature_settings(settings_dir)
        self.sampling_rate = SAMPLING_RATE if self.unified else self.settings.sampling_rate

    @property
    def kind(self) -> str:
        return "embedder" if self.unified else "tower"

    def check(self, samples, rate: int) -> None:
        """InputError for a clip the front end would refuse (another rate, not a finite float waveform),
        without extracting its features."""
        if self.unified:
            self._check_rate(rate)
            audio_frames(samples, self.cfg)  # framing is the whole front end: its checks are the cheap part
        else:
            check_samples(samples, rate, self.settings)

    def _check_rate(self, rate: int) -> None:
        if rate != self.sampling_rate:
            raise InputError(f"the audio is sampled at {rate} Hz but the feature extractor needs {self.sampling_rate} "
                             f"Hz ({self.sampling_rate / 1000:g} kHz); {RESAMPLE_HINT}")

    def features(self, samples, rate: int) -> AudioFeatures | UnifiedClip:
        """The model input of one clip sampled at ``rate`` Hz (InputError for another rate)."""
        if self.unified:
            self._check_rate(rate)  # (audio_features checks the conformer's clips itself)
            frames = audio_frames(samples, self.cfg)
            return UnifiedClip(frames, np.ones(frames.shape[0], dtype=bool))
        return audio_features(samples, rate, self.settings)

    def soft_token_count(self, clip) -> int:
        """Soft tokens the clip gives (what the processor puts in the prompt)."""
        if self.unified:
            return int(clip.mask.sum())
        return audio_soft_token_count(clip.mask, self.settings.audio_seq_length)

    def load(self):
        """The weights (and, for the conformer, its config), loaded on first use."""
        if self._weights is None:
            if self.unified:
                self._weights = UnifiedAudioWeights(self.model_dir, self.cfg, self.dtype)
            else:
                self._weights, self.cfg = load_audio_tower(self.model_dir, self.dtype)
        return self._weights

    def soft_tokens(self, clip) -> np.ndarray:
        """Soft tokens [M, H] of one clip (``features`` output)."""
        return self.embed(clip.features, clip.mask)

    def embed(self, features: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Soft tokens [M, H] from a clip's features [F, d] and frame mask [F]."""
        weights = self.load()
        if self.unified:
            return audio_embedder(np.asarray(features)[np.asarray(mask, dtype=bool)], weights, self.cfg)
        return audio_tower(features, mask, weights, self.cfg)


def image_front_end(model_dir: str | Path, dtype: str = "float64",
                    projector: str | Path | None = None) -> ImageFrontEnd:
    return ImageFrontEnd(model_dir, dtype, projector)


def audio_front_end(model_dir: str | Path, dtype: str = "float64",
                    projector: str | Path | None = None) -> AudioFrontEnd:
    return AudioFrontEnd(model_dir, dtype, projector)
