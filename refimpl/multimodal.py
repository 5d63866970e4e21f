"""Image prompts: merging soft tokens into the text stream, per-layer inputs at image positions and the
vision block ids of the decoder mask (gemma4-multimodal-spec.md sections 2, 5, 6, 7), one small pure
function per step.

    ids  = text + boi + image_token x M_0 + eoi + text + boi + image_token x M_1 + eoi + ...
    llm_ids    = ids with every placeholder (image, video, audio token) replaced by pad_token_id
    x          = E[llm_ids] * sqrt(H)                      (text rows; scaled, exact)
    x[image]   = concat(soft tokens of image 0, 1, ...)   (NOT scaled by sqrt(H))
    PLE        = (table[llm_ids] * sqrt(P)  +  RMSNorm(x W_plmp^T H^-1/2)) / sqrt(2)
                 i.e. the pad row's token part and the context part of the MERGED embedding
    blocks     = 0, 1, ... for each maximal run of image/video tokens, -1 elsewhere (boi/eoi are -1);
                 used only when use_bidirectional_attention == "vision": sliding layers then allow
                 (k > q - W) and (k <= q or same block); full layers stay causal

``Gemma4.forward(llm_ids, embeddings=x, vision_blocks=blocks)`` does the PLE and the mask; this module
builds its three inputs (``multimodal_inputs``) and runs it (``multimodal_logits``). The soft tokens
come from ``refimpl.vision.vision_tower`` (or anything else that yields [M_i, H] per image).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .config import read_config_json
from .errors import ConfigError, InputError
from .model import Gemma4, KVCache, Trace

# transformers' Gemma4Config defaults (multimodal spec 1.2)
DEFAULT_TOKEN_IDS = dict(image_token_id=258880, boi_token_id=255999, eoi_token_id=258882, video_token_id=258884,
                         audio_token_id=258881, boa_token_id=256000, eoa_token_index=258883)


@dataclass(frozen=True)
class MultimodalTokens:
    """The placeholder ids of a Gemma4ForConditionalGeneration config.json (top level)."""

    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    video_token_id: int
    audio_token_id: int

    @property
    def placeholders(self) -> tuple[int, int, int]:
        return (self.image_token_id, self.video_token_id, self.audio_token_id)


def parse_multimodal_tokens(raw: dict, where: str = "config.json") -> MultimodalTokens:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level")
    values = {}
    for key in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id", "audio_token_id"):
        v = raw.get(key, DEFAULT_TOKEN_IDS[key])
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{where}: '{key}' must be a non-negative integer token id, got {v!r}")
        values[key] = v
    return MultimodalTokens(**values)


def load_multimodal_tokens(model_dir: str | Path) -> MultimodalTokens:
    path, raw = read_config_json(model_dir)
    return parse_multimodal_tokens(raw, str(path))


# ----------------------------------------------------------------------------------------------
# the steps


def vision_block_ids(is_vision: np.ndarray) -> np.ndarray:
    """[T] bool -> [T] int: each maximal run of vision tokens gets 0, 1, 2, ...; everything else -1."""
    starts = is_vision & ~np.concatenate([[False], is_vision[:-1]])
    return np.where(is_vision, np.cumsum(starts) - 1, -1)


def llm_input_ids(ids: np.ndarray, placeholder: np.ndarray, pad_token_id: int) -> np.ndarray:
    """ids with every placeholder position replaced by the pad id (its embedding row is overwritten,
    its per-layer-embedding row is the pad row)."""
    return np.where(placeholder, pad_token_id, ids)


def merge_soft_tokens(x: np.ndarray, image_mask: np.ndarray, soft_tokens: np.ndarray) -> np.ndarray:
    """x [T, H] with the rows where image_mask is true replaced, in order, by soft_tokens [M, H] (unscaled)."""
    out = np.array(x, copy=True)
    out[image_mask] = soft_tokens
    return out


def check_image_runs(ids: np.ndarray, tokens: MultimodalTokens, counts: Sequence[int]) -> None:
    """Image i must fill exactly the i-th maximal run of image tokens (``boi + image x M_i + eoi``)."""
    is_image = ids == tokens.image_token_id
    blocks = vision_block_ids(is_image)
    runs = [int(n) for n in np.bincount(blocks[blocks >= 0])] if is_image.any() else []
    if runs != list(counts):
        raise InputError(
            f"the prompt's image-token runs have lengths {runs}, but the images have {list(counts)} soft tokens; "
            f"each image needs its own run boi + {tokens.image_token_id} x M + eoi with M its soft-token count"
        )
    if (ids == tokens.video_token_id).any() or (ids == tokens.audio_token_id).any():
        raise InputError("video and audio placeholders are not supported yet (images only)")


@dataclass
class MultimodalInputs:
    """What ``Gemma4.forward`` takes for an image prompt."""

    ids: np.ndarray  # [T] llm ids: placeholders replaced by pad_token_id (select the PLE rows)
    embeddings: np.ndarray  # [T, H] E[ids] * sqrt(H) with the soft tokens scattered in
    vision_blocks: np.ndarray | None  # [T] block ids, or None when the checkpoint is causal over images


def multimodal_inputs(model: Gemma4, ids: Sequence[int] | np.ndarray, soft_tokens: Sequence[np.ndarray],
                      tokens: MultimodalTokens) -> MultimodalInputs:
    """Merge the soft tokens of each image ([M_i, H], in prompt order) into the prompt ``ids``."""
    ids = model.check_ids(ids)
    H = model.cfg.hidden_size
    soft = [np.asarray(s) for s in soft_tokens]
    for i, s in enumerate(soft):
        if s.ndim != 2 or s.shape[1] != H or s.shape[0] == 0:
            raise InputError(f"soft tokens of image {i} must be [M, {H}] (M >= 1), got {list(s.shape)}")
    check_image_runs(ids, tokens, [s.shape[0] for s in soft])
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    placeholder = np.isin(ids, tokens.placeholders)
    llm_ids = llm_input_ids(ids, placeholder, pad)
    x = model.embed(llm_ids)
    image_mask = ids == tokens.image_token_id
    if soft:
        x = merge_soft_tokens(x, image_mask, np.concatenate(soft).astype(model.dtype))
    vision = (ids == tokens.image_token_id) | (ids == tokens.video_token_id)
    blocks = vision_block_ids(vision) if model.cfg.use_bidirectional_attention == "vision" else None
    return MultimodalInputs(llm_ids, x, blocks)


def expand_image_placeholders(ids: Sequence[int] | np.ndarray, counts: Sequence[int],
                              tokens: MultimodalTokens) -> np.ndarray:
    """What the processor does to a prompt: each image token of ``ids`` (one per image, in order)
    becomes ``boi + image_token x M_i + eoi`` (multimodal spec 2).

    ``ids`` must hold exactly ``len(counts)`` image tokens, none of them already inside a
    ``boi ... eoi`` run (InputError otherwise)."""
    ids = np.asarray(ids, dtype=np.int64)
    at = np.flatnonzero(ids == tokens.image_token_id)
    if at.size != len(counts):
        raise InputError(
            f"the prompt holds {at.size} image placeholder(s) ({tokens.image_token_id}, the <|image|> token) but "
            f"{len(counts)} image(s) were given; put one placeholder where each image goes, in order"
        )
    if np.isin(ids, (tokens.boi_token_id, tokens.eoi_token_id)).any():
        raise InputError("the prompt already holds begin/end-of-image tokens; give one bare image placeholder per "
                         "image and let the processor expand it")
    out, start = [], 0
    for a, m in zip(at, counts):
        out += [ids[start:a], [tokens.boi_token_id], [tokens.image_token_id] * int(m), [tokens.eoi_token_id]]
        start = a + 1
    out.append(ids[start:])
    return np.concatenate([np.asarray(x, dtype=np.int64) for x in out])


def image_spans(ids: Sequence[int] | np.ndarray, tokens: MultimodalTokens) -> list[tuple[int, int]]:
    """(first position, length) of every maximal run of image tokens in ``ids``."""
    blocks = vision_block_ids(np.asarray(ids) == tokens.image_token_id)
    return [(int(np.flatnonzero(blocks == b)[0]), int(np.count_nonzero(blocks == b)))
            for b in range(int(blocks.max()) + 1)] if blocks.size else []


def multimodal_logits(model: Gemma4, ids: Sequence[int] | np.ndarray, soft_tokens: Sequence[np.ndarray],
                      tokens: MultimodalTokens, *, rows: str | Sequence[int] = "all", cache: KVCache | None = None,
                      trace: Trace | None = None) -> np.ndarray:
    """Logits [R, V] of an image prompt: ``multimodal_inputs`` then ``Gemma4.forward``. With a cache, the
    images must lie in this call (a block is never split across calls; later calls are text only)."""
    m = multimodal_inputs(model, ids, soft_tokens, tokens)
    return model.forward(m.ids, rows=rows, cache=cache, embeddings=m.embeddings, vision_blocks=m.vision_blocks,
                         trace=trace)


__all__: Sequence[str] = [
    "MultimodalTokens", "MultimodalInputs", "parse_multimodal_tokens", "load_multimodal_tokens",
    "vision_block_ids", "llm_input_ids", "merge_soft_tokens", "check_image_runs", "multimodal_inputs",
    "multimodal_logits", "expand_image_placeholders", "image_spans",
]
