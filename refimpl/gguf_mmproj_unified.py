"""The vision and audio embedders of a Gemma 4 Unified projector GGUF (projector types ``gemma4uv`` and
``gemma4ua``), read as the checkpoint's (docs/quantised.md, "Projector files").

The converter (conversion/gemma.py, ``Gemma4UnifiedVisionAudioModel``) writes the embedders under ``v.*``,
``mm.*`` and ``mm.a.*`` and changes three tensors for ggml's im2col, which emits a patch channels first
(R..R G..G B..B) where the checkpoint's patch is (row, column, channel): the columns of ``patch_dense`` and
the entries of ``patch_ln1`` are permuted to that order, and the position table [S_pos, 2, E] is stored as
[2, S_pos, E]. This reader undoes all three, so the embedder computes on the checkpoint's patch layout.
``pos_norm`` is stored as ``v.patch_norm.3``.

The geometry: the processor's patch size from ``clip.vision.patch_size``, the merge kernel 3 (llama.cpp's
fixed value, clip.cpp, unless ``clip.vision.projector.scale_factor`` says otherwise) and checked against the
patch width the tensors hold; the widths and the table length from the tensor shapes; the RMSNorm eps from
``clip.vision.attention.layer_norm_epsilon`` (vision) and 1e-6 (audio: clip.cpp's fixed value).
"""

from __future__ import annotations

import numpy as np

from .gguf_io import GGUFError, GGUFFile
from .gguf_mmproj_store import MmprojStore, ProjectorKeys, TowerMap
from .unified import (
    AUDIO_PROJECTION,
    PUBLISHED,
    VISION_NAMES,
    UnifiedAudioConfig,
    UnifiedAudioWeights,
    UnifiedVisionConfig,
    UnifiedVisionWeights,
)

GEMMA4UV, GEMMA4UA = "gemma4uv", "gemma4ua"
POOLING, AUDIO_EPS = 3, 1e-6  # llama.cpp's fixed values (clip.cpp)
_N = VISION_NAMES[PUBLISHED]
VISION_GGUF = {"mm.input_projection.weight": _N["projection"], "v.position_embd.weight": _N["pos_embedding"]}
for _gguf, _key in (("v.patch_embd", "patch_dense"), ("v.patch_norm.1", "patch_ln1"), ("v.patch_norm.2", "patch_ln2"),
                    ("v.patch_norm.3", "pos_norm")):
    for _leaf in ("weight", "bias"):
        VISION_GGUF[f"{_gguf}.{_leaf}"] = f"{_N[_key]}.{_leaf}"
PERMUTED = (_N["patch_dense"] + ".weight", _N["patch_ln1"] + ".weight", _N["patch_ln1"] + ".bias")


def chw_order(M: int) -> np.ndarray:
    """[3 M^2]: for each position i of a channels-first patch, the index of that value in the checkpoint's
    (row, column, channel) patch (the converter's ``perm``)."""
    i = np.arange(3 * M * M)
    channel, row, column = i // (M * M), (i % (M * M)) // M, i % M
    return row * M * 3 + column * 3 + channel


def _vision_name(gguf_name: str) -> str:
    if gguf_name not in VISION_GGUF:
        raise GGUFError(f"tensor {gguf_name!r} is not one of a Gemma 4 Unified vision embedder's (mmproj, projector "
                        "gemma4uv)")
    return VISION_GGUF[gguf_name]


def _vision_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name == _N["pos_embedding"] and len(shape) == 3:
        return (shape[1], shape[0], shape[2])
    return shape


def _vision_undo(name: str, x: np.ndarray) -> np.ndarray:
    if name == _N["pos_embedding"] and x.ndim == 3:
        return x.transpose(1, 0, 2)  # [2, S_pos, E] -> [S_pos, 2, E]
    if name in PERMUTED:
        M = round((x.shape[-1] / 3) ** 0.5)
        out = np.empty_like(x)
        out[..., chw_order(M)] = x  # stored[..., i] = checkpoint[..., perm[i]]
        return out
    return x


def _audio_name(gguf_name: str) -> str:
    if gguf_name != "mm.a.input_projection.weight":
        raise GGUFError(f"tensor {gguf_name!r} is not one of a Gemma 4 Unified audio embedder's (mmproj, projector "
                        "gemma4ua)")
    return AUDIO_PROJECTION


UNIFIED_VISION = TowerMap(lambda n: not n.startswith(("a.", "mm.a.")), _vision_name, _vision_shape, _vision_undo)
UNIFIED_AUDIO = TowerMap(lambda n: n.startswith(("a.", "mm.a.")), _audio_name, lambda name, shape: shape)


def mmproj_unified_vision_config(f: GGUFFile) -> UnifiedVisionConfig:
    """The vision-embedder config of a ``gemma4uv`` projector."""
    keys = ProjectorKeys(f, "vision")
    p, k = keys.integer("patch_size"), int(f.metadata.get("clip.vision.projector.scale_factor", POOLING))
    E, C = keys.shape("v.patch_embd.weight")
    if C != 3 * (p * k) ** 2:
        raise GGUFError(f"{f.path}: 'v.patch_embd.weight' takes {C} values per patch, but patch size {p} x merge {k} "
                        f"makes {3 * (p * k) ** 2} (3 x {p * k}^2)")
    return UnifiedVisionConfig(patch_size=p, pooling_kernel_size=k, mm_embed_dim=E,
                               mm_posemb_size=keys.shape("v.position_embd.weight")[1],
                               rms_norm_eps=keys.decimal("attention.layer_norm_epsilon"),
                               text_hidden_size=keys.shape("mm.input_projection.weight")[0])


def load_gemma4uv(f: GGUFFile, dtype: str | np.dtype = "float64") -> tuple[UnifiedVisionWeights, UnifiedVisionConfig]:
    cfg = mmproj_unified_vision_config(f)
    return UnifiedVisionWeights(f.path, cfg, dtype, store=MmprojStore(f, UNIFIED_VISION)), cfg


def load_gemma4ua(f: GGUFFile, dtype: str | np.dtype = "float64") -> tuple[UnifiedAudioWeights, UnifiedAudioConfig]:
    H, A = ProjectorKeys(f, "audio").shape("mm.a.input_projection.weight")
    cfg = UnifiedAudioConfig(audio_embed_dim=A, rms_norm_eps=AUDIO_EPS, text_hidden_size=H)
    return UnifiedAudioWeights(f.path, cfg, dtype, store=MmprojStore(f, UNIFIED_AUDIO)), cfg
