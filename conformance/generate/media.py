"""Image and audio bases: one *modality* (a tower, its settings and placeholder ids) and one way to build a
base from it, for both kinds of media.

A media base is text with media blocks: ``bos``, random text ids, ``open + placeholder x M + close`` per
block (M the block's soft tokens), more text, then DECODE_STEPS text ids. ``VisionSide`` and ``AudioSide``
say what differs (the tower, the markers, how a source is described and stored); ``make_media_base``
builds base number ``b_index`` of ``side.texts`` (I0, I1 / S0, S1) for either.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from refimpl.audio_features import read_wav
from refimpl.frontends import audio_front_end, image_front_end
from refimpl.image import read_image
from refimpl.model import KVCache
from refimpl.multimodal import load_multimodal_tokens, multimodal_inputs

from ..sets.bounds import audio_units, feature_units, unified_audio_units, unified_vision_units, vision_units
from ..sets.case import DECODE_STEPS
from ..sets.format import read_json, sha256_file

SYNTHETIC_IMAGE_SIZES = ((50, 70), (200, 120), (36, 36))
# Gemma 4 Unified's synthetic images (unified spec E2): a square one half flat (a constant colour with
# +-1/255 noise: LayerNorm eps and an extra 2x - 1 show there) and half textured; then a 2:5 and a 5:2 one
# (non-square grids of transposed shapes, in one prompt: patch order, x/y axes, per-image padding)
UNIFIED_IMAGE_SIZES = ((36, 36), (24, 60), (60, 24))
IMAGE_TEXT = {"I0": (4, 6), "I1": (3, 3, 5)}  # text tokens before, between and after the image blocks
AUDIO_TEXT = {"S0": (4, 6), "S1": (3, 3, 5)}  # the same for the audio blocks
SYNTHETIC_AUDIO_SECONDS = (0.5, 0.8, 0.3)  # the synthetic clips (16 kHz): 13, 20 and 8 soft tokens
# Gemma 4 Unified's clips, in samples: 640 m + 17 (the last frame zero-padded past 17 samples), a whole
# number of frames, and half a frame more (unified spec E2, U10): 13, 20 and 8 soft tokens
UNIFIED_AUDIO_SAMPLES = (640 * 12 + 17, 640 * 20, 640 * 7 + 320)
TOWER_CONFIG = {"image": "vision_config", "audio": "audio_config"}


def has_tower(model_dir: str | Path, kind: str) -> bool:
    """Whether config.json declares the ``kind`` ("image" or "audio") tower (a ``vision_config`` or an
    ``audio_config``)."""
    try:
        raw = read_json(Path(model_dir) / "config.json")
    except (OSError, UnicodeDecodeError, ValueError):
        return False  # the oracle's own loader reports a bad config.json
    return isinstance(raw, dict) and isinstance(raw.get(TOWER_CONFIG[kind]), dict)


def has_vision_tower(model_dir: str | Path) -> bool:
    return has_tower(model_dir, "image")


def has_audio_tower(model_dir: str | Path) -> bool:
    return has_tower(model_dir, "audio")


def synthetic_image(seed: int, k: int, height: int, width: int) -> np.ndarray:
    """A deterministic RGB test image [height, width, 3] uint8: colour gradients, four discs and noise,
    so that resizing, patches and pooling all see structure."""
    rng = np.random.default_rng([seed, 100 + k])
    y, x = np.mgrid[0:height, 0:width] / max(height, width)  # [h, w] each, in [0, 1)
    img = np.stack([x, y, 1.0 - (x + y) / 2.0], axis=-1) * rng.uniform(0.4, 1.0, 3)  # [h, w, 3]
    for cy, cx, r in rng.uniform(0.0, 1.0, (4, 3)):
        img[(y - cy) ** 2 + (x - cx) ** 2 < (0.05 + 0.2 * r) ** 2] = rng.uniform(0.0, 1.0, 3)
    img = img + rng.normal(0.0, 0.05, img.shape)
    return np.round(np.clip(img, 0.0, 1.0) * 255.0).astype(np.uint8)


def flat_region_image(seed: int, k: int, height: int, width: int) -> np.ndarray:
    """``synthetic_image`` with its left half replaced by one grey level plus noise of +-1 (of 255) per
    sample: a nearly flat region next to a textured one. Grey, so that a patch's values (all three
    channels) have a variance of about (1/255)^2, the size of the LayerNorm's eps (1e-5)."""
    img = synthetic_image(seed, k, height, width)
    rng = np.random.default_rng([seed, 150 + k])
    flat = int(rng.integers(40, 216)) + rng.integers(-1, 2, (height, width // 2, 3))
    img[:, :width // 2] = flat.astype(np.uint8)
    return img


def synthetic_waveform(seed: int, k: int, seconds: float, rate: int = 16_000) -> np.ndarray:
    """A deterministic test clip [n] float64 in [-1, 1]: a rising chirp, two harmonics, a pause and noise,
    so the mel bins, the valid-frame mask and the tower's local attention all see structure."""
    rng = np.random.default_rng([seed, 200 + k])
    t = np.arange(int(round(seconds * rate))) / rate  # [n] seconds
    f0 = rng.uniform(150.0, 400.0) + rng.uniform(200.0, 1200.0) * t / max(seconds, 1e-9)
    phase = 2.0 * np.pi * np.cumsum(f0) / rate
    wave = 0.3 * np.sin(phase) + 0.15 * np.sin(2.0 * phase) + 0.08 * np.sin(3.0 * phase + rng.uniform(0, np.pi))
    wave[(t > 0.4 * seconds) & (t < 0.5 * seconds)] *= 0.05  # a near-silent gap
    return np.clip(wave + rng.normal(0.0, 0.02, t.shape), -1.0, 1.0)


# ----------------------------------------------------------------------------------------------
# the modality


@dataclass
class MediaBase:
    """One image or audio base: the prompt ids (placeholders in), the oracle's inputs and every intermediate."""

    ids: list[int]  # [N] prompt ids: text, open, placeholder x M, close, ...
    inputs: Any  # refimpl.multimodal.MultimodalInputs: llm ids, merged embeddings [N, H], vision blocks
    spans: list[tuple[int, int]]  # (first position, M) of each block
    sources: list[tuple]  # the source of each block: (image uint8 [h, w, 3], description) or (waveform, rate, ...)
    processed: list[Any]  # per block: refimpl.image.ProcessedImage or refimpl.audio_features.AudioFeatures
    soft: list[np.ndarray]  # soft tokens [M, H] per block
    info: dict  # the manifest's description
    videos: list[tuple[int, int]] = field(default_factory=list)  # video bases: (first block, frames) per video


class Modality:
    """One kind of media of a checkpoint. Subclasses set ``kind``, ``texts`` (text tokens before, between and
    after the blocks, per base), ``rng_offset`` and ``noun``, load ``tokens`` (refimpl.multimodal.MultimodalTokens),
    and implement the hooks below."""

    kind: str
    texts: Mapping[str, tuple[int, ...]]
    rng_offset: int
    noun: str

    def soft_tokens(self, source: tuple) -> tuple[Any, np.ndarray]:
        """(what the tower was fed, soft tokens [M, H]) of one source."""
        raise NotImplementedError

    def block(self, M: int) -> tuple[int, int, int, int]:
        """(open id, placeholder id, close id, M) of a block of M soft tokens."""
        raise NotImplementedError

    def sizes(self, source: tuple, processed: Any) -> dict:
        """The size fields of a block's description in the manifest."""
        raise NotImplementedError

    def merge(self, model, ids: list[int], soft: list[np.ndarray]):
        """The oracle's inputs (refimpl.multimodal.MultimodalInputs) of a prompt with these blocks."""
        raise NotImplementedError

    def arrays(self, j: int, source: tuple, processed: Any, soft: np.ndarray) -> dict[str, np.ndarray]:
        """What a generation job stores of block ``j`` (``media.<j>.<leaf>``)."""
        raise NotImplementedError

    def job_meta(self, processed: list[Any]) -> dict:
        """What a generation job records of its blocks besides the arrays (none by default)."""
        return {}


class VisionSide(Modality):
    """The image side of a checkpoint: its image front end (vision tower, or Unified's embedder), the
    processor settings, placeholder ids."""

    kind, texts, rng_offset, noun = "image", IMAGE_TEXT, 10, "image"

    def __init__(self, model_dir: Path):
        self.front = image_front_end(model_dir)
        self.settings = self.front.settings
        self.tokens = load_multimodal_tokens(model_dir, ["image"])

    def soft_tokens(self, source: tuple) -> tuple[Any, np.ndarray]:
        """(ProcessedImage or UnifiedImage, soft tokens [M, H]) of one uint8 image (``source[0]``)."""
        processed = self.front.preprocess(source[0])
        return processed, self.front.soft_tokens(processed)

    def block(self, M: int) -> tuple[int, int, int, int]:
        t = self.tokens
        return t.boi_token_id, t.image_token_id, t.eoi_token_id, M

    def sizes(self, source: tuple, processed: Any) -> dict:
        return {"size": list(source[0].shape[:2]), "resized": list(processed.pixels.shape[:2])}

    def merge(self, model, ids: list[int], soft: list[np.ndarray]):
        return multimodal_inputs(model, ids, soft, self.tokens)

    def arrays(self, j: int, source: tuple, processed: Any, soft: np.ndarray) -> dict[str, np.ndarray]:
        return {f"media.{j}.pixels": np.asarray(source[0], dtype=np.uint8),
                f"media.{j}.resized": np.asarray(processed.pixels, dtype=np.uint8),
                f"media.{j}.pixel_values": processed.pixel_values,
                f"media.{j}.positions": np.asarray(processed.positions, dtype=np.int64),
                f"media.{j}.soft_tokens": soft}

    def job_meta(self, processed: list[Any]) -> dict:
        return {"num_soft_tokens": [int(pr.num_soft_tokens) for pr in processed]}

    def units(self, processed: Any) -> int:
        """The rounding path sum of one image's soft tokens (conformance.sets.bounds)."""
        if self.front.unified:
            return unified_vision_units(self.front.cfg)
        return vision_units(self.front.cfg, int(processed.pixel_values.shape[0]))

    def manifest(self, bidirectional: bool, vision_mask: str) -> dict:
        t, st = self.tokens, self.settings
        out = {"token_ids": {"image_token_id": t.image_token_id, "boi_token_id": t.boi_token_id,
                             "eoi_token_id": t.eoi_token_id},
               "processor": {"patch_size": st.patch_size, "pooling_kernel_size": st.pooling_kernel_size,
                             "max_soft_tokens": st.max_soft_tokens},
               "vision_blocks": bidirectional, "model": self.front.kind}
        if self.front.unified:
            out["processor"]["model_patch_size"] = st.patch_size * st.pooling_kernel_size
            out["processor"]["padded"] = True  # pixel_values / positions padded to max_soft_tokens rows, (-1, -1)
        if bidirectional:
            out["vision_mask"] = vision_mask
        return out


class AudioSide(Modality):
    """The audio side of a checkpoint: its audio front end (conformer over log-mel features, or Unified's
    raw-waveform embedder), placeholder ids."""

    kind, texts, rng_offset, noun = "audio", AUDIO_TEXT, 20, "audio clip"

    def __init__(self, model_dir: Path):
        self.front = audio_front_end(model_dir)
        self.sampling_rate = self.front.sampling_rate
        self.tokens = load_multimodal_tokens(model_dir, ["audio"])

    def check(self, wave: np.ndarray, rate: int) -> None:
        """InputError for a clip the front end refuses (a wrong rate, an empty or non-finite waveform)."""
        self.front.check(wave, rate)

    def soft_tokens(self, source: tuple) -> tuple[Any, np.ndarray]:
        """(AudioFeatures or UnifiedClip, soft tokens [M, H]) of one clip (``source[0]`` at ``source[1]`` Hz)."""
        feats = self.front.features(source[0], source[1])
        return feats, self.front.soft_tokens(feats)

    def block(self, M: int) -> tuple[int, int, int, int]:
        t = self.tokens
        return t.boa_token_id, t.audio_token_id, t.eoa_token_id, M

    def sizes(self, source: tuple, processed: Any) -> dict:
        return {"samples": int(source[0].shape[0]), "frames": int(processed.mask.shape[0]),
                "valid_frames": int(processed.mask.sum())}

    def merge(self, model, ids: list[int], soft: list[np.ndarray]):
        return multimodal_inputs(model, ids, [], self.tokens, audio_soft_tokens=soft)

    def arrays(self, j: int, source: tuple, processed: Any, soft: np.ndarray) -> dict[str, np.ndarray]:
        return {f"media.{j}.waveform": np.asarray(source[0], dtype=np.float64),
                f"media.{j}.features": np.asarray(processed.features, dtype=np.float64),
                f"media.{j}.mask": np.asarray(processed.mask, dtype=bool),
                f"media.{j}.soft_tokens": soft}

    def feature_units(self) -> int:
        """The rounding path sum of the features (the log-mel front end's; raw frames are exact)."""
        return 1 if self.front.unified else feature_units(self.front.settings.fft_length)

    def units(self, feats: Any) -> int:
        """The rounding path sum of one clip's soft tokens, features included (conformance.sets.bounds)."""
        if self.front.unified:
            return 1 + unified_audio_units(self.front.cfg)
        self.front.load()
        return self.feature_units() + audio_units(self.front.cfg, int(feats.features.shape[0]))

    def manifest(self) -> dict:
        t, front = self.tokens, self.front
        out = {"token_ids": {"audio_token_id": t.audio_token_id, "boa_token_id": t.boa_token_id,
                             "eoa_token_id": t.eoa_token_id}, "model": front.kind}
        if front.unified:
            out["feature_extractor"] = {"sampling_rate": front.sampling_rate,
                                        "audio_samples_per_token": front.cfg.audio_embed_dim, "features": "raw frames"}
            return out
        front.load()
        cfg = front.cfg
        out["feature_extractor"] = {"sampling_rate": front.settings.sampling_rate,
                                    "feature_size": front.settings.feature_size}
        out["tower"] = {"attention_chunk_size": cfg.attention_chunk_size,
                        "attention_context_left": cfg.attention_context_left,
                        "attention_logit_cap": cfg.attention_logit_cap}
        return out


def image_sources(images, seed: int, unified: bool = False) -> list[tuple[np.ndarray, dict]]:
    """(uint8 image, manifest description) for each image: the given files or arrays, else synthetic ones
    (for Gemma 4 Unified: UNIFIED_IMAGE_SIZES, the first one half flat)."""
    if images is None and unified:
        return [((flat_region_image if k == 0 else synthetic_image)(seed, k, h, w),
                 {"source": "synthetic", "rng": f"numpy default_rng([{seed}, {100 + k}])",
                  **({"flat_half": "left"} if k == 0 else {})})
                for k, (h, w) in enumerate(UNIFIED_IMAGE_SIZES)]
    if images is None:
        return [(synthetic_image(seed, k, h, w), {"source": "synthetic", "rng": f"numpy default_rng([{seed}, "
                                                                                f"{100 + k}])"})
                for k, (h, w) in enumerate(SYNTHETIC_IMAGE_SIZES)]

    out = []
    for k, item in enumerate(images):
        if isinstance(item, (str, Path)):
            out.append((read_image(item), {"source": "file", "name": Path(item).name,
                                           "sha256": sha256_file(Path(item))}))
        else:
            arr = np.asarray(item)
            if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
                raise ValueError(f"image {k} must be a file path or a uint8 array [h, w, 3], got {arr.dtype} "
                                 f"{list(arr.shape)}")
            out.append((arr, {"source": "array"}))
    if not out:
        raise ValueError("images is an empty list; give at least one image (or none for the synthetic ones)")
    return out


def audio_sources(audio, seed: int, rate: int, unified: bool = False) -> list[tuple[np.ndarray, int, dict]]:
    """(waveform, sample rate, manifest description) per clip: the given WAV files or arrays, else synthetic
    (for Gemma 4 Unified: UNIFIED_AUDIO_SAMPLES long)."""
    if audio is None and unified:
        return [(synthetic_waveform(seed, k, n / rate, rate), rate,
                 {"source": "synthetic", "samples": n, "rng": f"numpy default_rng([{seed}, {200 + k}])"})
                for k, n in enumerate(UNIFIED_AUDIO_SAMPLES)]
    if audio is None:
        return [(synthetic_waveform(seed, k, sec, rate), rate, {"source": "synthetic", "seconds": sec,
                                                                 "rng": f"numpy default_rng([{seed}, {200 + k}])"})
                for k, sec in enumerate(SYNTHETIC_AUDIO_SECONDS)]

    out = []
    for k, item in enumerate(audio):
        if isinstance(item, (str, Path)):
            wave, r = read_wav(item)
            out.append((wave, r, {"source": "file", "name": Path(item).name, "sha256": sha256_file(Path(item))}))
        else:
            arr = np.asarray(item)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"audio clip {k} must be a WAV path or a float array [n] (16 kHz), got {arr.dtype} "
                                 f"{list(arr.shape)}")
            out.append((arr.astype(np.float64), rate, {"source": "array"}))
    if not out:
        raise ValueError("audio is an empty list; give at least one clip (or none for the synthetic ones)")
    return out


def text_pool(pool: np.ndarray, t) -> np.ndarray:
    """The ordinary ids of ``pool`` minus every multimodal placeholder and marker of ``t``
    (refimpl.multimodal.MultimodalTokens)."""
    return pool[~np.isin(pool, (t.image_token_id, t.boi_token_id, t.eoi_token_id, t.video_token_id,
                                t.audio_token_id, t.boa_token_id, t.eoa_token_id))]


def media_order(b_index: int, n_blocks: int, n_sources: int) -> list[int]:
    """Which source fills each block of media base ``b_index``: base 0 the first, base 1 the next ones
    (wrapping around)."""
    return [(b_index + j) % n_sources if b_index else 0 for j in range(n_blocks)]


def media_prompt(rng: np.random.Generator, pool: np.ndarray, bos: int, texts: tuple[int, ...],
                  blocks: list[tuple[int, int, int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """``bos``, then ``texts[0]`` random ids, block 0, ``texts[1]`` ids, block 1, ..., the last text run and
    DECODE_STEPS more ids. A block (open id, placeholder id, close id, M) is ``open + placeholder x M +
    close``. Returns the ids and the blocks' (first position, M)."""
    ids, spans = [bos], []
    for j, n_text in enumerate(texts):
        ids += [int(x) for x in rng.choice(pool, n_text + (DECODE_STEPS if j == len(texts) - 1 else 0))]
        if j < len(blocks):
            open_id, token, close_id, M = blocks[j]
            spans.append((len(ids) + 1, M))
            ids += [open_id] + [token] * M + [close_id]
    return ids, spans


def make_media_base(model, side: Modality, pool: np.ndarray, bos: int, seed: int, sources: Mapping[int, tuple],
                    b_index: int, done: dict[int, tuple[Any, np.ndarray]] | None = None,
                    n_sources: int | None = None) -> MediaBase:
    """Media base number ``b_index`` of ``side.texts`` (one fixture-generation job). I0 / S0: text + one block +
    text; I1 / S1: text + block + text + block + text; each followed by DECODE_STEPS text tokens (teacher-forced
    decode after the prompt). ``sources`` maps a source index to its source tuple and needs at least the
    indices the base uses; ``n_sources`` is the number of sources in all (default ``len(sources)``);
    ``done`` caches (processed, soft tokens) by index."""
    base, texts = list(side.texts.items())[b_index]
    pool = text_pool(pool, side.tokens)
    done = {} if done is None else done
    which = media_order(b_index, len(texts) - 1, len(sources) if n_sources is None else n_sources)
    for k in which:
        if k not in done:
            done[k] = side.soft_tokens(sources[k])
            if done[k][1].shape[0] == 0:
                raise ValueError(f"{side.noun} {k} is too short to give one soft token")
    processed, soft = [done[k][0] for k in which], [done[k][1] for k in which]
    rng = f"numpy default_rng([{seed}, {side.rng_offset + b_index}])"
    ids, spans = media_prompt(np.random.default_rng([seed, side.rng_offset + b_index]), pool, bos, texts,
                              [side.block(st.shape[0]) for st in soft])
    described = [{**sources[k][-1], "index": k, **side.sizes(sources[k], pr), "soft_tokens": M, "start": a}
                 for k, pr, (a, M) in zip(which, processed, spans, strict=True)]
    key = "images" if side.kind == "image" else "audio"
    info = {"source": key, "length": len(ids), "rng": rng, "text": list(texts), key: described}
    return MediaBase(ids, side.merge(model, ids, soft), spans, [sources[k] for k in which], processed, soft, info)


def media_consistency(model, base: MediaBase, full: np.ndarray) -> float:
    """Max |prefill through the KV cache - full forward| for an image or audio base fed in pieces cut
    before every block's opening marker and after its closing one (never inside a block), then the
    decode tokens one at a time."""
    m, N = base.inputs, len(base.ids)
    cuts = {a - 1 for a, _ in base.spans} | {a + n + 1 for a, n in base.spans} | set(range(N - DECODE_STEPS, N))
    bounds = [0] + sorted(c for c in cuts if 0 < c < N) + [N]
    cache, rows = KVCache(), []
    for a, b in itertools.pairwise(bounds):
        blocks = None if m.vision_blocks is None else m.vision_blocks[a:b]
        rows.append(model.forward(m.ids[a:b], rows="all", cache=cache, embeddings=m.embeddings[a:b],
                                  vision_blocks=blocks))
    return float(np.max(np.abs(np.concatenate(rows) - full)))


