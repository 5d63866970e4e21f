"""Gemma 4 Unified (``gemma4_unified``, the 12B encoder-free model): the image patches its processor
makes, the vision embedder and the raw-waveform audio embedder (gemma4-unified-and-mtp-spec.md A5-A7,
A12), one small pure function per step. The text decoder is ``refimpl.model.Gemma4`` (no per-layer
inputs, no MoE, K=V full layers: ``refimpl.config`` derives it) and the merge of soft tokens into the
prompt is ``refimpl.multimodal`` (soft tokens are not scaled; each image is a vision block).

Shapes: M = p k model patch side in pixels (p the processor's patch size, k the merge kernel),
C = 3 M^2 values per patch, E the patch-embedding width, S_pos the position table length, H text
hidden, A samples per audio frame (``audio_embed_dim``).

    image uint8 [h, w, 3]
      -> resize to (H', W'), multiples of M, at most max_soft_tokens patches    (refimpl.image rule)
      -> x / 255 (no 2x - 1, no mean/std)                                       [H', W', 3]
      -> M x M blocks row-major, each (row, column, channel)                    [N, C]
         (the processor's 3x3 merge of p-pixel patches is exactly this)
      -> positions (x = column, y = row); padded to max_soft_tokens rows with zero patches at (-1, -1)
    vision embedder, per patch row:
      h = LN(LN(pv; ln1) W_dense^T + b; ln2)           LayerNorm with mean and bias, eps 1e-5
      h = LN(h + T[x, 0] + T[y, 1]; pos_norm)          T [S_pos, 2, E]; an axis at -1 adds nothing
      e = RMSNorm_noweight(h; eps) W_proj^T            [N, H]; rows with a -1 coordinate dropped
    audio: waveform -> zero-padded to a multiple of A -> frames [F, A] (float32, as the feature
      extractor emits them) -> RMSNorm_noweight(frame; eps) W_audio^T          [F, H]

Tensor names: the published ones (``model.vision_embedder.*`` with ``model.embed_vision.
embedding_projection.weight``) and transformers 5.24's module names (``model.embed_vision.*`` with
``model.embed_vision.multimodal_embedder.embedding_projection.weight``) are both read.

Resizing: transformers' Unified processor resizes through torchvision (bicubic, antialias), which
cannot be run here; this module uses the Pillow-exact bicubic of ``refimpl.image`` (the Gemma 4 Pil
processor's). An image already at its target size is not resampled in either, and fixture sets store
the patches, so engines are graded on the same model input whatever resizer made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .config import config_family
from .config_fields import check_positive, check_positive_float, get_field, read_config_json, tower_section
from .errors import ConfigError, InputError
from .image import (
    ImageProcessorSettings,
    aspect_ratio_preserving_size,
    check_image_array,
    patch_positions,
    patchify,
    rescale,
    resize_bicubic,
)
from .ops import linear
from .schedule import layer_norm, rms_norm
from .weights import TowerWeights

LAYER_NORM_EPS = 1e-5  # torch nn.LayerNorm's default: the patch-embedding LayerNorms do not use rms_norm_eps
PUBLISHED, MODULES = "published", "modules"  # the two tensor namings (module doc)
VISION_NAMES = {
    PUBLISHED: {"patch_ln1": "model.vision_embedder.patch_ln1", "patch_dense": "model.vision_embedder.patch_dense",
                "patch_ln2": "model.vision_embedder.patch_ln2", "pos_embedding": "model.vision_embedder.pos_embedding",
                "pos_norm": "model.vision_embedder.pos_norm",
                "projection": "model.embed_vision.embedding_projection.weight"},
    MODULES: {"patch_ln1": "model.embed_vision.patch_ln1", "patch_dense": "model.embed_vision.patch_dense",
              "patch_ln2": "model.embed_vision.patch_ln2", "pos_embedding": "model.embed_vision.pos_embedding",
              "pos_norm": "model.embed_vision.pos_norm",
              "projection": "model.embed_vision.multimodal_embedder.embedding_projection.weight"},
}
AUDIO_PROJECTION = "model.embed_audio.embedding_projection.weight"
SAMPLING_RATE = 16_000


def is_unified(model_dir: str | Path) -> bool:
    """Whether a checkpoint directory's config.json is a Gemma 4 Unified one (False when unreadable:
    the loaders report that)."""
    try:
        _, raw = read_config_json(model_dir)
    except ConfigError:
        return False
    return config_family(raw) == "gemma4_unified"


# ----------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class UnifiedVisionConfig:
    patch_size: int  # p, the processor's patch size
    pooling_kernel_size: int  # k, k x k patches merge into one model patch
    mm_embed_dim: int  # E
    mm_posemb_size: int  # S_pos, per-axis length of the position table
    rms_norm_eps: float  # of the weightless RMSNorm before the projection only
    text_hidden_size: int  # H

    @property
    def model_patch_size(self) -> int:  # M
        return self.patch_size * self.pooling_kernel_size

    @property
    def patch_dim(self) -> int:  # C
        return 3 * self.model_patch_size ** 2


@dataclass(frozen=True)
class UnifiedAudioConfig:
    audio_embed_dim: int  # A, samples per frame (one soft token)
    rms_norm_eps: float
    text_hidden_size: int  # H


def _positive(section: dict, key: str, default: int, where: str) -> int:
    """The positive integer ``section[key]`` (``default`` when absent), else ConfigError naming it."""
    return check_positive(get_field(section, key, int, default, where), key, where)


def parse_unified_vision_config(raw: dict, where: str = "config.json") -> UnifiedVisionConfig:
    vision, H, where = tower_section(raw, "vision_config", "vision_embedder", "vision embedder (text or audio only)",
                                     where)
    eps = get_field(vision, "rms_norm_eps", float, 1e-6, where)
    check_positive_float(eps, "rms_norm_eps", where)
    cfg = UnifiedVisionConfig(
        patch_size=_positive(vision, "patch_size", 16, where),
        pooling_kernel_size=_positive(vision, "pooling_kernel_size", 3, where),
        mm_embed_dim=_positive(vision, "mm_embed_dim", 3840, where),
        mm_posemb_size=_positive(vision, "mm_posemb_size", 1120, where),
        rms_norm_eps=eps, text_hidden_size=H)
    proj_in = get_field(vision, "output_proj_dims", int, cfg.mm_embed_dim, where)
    if proj_in != cfg.mm_embed_dim:
        raise ConfigError(f"{where}: 'output_proj_dims' ({proj_in}) must equal 'mm_embed_dim' ({cfg.mm_embed_dim}): "
                          "it is the input width of the projection that follows the patch embedding")
    if "model_patch_size" in vision and vision["model_patch_size"] != cfg.model_patch_size:
        raise ConfigError(f"{where}: 'model_patch_size' is {vision['model_patch_size']!r}, but patch_size x "
                          f"pooling_kernel_size is {cfg.model_patch_size}; fix one of them")
    return cfg


def parse_unified_audio_config(raw: dict, where: str = "config.json") -> UnifiedAudioConfig:
    audio, H, where = tower_section(raw, "audio_config", "embed_audio", "audio embedder (text or image only)", where)
    A = _positive(audio, "audio_embed_dim", 640, where)
    eps = get_field(audio, "rms_norm_eps", float, 1e-6, where)
    check_positive_float(eps, "rms_norm_eps", where)
    return UnifiedAudioConfig(A, eps, H)


# ----------------------------------------------------------------------------------------------
# weights


def expected_unified_vision_tensors(cfg: UnifiedVisionConfig, naming: str = PUBLISHED) -> dict[str, tuple[int, ...]]:
    """Every tensor of the vision embedder (full checkpoint names, ``naming`` PUBLISHED or MODULES) and its shape."""
    n, C, E = VISION_NAMES[naming], cfg.patch_dim, cfg.mm_embed_dim
    return {n["patch_ln1"] + ".weight": (C,), n["patch_ln1"] + ".bias": (C,),
            n["patch_dense"] + ".weight": (E, C), n["patch_dense"] + ".bias": (E,),
            n["patch_ln2"] + ".weight": (E,), n["patch_ln2"] + ".bias": (E,),
            n["pos_embedding"]: (cfg.mm_posemb_size, 2, E),
            n["pos_norm"] + ".weight": (E,), n["pos_norm"] + ".bias": (E,),
            n["projection"]: (cfg.text_hidden_size, E)}


def expected_unified_audio_tensors(cfg: UnifiedAudioConfig) -> dict[str, tuple[int, ...]]:
    return {AUDIO_PROJECTION: (cfg.text_hidden_size, cfg.audio_embed_dim)}


class UnifiedVisionWeights(TowerWeights):
    """The vision-embedder tensors of a Unified checkpoint (either naming), validated, decoded on demand."""

    what = "vision embedder"
    prefixes = ("model.vision_embedder.", "model.embed_vision.")
    parse_config = staticmethod(parse_unified_vision_config)

    def expected(self) -> dict[str, tuple[int, ...]]:
        """The tensors of the naming the checkpoint uses (``self.naming``, set here: ``TowerWeights``
        calls this once, right after opening the store, to validate them)."""
        modules = VISION_NAMES[MODULES]["patch_dense"] + ".weight" in self.store
        self.naming = MODULES if modules else PUBLISHED
        return expected_unified_vision_tensors(self.cfg, self.naming)

    def tensor(self, key: str, leaf: str = "") -> np.ndarray:
        """A tensor by its role (``patch_ln1``, ..., ``projection``; ``leaf`` "weight" / "bias")."""
        name = VISION_NAMES[self.naming][key]
        return self[name + "." + leaf if leaf else name]

    def position_rows(self, index: np.ndarray) -> np.ndarray:
        """T[x, 0] and T[y, 1] rows [N, 2, E] for index [N, 2] (in range), gathered from the memory map."""
        table = VISION_NAMES[self.naming]["pos_embedding"]
        return np.stack([self.store.rows(table, (index[:, axis], axis), self.dtype) for axis in (0, 1)], axis=1)


class UnifiedAudioWeights(TowerWeights):
    what = "audio embedder"
    prefixes = ("model.embed_audio.",)
    parse_config = staticmethod(parse_unified_audio_config)
    expected_tensors = staticmethod(expected_unified_audio_tensors)


def load_unified_audio(model_dir: str | Path, dtype: str | np.dtype = "float64"
                       ) -> tuple[UnifiedAudioWeights, UnifiedAudioConfig]:
    return UnifiedAudioWeights.load(model_dir, dtype)


# ----------------------------------------------------------------------------------------------
# images: the processor side


@dataclass(frozen=True)
class UnifiedImage:
    """One image as the Unified processor hands it to the model."""

    pixels: np.ndarray  # uint8 [H', W', 3], the resized image
    pixel_values: np.ndarray  # float64 [max_soft_tokens, C] in [0, 1]; rows past num_soft_tokens are zeros
    positions: np.ndarray  # int64 [max_soft_tokens, 2] = (x, y); padding rows (-1, -1)
    num_soft_tokens: int  # (H'/M) (W'/M)


def pad_patches(patches: np.ndarray, positions: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """[N, C], [N, 2] -> [rows, C] with zero patches and [rows, 2] with (-1, -1) after the N real ones."""
    N = patches.shape[0]
    padded = np.zeros((rows, patches.shape[1]), dtype=patches.dtype)
    padded[:N] = patches
    where = np.full((rows, 2), -1, dtype=np.int64)
    where[:N] = positions
    return padded, where


def preprocess_unified_image(image: np.ndarray, settings: ImageProcessorSettings,
                             resize: Callable[[np.ndarray, int, int], np.ndarray] = resize_bicubic) -> UnifiedImage:
    """RGB uint8 [h, w, 3] -> the vision embedder's padded input (module doc); ``resize`` as
    ``refimpl.image.preprocess_image``'s."""
    image = check_image_array(image)
    p, k, budget = settings.patch_size, settings.pooling_kernel_size, settings.max_soft_tokens
    M = p * k
    h, w = aspect_ratio_preserving_size(image.shape[0], image.shape[1], p, budget, k)
    pixels = image if (h, w) == image.shape[:2] else resize(image, h, w)  # [H', W', 3]
    patches = patchify(rescale(pixels), M)  # [N, 3 M^2]: one M-pixel patch = k x k merged p-pixel patches
    values, positions = pad_patches(patches, patch_positions(h // M, w // M), budget)
    return UnifiedImage(pixels, values, positions, patches.shape[0])


# ----------------------------------------------------------------------------------------------
# the vision embedder, one step per function


def patch_embedding(pv: np.ndarray, w: UnifiedVisionWeights) -> np.ndarray:
    """[N, C] -> [N, E]: LN(LN(pv; ln1) W_dense^T + b; ln2)."""
    h = layer_norm(pv, w.tensor("patch_ln1", "weight"), w.tensor("patch_ln1", "bias"), LAYER_NORM_EPS)
    h = linear(h, w.tensor("patch_dense", "weight")) + w.tensor("patch_dense", "bias")
    return layer_norm(h, w.tensor("patch_ln2", "weight"), w.tensor("patch_ln2", "bias"), LAYER_NORM_EPS)


def position_embedding(positions: np.ndarray, w: UnifiedVisionWeights) -> np.ndarray:
    """[N, 2] (x, y) -> [N, E] = T[x, 0] + T[y, 1]; an axis at -1 contributes zero (transformers
    clamps it to 0 for the lookup and multiplies by its validity)."""
    valid = positions != -1  # [N, 2]
    rows = w.position_rows(np.where(valid, positions, 0))  # [N, 2, E]
    return np.sum(rows * valid[:, :, None], axis=1)


def embed_patches(h: np.ndarray, projection: np.ndarray, eps: float) -> np.ndarray:
    """[N, E] -> [N, H]: weightless RMSNorm, then the projection (no bias)."""
    return linear(rms_norm(h, None, eps), projection)


def check_patches(pixel_values, positions, cfg: UnifiedVisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """The embedder's input as float [N, C] and int64 [N, 2]; InputError for wrong shapes, a coordinate
    outside the position table or below -1, or no real patch."""
    pv, pos = np.asarray(pixel_values), np.asarray(positions)
    if pv.ndim != 2 or pv.shape[1] != cfg.patch_dim or not np.issubdtype(pv.dtype, np.floating):
        raise InputError(f"pixel_values must be float [N, {cfg.patch_dim}] (3 x {cfg.model_patch_size}^2 values per "
                         f"model patch), got {pv.dtype} {list(pv.shape)}")
    if pos.shape != (pv.shape[0], 2) or not np.issubdtype(pos.dtype, np.integer):
        raise InputError(f"positions must be integers [{pv.shape[0]}, 2] (x, y per patch), got {pos.dtype} "
                         f"{list(pos.shape)}")
    if (pos < -1).any() or (pos >= cfg.mm_posemb_size).any():
        raise InputError(f"patch positions must lie in [0, {cfg.mm_posemb_size}) (mm_posemb_size), or be -1 on "
                         f"padding rows; got {int(pos.min())}..{int(pos.max())}")
    if not (pos != -1).all(axis=1).any():
        raise InputError("the image has no real patch (every position is (-1, -1))")
    return pv, pos.astype(np.int64)


def vision_embedder(pixel_values, positions, weights: UnifiedVisionWeights, cfg: UnifiedVisionConfig) -> np.ndarray:
    """Soft tokens [N_real, H] of one image from its (padded) patches [N, C] and positions [N, 2]: the
    embedder runs on every row; rows with a -1 coordinate (padding: (-1, -1)) are then dropped, as
    transformers does (module doc)."""
    pv, pos = check_patches(pixel_values, positions, cfg)
    pv = pv.astype(weights.dtype)
    h = patch_embedding(pv, weights)  # [N, E]
    h = layer_norm(h + position_embedding(pos, weights), weights.tensor("pos_norm", "weight"),
                   weights.tensor("pos_norm", "bias"), LAYER_NORM_EPS)
    e = embed_patches(h, weights.tensor("projection"), cfg.rms_norm_eps)  # [N, H]
    return weights.check_finite(e[(pos != -1).all(axis=1)])


# ----------------------------------------------------------------------------------------------
# audio


def audio_frames(waveform, cfg: UnifiedAudioConfig) -> np.ndarray:
    """[n] samples -> [ceil(n / A), A]: zero-padded to a multiple of A, cut into frames, rounded to
    float32 as the feature extractor emits them (returned as float64: the rounding is the input's)."""
    x = np.asarray(waveform)
    if x.ndim != 1 or x.size == 0 or not np.issubdtype(x.dtype, np.floating):
        raise InputError(f"the waveform must be a non-empty float array [n] (16 kHz samples), got {x.dtype} "
                         f"{list(x.shape)}")
    if not np.isfinite(x).all():
        raise InputError("the waveform holds NaN or inf samples")
    A = cfg.audio_embed_dim
    F = -(-x.size // A)
    padded = np.zeros(F * A)
    padded[:x.size] = x
    return padded.reshape(F, A).astype(np.float32).astype(np.float64)


def audio_embedder(frames, weights: UnifiedAudioWeights, cfg: UnifiedAudioConfig) -> np.ndarray:
    """Soft tokens [F, H] of one clip from its frames [F, A]: weightless RMSNorm, then the projection."""
    f = np.asarray(frames)
    if f.ndim != 2 or f.shape[1] != cfg.audio_embed_dim or f.shape[0] == 0 or not np.issubdtype(f.dtype, np.floating):
        raise InputError(f"audio frames must be float [F, {cfg.audio_embed_dim}] (F >= 1), got {f.dtype} "
                         f"{list(f.shape)}")
    e = linear(rms_norm(f.astype(weights.dtype), None, cfg.rms_norm_eps), weights[AUDIO_PROJECTION])
    return weights.check_finite(e)

