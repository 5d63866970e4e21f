"""Image and audio prompts: merging soft tokens into the text stream, per-layer inputs at image/audio
positions and the vision block ids of the decoder mask (gemma4-multimodal-spec.md sections 2, 5, 6, 7,
9), one small pure function per step.

    ids  = text + boi + image_token x M_0 + eoi + text + boa + audio_token x A_0 + eoa + ...
    llm_ids    = ids with every placeholder (image, video, audio token) replaced by pad_token_id
    x          = E[llm_ids] * sqrt(H)                      (text rows; scaled, exact)
    x[image]   = concat(soft tokens of image 0, 1, ...)   (NOT scaled by sqrt(H))
    x[audio]   = concat(soft tokens of clip 0, 1, ...)    (NOT scaled by sqrt(H))
    PLE        = (table[llm_ids] * sqrt(P)  +  RMSNorm(x W_plmp^T H^-1/2)) / sqrt(2)
                 i.e. the pad row's token part and the context part of the MERGED embedding
                 (image and audio positions alike)
    blocks     = 0, 1, ... for each maximal run of image/video tokens, -1 elsewhere (boi/eoi, boa/eoa and
                 the audio tokens are -1: audio, token type 3, is always causal);
                 used only when use_bidirectional_attention == "vision": sliding layers then allow
                 (k > q - W) and (k <= q or same block); full layers stay causal

``Gemma4.forward(llm_ids, embeddings=x, vision_blocks=blocks)`` does the PLE and the mask; this module
builds its three inputs (``multimodal_inputs``) and runs it (``multimodal_logits``). The image soft
tokens come from ``refimpl.vision.vision_tower``, the audio ones from ``refimpl.audio.audio_tower`` (one
call per clip), or anything else that yields [M_i, H] per image / clip. Image i fills the i-th run of
image tokens, clip j the j-th run of audio tokens, and video frame f (refimpl.video: each sampled frame an image
of its own) the f-th run of video tokens; a frame is a vision block like an image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .arrays import to_host
from .config import text_section
from .config_fields import read_config_json
from .errors import ConfigError, InputError
from .gguf_io import is_gguf, open_gguf
from .model import Gemma4, KVCache, Trace

# transformers' Gemma4Config defaults (multimodal spec 1.2)
DEFAULT_TOKEN_IDS = dict(image_token_id=258880, boi_token_id=255999, eoi_token_id=258882, video_token_id=258884,
                         audio_token_id=258881, boa_token_id=256000, eoa_token_index=258883)


@dataclass(frozen=True)
class MultimodalTokens:
    """The placeholder ids of a Gemma4ForConditionalGeneration config.json (top level). The end-of-audio
    id is read from the key ``eoa_token_index`` (transformers' name; there is no ``eoa_token_id``)."""

    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    video_token_id: int
    audio_token_id: int
    boa_token_id: int = DEFAULT_TOKEN_IDS["boa_token_id"]
    eoa_token_id: int = DEFAULT_TOKEN_IDS["eoa_token_index"]

    @property
    def placeholders(self) -> tuple[int, int, int]:
        return (self.image_token_id, self.video_token_id, self.audio_token_id)


def parse_multimodal_tokens(raw: dict, where: str = "config.json") -> MultimodalTokens:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level")
    values = {}
    for key, default in DEFAULT_TOKEN_IDS.items():
        v = raw.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{where}: '{key}' must be a non-negative integer token id, got {v!r}")
        values["eoa_token_id" if key == "eoa_token_index" else key] = v
    return MultimodalTokens(**values)


# config.json placeholder keys -> tokenizer pieces (transformers' Gemma4Config names; eoa is "eoa_token_index")
MULTIMODAL_PIECES = dict(boi_token_id="<|image>", eoi_token_id="<image|>", image_token_id="<|image|>",
                         boa_token_id="<|audio>", eoa_token_index="<audio|>", audio_token_id="<|audio|>",
                         video_token_id="<|video|>")
# the config.json keys of the ids an image / audio prompt puts in (placeholder, begin, end)
PROMPT_TOKEN_KEYS = {"image": ("image_token_id", "boi_token_id", "eoi_token_id"),
                     "audio": ("audio_token_id", "boa_token_id", "eoa_token_index")}


def gguf_multimodal_tokens(path: str | Path, kinds: Sequence[str] = ()) -> MultimodalTokens:
    """The placeholder ids of a GGUF model, looked up by their pieces in its vocabulary
    (``tokenizer.ggml.tokens``; the file holds no ids for them). The pieces of ``kinds`` must be there
    (ConfigError naming the piece otherwise); an id the prompts do not use and the vocabulary lacks is -1,
    which no token equals (every id, for a file without a vocabulary asked for no media prompt)."""
    f = open_gguf(path)
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) and not kinds:
        tokens = []  # text prompts only: no placeholder is looked for
    if not isinstance(tokens, list):
        raise ConfigError(f"{f.path}: the GGUF file holds no vocabulary (tokenizer.ggml.tokens); image and audio "
                          "prompts find their placeholder tokens in it")
    index = {piece: i for i, piece in enumerate(tokens) if piece in MULTIMODAL_PIECES.values()}
    values = {}
    for key, piece in MULTIMODAL_PIECES.items():
        if piece not in index and any(key in PROMPT_TOKEN_KEYS[kind] for kind in kinds):
            raise ConfigError(f"{f.path}: the vocabulary has no {piece!r} token, which "
                              f"{'image' if key in PROMPT_TOKEN_KEYS['image'] else 'audio'} prompts put in")
        values["eoa_token_id" if key == "eoa_token_index" else key] = index.get(piece, -1)
    return MultimodalTokens(**values)


def load_multimodal_tokens(model_dir: str | Path, kinds: Sequence[str] = ()) -> MultimodalTokens:
    """The placeholder ids of a checkpoint (of a GGUF model: ``gguf_multimodal_tokens``). ``kinds`` ("image",
    "audio"): the prompts the caller builds; the ids each puts in (placeholder, begin, end) must lie inside the
    text vocabulary (ConfigError naming the key otherwise)."""
    if is_gguf(model_dir):
        return gguf_multimodal_tokens(model_dir, kinds)
    path, raw = read_config_json(model_dir)
    tokens = parse_multimodal_tokens(raw, str(path))
    text, _, _ = text_section(raw, str(path))
    vocab = text.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:  # else load_config reports it
        for kind in kinds:
            for key in PROMPT_TOKEN_KEYS[kind]:
                value = getattr(tokens, "eoa_token_id" if key == "eoa_token_index" else key)
                if value >= vocab:
                    raise ConfigError(
                        f"{path}: '{key}' is {value}, outside the text vocabulary [0, {vocab}); "
                        f"{kind} prompts need it inside (fix the id, or the text vocab_size)"
                    )
    return tokens


# ----------------------------------------------------------------------------------------------
# the steps


def vision_block_ids(is_vision: np.ndarray) -> np.ndarray:
    """[T] bool -> [T] int: each maximal run of vision tokens gets 0, 1, 2, ...; everything else -1."""
    starts = is_vision & ~np.concatenate([[False], is_vision[:-1]])
    return np.where(is_vision, np.cumsum(starts) - 1, -1)


def run_lengths(mask: np.ndarray) -> list[int]:
    """[T] bool -> the lengths of its maximal runs of True, in order."""
    blocks = vision_block_ids(np.asarray(mask, dtype=bool))
    return [int(n) for n in np.bincount(blocks[blocks >= 0])] if (blocks >= 0).any() else []


def vision_token_mask(ids: np.ndarray, tokens: MultimodalTokens) -> np.ndarray:
    """[T] bool: the positions that can form a vision block (image and video tokens). Audio tokens never
    do (token type 3; transformers' block ids look at types 1 and 2 only)."""
    return (ids == tokens.image_token_id) | (ids == tokens.video_token_id)


def llm_input_ids(ids: np.ndarray, placeholder: np.ndarray, pad_token_id: int) -> np.ndarray:
    """ids with every placeholder position replaced by the pad id (its embedding row is overwritten,
    its per-layer-embedding row is the pad row)."""
    return np.where(placeholder, pad_token_id, ids)


def merge_soft_tokens(x: np.ndarray, image_mask: np.ndarray, soft_tokens: np.ndarray) -> np.ndarray:
    """x [T, H] with the rows where image_mask is true replaced, in order, by soft_tokens [M, H] (unscaled)."""
    out = np.array(x, copy=True)
    out[image_mask] = soft_tokens
    return out


def check_image_runs(ids: np.ndarray, tokens: MultimodalTokens, counts: Sequence[int],
                     audio_counts: Sequence[int] = (), frame_counts: Sequence[int] = ()) -> None:
    """Image i must fill exactly the i-th maximal run of image tokens (``boi + image x M_i + eoi``), video frame f
    the f-th run of video tokens (``frame_counts``: each frame's soft tokens, the frames of every video in prompt
    order); audio placeholders only pass with audio soft tokens (``audio_counts``, checked by
    ``check_audio_runs``)."""
    runs = run_lengths(ids == tokens.image_token_id)
    if runs != list(counts):
        raise InputError(
            f"the prompt's image-token runs have lengths {runs}, but the images have {list(counts)} soft tokens; "
            f"each image needs its own run boi + {tokens.image_token_id} x M + eoi with M its soft-token count"
        )
    frames = run_lengths(ids == tokens.video_token_id)
    if frames != list(frame_counts):
        raise InputError(
            f"the prompt's video-token runs have lengths {frames}, but the video frames given have "
            f"{list(frame_counts)} soft tokens; each frame needs its own run boi + {tokens.video_token_id} x N + eoi "
            "(refimpl.video.video_ids) and its soft tokens in video_soft_tokens, one [N, H] array a frame"
        )
    n_audio = int(np.count_nonzero(ids == tokens.audio_token_id))
    if n_audio and not len(audio_counts):
        raise InputError(
            f"the prompt holds {n_audio} audio placeholder(s) ({tokens.audio_token_id}) but no audio soft tokens "
            "were given; pass audio_soft_tokens (one [M, H] array per clip, from refimpl.audio.audio_tower)"
        )
    if len(audio_counts):
        check_audio_runs(ids, tokens, audio_counts)


def check_audio_runs(ids: np.ndarray, tokens: MultimodalTokens, counts: Sequence[int]) -> None:
    """Clip j must fill exactly the j-th maximal run of audio tokens (``boa + audio x A_j + eoa``)."""
    runs = run_lengths(ids == tokens.audio_token_id)
    if runs != list(counts):
        raise InputError(
            f"the prompt's audio-token runs have lengths {runs}, but the audio clips have {list(counts)} soft "
            f"tokens; each clip needs its own run boa + {tokens.audio_token_id} x M + eoa with M its soft-token count"
        )


def check_soft_tokens(soft_tokens: Sequence[np.ndarray], H: int, what: str) -> list[np.ndarray]:
    """Each entry as an array [M, H] with M >= 1 (InputError naming ``what`` i otherwise)."""
    soft = [np.asarray(s) for s in soft_tokens]
    for i, s in enumerate(soft):
        if s.ndim != 2 or s.shape[1] != H or s.shape[0] == 0:
            raise InputError(f"soft tokens of {what} {i} must be [M, {H}] (M >= 1), got {list(s.shape)}")
    return soft


@dataclass
class MultimodalInputs:
    """What ``Gemma4.forward`` takes for an image / audio prompt."""

    ids: np.ndarray  # [T] llm ids: placeholders replaced by pad_token_id (select the PLE rows)
    embeddings: np.ndarray  # [T, H] E[ids] * sqrt(H) with the soft tokens scattered in
    vision_blocks: np.ndarray | None  # [T] block ids, or None when the checkpoint is causal over images
    # the placeholder ids (image, audio, video tokens): a later call's generated or drafted one is fed as pad_token_id
    placeholders: tuple[int, ...] = ()


def multimodal_inputs(model: Gemma4, ids: Sequence[int] | np.ndarray, soft_tokens: Sequence[np.ndarray],
                      tokens: MultimodalTokens, *, audio_soft_tokens: Sequence[np.ndarray] = (),
                      video_soft_tokens: Sequence[np.ndarray] = ()) -> MultimodalInputs:
    """Merge the soft tokens of each image ([M_i, H], in prompt order), of each audio clip
    (``audio_soft_tokens``, [A_j, H], in prompt order) and of each video frame (``video_soft_tokens``, [N_f, H],
    the frames of every video in prompt order; refimpl.video) into the prompt ``ids``."""
    ids = model.check_ids(ids)
    H = model.cfg.hidden_size
    soft = check_soft_tokens(soft_tokens, H, "image")
    audio = check_soft_tokens(audio_soft_tokens, H, "audio clip")
    frames = check_soft_tokens(video_soft_tokens, H, "video frame")
    check_image_runs(ids, tokens, [s.shape[0] for s in soft], [a.shape[0] for a in audio],
                     [f.shape[0] for f in frames])
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    placeholder = np.isin(ids, tokens.placeholders)
    llm_ids = llm_input_ids(ids, placeholder, pad)
    x = to_host(model.embed(llm_ids))  # merged on the host (a model on the GPU copies it back)
    if soft:
        x = merge_soft_tokens(x, ids == tokens.image_token_id, np.concatenate(soft).astype(model.dtype))
    if audio:
        x = merge_soft_tokens(x, ids == tokens.audio_token_id, np.concatenate(audio).astype(model.dtype))
    if frames:
        x = merge_soft_tokens(x, ids == tokens.video_token_id, np.concatenate(frames).astype(model.dtype))
    vision = vision_token_mask(ids, tokens)
    blocks = vision_block_ids(vision) if model.cfg.use_bidirectional_attention == "vision" else None
    return MultimodalInputs(llm_ids, x, blocks, tuple(int(t) for t in tokens.placeholders))


def expand_image_placeholders(ids: Sequence[int] | np.ndarray, counts: Sequence[int],
                              tokens: MultimodalTokens) -> np.ndarray:
    """What the processor does to a prompt: each image token of ``ids`` (one per image, in order)
    becomes ``boi + image_token x M_i + eoi`` (multimodal spec 2).

    ``ids`` must hold exactly ``len(counts)`` image tokens, none of them already inside a
    ``boi ... eoi`` run (InputError otherwise)."""
    return _expand(ids, counts, tokens.image_token_id, tokens.boi_token_id, tokens.eoi_token_id, "image",
                   "image", "image(s)", "<|image|>")


def expand_audio_placeholders(ids: Sequence[int] | np.ndarray, counts: Sequence[int],
                              tokens: MultimodalTokens) -> np.ndarray:
    """What the processor does to a prompt with audio: each audio token of ``ids`` (one per clip, in
    order) becomes ``boa + audio_token x A_j + eoa`` (multimodal spec 2).

    ``ids`` must hold exactly ``len(counts)`` audio tokens and no begin/end-of-audio token (InputError
    otherwise). Image placeholders are left alone (expand them with ``expand_image_placeholders``)."""
    return _expand(ids, counts, tokens.audio_token_id, tokens.boa_token_id, tokens.eoa_token_id, "audio",
                   "clip", "audio clip(s)", "<|audio|>")


def _expand(ids, counts: Sequence[int], placeholder: int, begin: int, end: int, what: str, item: str,
            items: str, piece: str) -> np.ndarray:
    """Each ``placeholder`` of ``ids`` (one per item, in order) -> ``begin + placeholder x count + end``."""
    ids = np.asarray(ids, dtype=np.int64)
    at = placeholder_positions(ids, placeholder, len(counts), what, item, items, piece)
    if np.isin(ids, (begin, end)).any():
        raise InputError(f"the prompt already holds begin/end-of-{what} tokens; give one bare {what} placeholder "
                         f"per {item} and let the processor expand it")
    return splice(ids, at, [[begin] + [placeholder] * int(m) + [end] for m in counts])


def placeholder_positions(ids: np.ndarray, placeholder: int, n: int, what: str, item: str, items: str,
                          piece: str) -> np.ndarray:
    """The positions of the ``n`` placeholders of ``ids`` (one per item, in order); InputError when there are
    not ``n``."""
    at = np.flatnonzero(np.asarray(ids) == placeholder)
    if at.size != n:
        raise InputError(
            f"the prompt holds {at.size} {what} placeholder(s) ({placeholder}, the {piece} token) but "
            f"{n} {items} were given; put one placeholder where each {item} goes, in order"
        )
    return at


def splice(ids: np.ndarray, at: Sequence[int], pieces: Sequence[Sequence[int]]) -> np.ndarray:
    """``ids`` with the token at each position of ``at`` replaced by the matching piece of ids."""
    out, start = [], 0
    for a, piece in zip(at, pieces, strict=True):
        out += [ids[start:a], piece]
        start = a + 1
    out.append(ids[start:])
    return np.concatenate([np.asarray(x, dtype=np.int64) for x in out])


def _spans(is_token: np.ndarray) -> list[tuple[int, int]]:
    blocks = vision_block_ids(is_token)
    return [(int(np.flatnonzero(blocks == b)[0]), int(np.count_nonzero(blocks == b)))
            for b in range(int(blocks.max()) + 1)] if blocks.size else []


def image_spans(ids: Sequence[int] | np.ndarray, tokens: MultimodalTokens) -> list[tuple[int, int]]:
    """(first position, length) of every maximal run of image tokens in ``ids``."""
    return _spans(np.asarray(ids) == tokens.image_token_id)


def video_spans(ids: Sequence[int] | np.ndarray, tokens: MultimodalTokens) -> list[tuple[int, int]]:
    """(first position, length) of every maximal run of video tokens in ``ids``: one a frame."""
    return _spans(np.asarray(ids) == tokens.video_token_id)


def audio_spans(ids: Sequence[int] | np.ndarray, tokens: MultimodalTokens) -> list[tuple[int, int]]:
    """(first position, length) of every maximal run of audio tokens in ``ids``."""
    return _spans(np.asarray(ids) == tokens.audio_token_id)


def multimodal_logits(model: Gemma4, ids: Sequence[int] | np.ndarray, soft_tokens: Sequence[np.ndarray],
                      tokens: MultimodalTokens, *, rows: str | Sequence[int] = "all", cache: KVCache | None = None,
                      trace: Trace | None = None, audio_soft_tokens: Sequence[np.ndarray] = (),
                      video_soft_tokens: Sequence[np.ndarray] = ()) -> np.ndarray:
    """Logits [R, V] of an image / audio / video prompt: ``multimodal_inputs`` then ``Gemma4.forward``. With a
    cache, each image, frame and clip must lie whole in the call that holds it (a block is never split across
    calls; the runs are checked per call); calls without placeholders can be plain ``Gemma4.forward``."""
    m = multimodal_inputs(model, ids, soft_tokens, tokens, audio_soft_tokens=audio_soft_tokens,
                          video_soft_tokens=video_soft_tokens)
    return model.forward(m.ids, rows=rows, cache=cache, embeddings=m.embeddings, vision_blocks=m.vision_blocks,
                         trace=trace)


__all__: Sequence[str] = [
    "MultimodalTokens", "MultimodalInputs", "parse_multimodal_tokens", "load_multimodal_tokens",
    "vision_block_ids", "run_lengths", "vision_token_mask", "llm_input_ids", "merge_soft_tokens", "check_image_runs",
    "check_audio_runs", "check_soft_tokens", "multimodal_inputs", "multimodal_logits", "expand_image_placeholders",
    "expand_audio_placeholders", "image_spans", "audio_spans", "video_spans", "placeholder_positions", "splice",
]
