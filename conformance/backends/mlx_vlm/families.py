"""The mlx-vlm models this backend drives, one :class:`Family` per config.json ``model_type``.

mlx-vlm picks its model class by ``model_type`` (``mlx_vlm.utils.get_model_and_args``), and so does the
backend: :data:`FAMILIES` maps each served model type to how that mlx-vlm model is called.

* ``gemma4_text`` (``Gemma4ForCausalLM`` checkpoints): ``mlx_vlm.models.gemma4_text.Model``, text only
  (a port of mlx-lm's ``gemma4_text``). A forward is ``model.language_model(ids, cache=...,
  input_embeddings=..., logits_to_keep=...)``; ``input_embeddings`` are raw ``E[ids]`` (the model
  multiplies by sqrt(H)) and the per-layer inputs are looked up by the ids.
* ``gemma4`` (``Gemma4ForConditionalGeneration``): ``mlx_vlm.models.gemma4.Model`` (text model
  ``gemma4.language.LanguageModel``, vision tower, audio tower), driven as ``mlx_vlm.generate``'s
  ``generate_step`` drives it: ``model.get_input_embeddings(input_ids, ...)`` gives the merged
  ``inputs_embeds`` and the ``per_layer_inputs`` (token id 0 at image, audio and video token
  positions), then ``model.language_model(ids, inputs_embeds=..., per_layer_inputs=..., cache=...,
  mm_token_type_ids=..., logits_to_keep=...)``; decode steps are ``model.language_model(ids, cache=...,
  logits_to_keep=1)``, as generate's ``_step``. Given pixel values (patches and positions), or audio
  features, ``get_input_embeddings`` runs mlx-vlm's own vision tower (``VisionModel`` + ``embed_vision``)
  or audio tower (``AudioEncoder`` + ``embed_audio``) and scatters its output into the image or audio
  token positions.

* ``gemma4_unified`` (``Gemma4UnifiedForConditionalGeneration``, Gemma 4 Unified 12B):
  ``mlx_vlm.models.gemma4_unified.Model``, whose text model is the same ``gemma4.language.LanguageModel``
  and is called the same way; ``get_input_embeddings`` takes padded model patches (``pixel_values``
  ``[n, R, 3 M^2]``, ``image_position_ids`` ``[n, R, 2]``, (-1, -1) on padding rows) for its
  encoder-free ``vision_embedder``, and raw waveform frames (``input_features`` ``[n, F, 640]``,
  ``input_features_mask`` True at valid frames) for ``embed_audio``.

A model type that is not listed gets a one-line error at open (:func:`family_for`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from ...protocol.types import BackendError
from ..mlx_common import GeometryCheck, text_geometry

__all__ = ["FAMILIES", "Family", "Gemma4", "Gemma4Text", "Gemma4Unified", "family_for", "geometry_problems"]

# model types mlx-vlm has for Gemma 4 that this backend does not drive (yet), and why
NOT_SERVED = {
    "gemma4_unified_text": ("mlx-vlm 0.7.10 has no model for a Gemma4UnifiedForCausalLM checkpoint (its "
                            "gemma4_unified model reads the conditional layout only)"),
}


class Family:
    """How one mlx-vlm model class is called (the subclasses say)."""

    model_type = ""
    media = False  # serves image and audio prompts
    mlx_module = ""
    towers: tuple[str, ...] = ()  # the attributes of mlx-vlm's model that compute soft tokens
    tower_modules: dict[str, str] = {}  # modality -> what computes its soft tokens (for executed records)

    # -- structure ------------------------------------------------------------------------------

    @staticmethod
    def text_model(model):
        """The decoder (``Gemma4TextModel``) inside mlx-vlm's model."""
        return model.language_model.model

    def owns_kv(self, attn) -> bool:
        raise NotImplementedError

    def tied_head(self, model) -> bool:
        raise NotImplementedError

    def extra_checks(self, model, cfg, check) -> None:
        """Family-specific geometry checks (``check(what, got, want)``)."""

    def image_kwargs(self, pixels: list[np.ndarray], positions: list[np.ndarray]) -> dict[str, Any]:
        """The ``get_input_embeddings`` keywords of a forward's images (patches [N, C], positions [N, 2])."""
        raise NotImplementedError

    # -- calls ----------------------------------------------------------------------------------

    def prompt(self, model, ids: mx.array, cache: list, embeddings: np.ndarray | None, hidden_size: int,
               logits_to_keep: int | None, token_types: Sequence[int] | None = None,
               tower_inputs: dict[str, Any] | None = None) -> tuple[mx.array, dict[str, Any]]:
        """One prompt forward: ``(logits [rows kept, V], notes)``. ``embeddings``: scaled input embeddings
        ``[T, H]`` (float64), or None for the token lookup. ``tower_inputs``: {"image" | "audio": the
        ``get_input_embeddings`` keywords of that modality}: mlx-vlm's own tower computes those rows."""
        raise NotImplementedError

    def decode(self, model, ids: mx.array, cache: list) -> mx.array:
        """One decode step (one token): logits ``[1, V]``."""
        raise NotImplementedError


class Gemma4Text(Family):
    model_type = "gemma4_text"
    mlx_module = "mlx_vlm.models.gemma4_text"

    def owns_kv(self, attn) -> bool:
        return bool(attn.has_kv)

    def tied_head(self, model) -> bool:
        return bool(model.language_model.tie_word_embeddings)

    def prompt(self, model, ids, cache, embeddings, hidden_size, logits_to_keep, token_types=None,
               tower_inputs=None):
        kwargs: dict[str, Any] = {"logits_to_keep": logits_to_keep}
        notes: dict[str, Any] = {}
        if embeddings is not None:
            # gemma4_text's input_embeddings are raw E[ids]: it multiplies by sqrt(H) itself
            raw = np.asarray(embeddings, dtype=np.float64) / math.sqrt(hidden_size)
            kwargs["input_embeddings"] = mx.array(raw.astype(np.float32)[None])
            notes["input_embeddings"] = "scaled / sqrt(H) (raw), as Gemma4TextModel multiplies by sqrt(H)"
        return model.language_model(ids, cache=cache, **kwargs).logits[0], notes

    def decode(self, model, ids, cache):
        return model.language_model(ids, cache=cache, logits_to_keep=1).logits[0]


class Gemma4(Family):
    model_type = "gemma4"
    mlx_module = "mlx_vlm.models.gemma4"
    media = True
    towers = ("vision_tower", "audio_tower")
    tower_modules = {"image": "VisionModel (vision_tower) + "
                              "embed_vision", "audio": "AudioEncoder (audio_tower) + embed_audio"}

    def image_kwargs(self, pixels, positions):
        """One array per image (``VisionModel`` encodes a list image by image: sizes differ)."""
        return {"pixel_values": [mx.array(p.astype(np.float32)) for p in pixels],
                "image_position_ids": [mx.array(q.astype(np.int32)) for q in positions]}

    def owns_kv(self, attn) -> bool:
        return not attn.kv_shared_only

    def tied_head(self, model) -> bool:
        return True  # gemma4.language.LanguageModel has no lm_head: logits_from_hidden is embed_tokens.as_linear

    def extra_checks(self, model, cfg, check) -> None:
        check("use_bidirectional_attention", self.text_model(model).config.use_bidirectional_attention,
              cfg.use_bidirectional_attention)

    def prompt(self, model, ids, cache, embeddings, hidden_size, logits_to_keep, token_types=None,
               tower_inputs=None):
        tower_inputs = tower_inputs or {}
        merged = model.get_input_embeddings(input_ids=ids, **{k: v for kw in tower_inputs.values()
                                                              for k, v in kw.items()})
        h = merged.inputs_embeds
        notes: dict[str, Any] = {}
        if embeddings is not None:
            given = mx.array(np.asarray(embeddings, dtype=np.float32)[None]).astype(h.dtype)
            for what in tower_inputs:  # these rows from mlx-vlm's tower, every other row as given
                at = mx.expand_dims(ids == getattr(model.config, f"{what}_token_id"), -1)
                notes[f"{what}_rows_max_abs"] = float(mx.max(mx.abs(mx.where(at, h - given, 0.0))).item())
                given = mx.where(at, h, given)
            h = given
        kwargs: dict[str, Any] = {"logits_to_keep": logits_to_keep}
        if token_types is not None and any(token_types):
            kwargs["mm_token_type_ids"] = mx.array([list(token_types)], dtype=mx.int32)
            notes["mm_token_type_ids"] = len(token_types)
        out = model.language_model(ids, inputs_embeds=h, per_layer_inputs=merged.per_layer_inputs, cache=cache,
                                   **kwargs)
        return out.logits[0], notes

    def decode(self, model, ids, cache):
        return model.language_model(ids, cache=cache, logits_to_keep=1).logits[0]


class Gemma4Unified(Gemma4):
    """``mlx_vlm.models.gemma4_unified.Model``: the text model is ``gemma4.language.LanguageModel`` (called
    as for ``gemma4``); no towers but the encoder-free ``vision_embedder`` (+ ``embed_vision``) on padded
    model patches and ``embed_audio`` on raw waveform frames, both inside ``get_input_embeddings``."""

    model_type = "gemma4_unified"
    mlx_module = "mlx_vlm.models.gemma4_unified"
    towers = ("vision_embedder", "embed_audio")
    tower_modules = {"image": "VisionEmbedder (vision_embedder) + embed_vision",
                     "audio": "embed_audio on the raw frames"}

    def image_kwargs(self, pixels, positions):
        """One batch ``[n, R, C]`` / ``[n, R, 2]``, as the Unified processor stacks its padded patches
        (``get_image_features`` drops the (-1, -1) rows)."""
        if len({p.shape for p in pixels}) != 1:
            raise ValueError(f"mlx-vlm backend: the images' padded patches differ in shape "
                             f"{sorted({p.shape for p in pixels})}; the Unified processor pads every image alike")
        return {"pixel_values": mx.array(np.stack(pixels).astype(np.float32)),
                "image_position_ids": mx.array(np.stack(positions).astype(np.int32))}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (Gemma4Text(), Gemma4(), Gemma4Unified())}


def family_for(raw: dict, where: str) -> Family:
    """The family of a parsed config.json (its top-level ``model_type``, as mlx-vlm dispatches), or a
    one-line ``BackendError``."""
    model_type = raw.get("model_type")
    served = ", ".join(sorted(FAMILIES))
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in NOT_SERVED:
        raise BackendError(f"mlx-vlm backend: {where}: model_type {model_type!r}: {NOT_SERVED[model_type]}")
    raise BackendError(f"mlx-vlm backend: {where}: model_type {model_type!r} is not a Gemma 4 model this backend "
                       f"serves (it serves mlx-vlm's {served})")


# -- geometry ---------------------------------------------------------------------------------


def geometry_problems(family: Family, model, cfg) -> list[str]:
    """How the built mlx-vlm model differs from the model refimpl derives from config.json (empty: none)."""
    check = GeometryCheck("mlx-vlm")
    text_geometry(check, family.text_model(model), cfg, softcap=model.language_model.final_logit_softcapping,
                  tied=family.tied_head(model), owns_kv=family.owns_kv)
    family.extra_checks(model, cfg, check)
    return check.problems
