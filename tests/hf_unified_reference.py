"""Hugging Face transformers' Gemma 4 Unified (``Gemma4UnifiedForConditionalGeneration``) as an independent
float64 reference, the counterpart of ``hf_reference.py`` for the 12B encoder-free family.

``modeling_gemma4_unified.py`` has its own copies of the float32 spots of ``modeling_gemma4.py``:

* ``Gemma4UnifiedRMSNorm.forward`` upcasts with ``.float()`` (a downcast for float64 input); it also
  serves the weightless RMSNorm of both multimodal embedders.          -> patched
* ``eager_attention_forward`` runs ``softmax(..., dtype=torch.float32)``. -> patched
* ``Gemma4UnifiedTextRotaryEmbedding.forward`` computes the angles in float32, from float32
  ``inv_freq`` buffers.                                  -> patched, buffers recomputed in float64
* ``Gemma4UnifiedTextScaledWordEmbedding.embed_scale`` is a float32-rounded buffer. -> recomputed
  (``hf_reference.recompute_float64_buffers`` handles both families' buffers)

Checked and left alone: the vision embedder's ``nn.LayerNorm``s, dense layers and position table run in
the model dtype; ``get_image_features`` / ``get_audio_features`` only gather and mask; the masks of
``masking_utils`` are built in the embeddings' dtype. The replacements are hf_reference.py's copies of the 5.24.0 code
with only
the dtype changed (the sha256 of each original's source is checked before patching: the Unified module's
three functions are verbatim copies of modeling_gemma4's).

The two vision-mask rules of transformers 5.24 (unified spec A9) are both reachable: ``hf_logits(...,
rule="all-unclamped")`` is the default ``forward`` (rule A), ``rule="sliding-clamped"`` forwards the mask
dict of the static-cache ``create_masks_for_generate`` (rule B).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import transformers.models.gemma4_unified.modeling_gemma4_unified as _mu
from hf_reference import (
    eager_attention_forward_f64,
    patched,
    recompute_float64_buffers,
    rmsnorm_forward_f64,
    rotary_forward_f64,
)
from transformers import DynamicCache, Gemma4UnifiedForConditionalGeneration

_F64 = torch.float64
_ORIG_RMSNORM = _mu.Gemma4UnifiedRMSNorm.forward
_ORIG_ROTARY = _mu.Gemma4UnifiedTextRotaryEmbedding.forward
_ORIG_EAGER = _mu.eager_attention_forward


# (owner, attribute, original, replacement, sha256 of the original's source in transformers 5.24.0). The
# Unified module carries verbatim copies of modeling_gemma4's three functions (the same sha256), so
# hf_reference.py's float64 copies serve it unchanged: they read only the module's own attributes
# (``_norm``, ``with_scale``, ``weight``; the inv_freq buffers; ``head_dim``, ``num_key_value_groups``).
_PATCHES = [
    (_mu.Gemma4UnifiedRMSNorm, "forward", _ORIG_RMSNORM, rmsnorm_forward_f64,
     "7db79da21ac2d7247b3bfaa8134eec6e49ae23d729d12a495d1010127911c4be"),
    (_mu.Gemma4UnifiedTextRotaryEmbedding, "forward", _ORIG_ROTARY, rotary_forward_f64,
     "06ec09d340f9e670650a8428863e05012bf243c46b7c1dc301a5939f2fdd8ee5"),
    (_mu, "eager_attention_forward", _ORIG_EAGER, eager_attention_forward_f64,
     "587d5b52cc6f75078b7bb7a4fa056f5c1ff74e2f5c22d1a6ad161f3282d1671f"),
]


def source_sha256(fn) -> str:
    return hashlib.sha256(inspect.getsource(inspect.unwrap(fn)).encode()).hexdigest()


@contextlib.contextmanager
def unified_float64_exact() -> Iterator[None]:
    """Within the block, Gemma 4 Unified computes float64 inputs entirely in float64 (non-float64 inputs
    go to the originals)."""
    changed = [f"{getattr(o, '__name__', o)}.{a}" for o, a, orig, _, sha in _PATCHES if source_sha256(orig) != sha]
    if changed:
        raise RuntimeError("tests/hf_unified_reference.py copies transformers 5.24.0 code, but the source of "
                           f"{', '.join(changed)} changed; re-read modeling_gemma4_unified.py")
    with patched(_PATCHES):
        yield


def load_hf_unified(model_dir, dtype=torch.float64) -> Gemma4UnifiedForConditionalGeneration:
    """The checkpoint as an eval-mode float64 eager ``Gemma4UnifiedForConditionalGeneration``; every
    weight must come from the checkpoint (lm_head is tied)."""
    model, info = Gemma4UnifiedForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="eager", output_loading_info=True)
    missing = set(info["missing_keys"]) - {"lm_head.weight"}
    if missing or info["mismatched_keys"] or info["unexpected_keys"]:
        raise RuntimeError(f"transformers did not load every weight of {model_dir}: missing {sorted(missing)}, "
                           f"mismatched {info['mismatched_keys']}, unexpected {info['unexpected_keys']}")
    model.eval()
    return recompute_float64_buffers(model) if dtype == _F64 else model


def token_types(ids: Sequence[int], config) -> torch.Tensor:
    """mm_token_type_ids [1, T]: 1 image, 2 video, 3 audio, 0 elsewhere (the processor's)."""
    ids = torch.tensor([list(ids)])
    types = torch.zeros_like(ids)
    types[ids == config.image_token_id] = 1
    types[ids == config.video_token_id] = 2
    types[ids == config.audio_token_id] = 3
    return types


def media_kwargs(images=(), clips=(), videos=()) -> dict:
    """pixel_values [n, R, C] + image_position_ids [n, R, 2] (images padded alike), input_features
    [m, F, A] + input_features_mask [m, F] (clips padded with invalid frames), and pixel_values_videos
    [frames, R, C] + video_position_ids [frames, R, 2] + num_frames_per_video (``videos``: (pixel_values
    [F, R, C], positions [F, R, 2]) per video) for forward."""
    kw = {}
    if videos:
        kw["pixel_values_videos"] = torch.tensor(np.concatenate([np.asarray(pv, dtype=np.float64) for pv, _ in videos]))
        kw["video_position_ids"] = torch.tensor(np.concatenate([np.asarray(pos, dtype=np.int64) for _, pos in videos]))
        kw["num_frames_per_video"] = torch.tensor([len(pv) for pv, _ in videos])
    if images:
        kw["pixel_values"] = torch.tensor(np.stack([np.asarray(pv, dtype=np.float64) for pv, _ in images]))
        kw["image_position_ids"] = torch.tensor(np.stack([np.asarray(pos, dtype=np.int64) for _, pos in images]))
    if clips:
        F = max(len(c) for c in clips)
        feats = np.zeros((len(clips), F, clips[0].shape[1]))
        mask = np.zeros((len(clips), F), dtype=bool)
        for j, c in enumerate(clips):
            feats[j, :len(c)] = c
            mask[j, :len(c)] = True
        kw["input_features"] = torch.tensor(feats)
        kw["input_features_mask"] = torch.tensor(mask)
    return kw


def hf_logits(model, ids: Sequence[int], *, images=(), clips=(), rule: str = "all-unclamped",
              types: bool = True, exact: bool = True, videos=()) -> np.ndarray:
    """Logits [T, V] (float64) of one prompt. ``images``: (pixel_values [R, C], positions [R, 2]) per
    image, padded as the processor pads; ``clips``: frames [F, A] per clip. ``rule``: "all-unclamped"
    (transformers' default forward, rule A) or "sliding-clamped" (the static-cache mask dict, rule B);
    ``types=False`` passes no mm_token_type_ids (causal image tokens)."""
    tt = token_types(ids, model.config) if types else None
    kwargs = media_kwargs(images, clips, videos)
    input_ids = torch.tensor([list(ids)])
    if rule == "sliding-clamped":
        embeds = torch.zeros((1, len(ids), model.config.get_text_config().hidden_size), dtype=model.dtype)
        kwargs["attention_mask"] = model.create_masks_for_generate(
            model.config, embeds, None, None, torch.arange(len(ids))[None], mm_token_type_ids=tt)
    elif rule != "all-unclamped":
        raise ValueError(rule)
    ctx = unified_float64_exact() if exact else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        out = model(input_ids=input_ids, mm_token_type_ids=tt, use_cache=False, **kwargs)
    return out.logits[0].to(_F64).numpy()


def hf_logits_incremental(model, ids: Sequence[int], cuts: Sequence[int], *, images=(), clips=(),
                          exact: bool = True) -> np.ndarray:
    """Logits [T, V] of the prompt fed in pieces ``ids[c_i:c_{i+1}]`` through one DynamicCache (the
    default forward, rule A); the media go with the piece that holds them (one piece must hold them all).
    Every piece gets the whole prompt's mm_token_type_ids: transformers reads block ids by absolute
    position (its ``prepare_inputs_for_generation`` does the same on prefill chunks)."""
    cache = DynamicCache(config=model.config.get_text_config())
    bounds = [0, *cuts, len(ids)]
    rows = []
    ctx = unified_float64_exact() if exact else contextlib.nullcontext()
    tt_all = token_types(ids, model.config)
    with torch.no_grad(), ctx:
        for a, b in itertools.pairwise(bounds):
            kw = media_kwargs(images, clips) if (tt_all[:, a:b] > 0).any() else {}
            out = model(input_ids=torch.tensor([list(ids[a:b])]), mm_token_type_ids=tt_all, cache=cache,
                        use_cache=True, position_ids=torch.arange(a, b)[None], **kw)
            rows.append(out.logits[0].to(_F64).numpy())
    return np.concatenate(rows)


def hf_image_features(model, pixel_values, positions) -> np.ndarray:
    """The vision embedder's soft tokens [N_real, H] of one image (padding rows dropped)."""
    with torch.no_grad(), unified_float64_exact():
        out = model.model.get_image_features(torch.tensor(np.asarray(pixel_values, dtype=np.float64))[None],
                                             torch.tensor(np.asarray(positions, dtype=np.int64))[None],
                                             return_dict=True)
    return out.pooler_output[0].to(_F64).numpy()


def hf_audio_features(model, frames) -> np.ndarray:
    with torch.no_grad(), unified_float64_exact():
        f = torch.tensor(np.asarray(frames, dtype=np.float64))[None]
        out = model.model.get_audio_features(f, torch.ones(f.shape[:2], dtype=torch.bool), return_dict=True)
    return out.pooler_output[0].to(_F64).numpy()
