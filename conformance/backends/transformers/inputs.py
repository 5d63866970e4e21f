"""How each request kind reaches transformers: the inputs of the transformers backend's forwards.

``RequestMapping`` is the part of ``TransformersBackend`` (``conformance.backends.transformers.backend``) that
turns a request's rows, embeddings, image and audio blocks into transformers' arguments and says what it
did (``executed`` notes). The request handling (validation, micro-batches, one cache per sequence id,
decode) is ``conformance.protocol.serving.CachedBackend``'s:

* ``full``: one forward, ``logits_to_keep=0`` (in transformers 5.24 an integer ``k`` keeps the last
  ``k`` rows and **0 keeps all of them**).
* ``last`` (plain, seq_id, embeddings): one forward through a fresh ``DynamicCache``, with the row
  chosen by ``logits_to_keep``: the integer ``1`` for the last row (what ``generate`` passes; it also
  lets transformers drop every other row before the KV-shared layers,
  ``Gemma4TextModel._maybe_slice_kv_shared_inputs``), a 1-D index tensor ``[last_pos]`` for an
  interior row (``modeling_utils.slice_logits_to_keep`` gathers those positions; transformers does
  not prune the KV-shared layers for a tensor). The state keeps all ``T`` tokens either way.
* ``prefill``: every piece, and with ``ubatch`` every micro-batch of a piece, is one forward that
  continues the same ``DynamicCache`` (positions and masks come from the cache length, as in
  ``generate``). Output rows go through ``logits_to_keep`` per forward: an integer ``k`` when they
  are the last ``k`` rows of the forward, else a 1-D index tensor. A forward with **no** output row
  passes an *empty* index tensor (``logits_to_keep=0`` would mean "all rows"): the forward runs every
  layer, writes the cache, and returns ``[1, 0, V]``.
* ``last/embeddings``: ``inputs_embeds`` replace ``embed_tokens(input_ids)``, whose output already
  carries the ``sqrt(H)`` scale, so the convention is ``"scaled"``. Gemma 4's per-layer embeddings
  are looked up by token id: the backend passes ``per_layer_inputs =
  model.model.get_per_layer_inputs(ids)`` (the token-identity part; transformers adds the
  projection of ``inputs_embeds`` itself). Without it transformers would try to recover the ids by
  comparing ``inputs_embeds`` bit-for-bit with its own scaled table, which the harness's float64
  embeddings do not match after rounding.
* image prompts (``request.images``; image-text checkpoints only, i.e. a ``vision_config``, which
  load as ``Gemma4ForConditionalGeneration``: the whole published model, by plain
  ``from_pretrained``): the ``last`` forward, or each prefill piece, goes to
  ``Gemma4ForConditionalGeneration.forward`` as ``inputs_embeds`` (E[id] * sqrt(H) at text rows, the
  soft tokens unscaled at image rows), ``per_layer_inputs = get_per_layer_inputs(ids)`` with
  ``pad_token_id`` at the image positions (what ``Gemma4Model.forward`` does with ``llm_input_ids``;
  transformers adds the context part from ``inputs_embeds``) and ``mm_token_type_ids`` (1 at image
  tokens) **from the sequence's start**, kept beside the cache: transformers' block overlay reads them
  by absolute key position, and a sliding cache layer's keys start at ``kv_offset`` > 0 (this is what
  ``prepare_inputs_for_generation`` passes a prefill chunk). ``Gemma4Model.forward`` then builds the
  masks itself: on ``use_bidirectional_attention == "vision"`` checkpoints
  ``create_masks_for_vision_model`` (sliding layers AND(window, OR(causal, same block)), full layers
  causal), else ``create_masks_for_generate``. Decode steps pass ids and no ``mm_token_type_ids``, as
  ``generate`` does after the first step. Rows are chosen by ``logits_to_keep`` as for text. Measured
  on the 60 image cases of the bundled sets e2b-vision-mini and 31b-vision-mini (CPU): all pass
  ``exact-f64`` with the float64 patches of tests/hf_reference.py (worst max_abs 2.9e-12) and ``fp32``
  in float32 eager (worst 2.4e-3).
* audio prompts (``request.audio``; audio-text checkpoints only, i.e. an ``audio_config``, which load as
  ``Gemma4ForConditionalGeneration`` like image-text ones): as for images, with ``pad_token_id`` at the
  audio positions of the per-layer inputs and ``mm_token_type_ids`` 3 at audio tokens, from the
  sequence's start (``get_block_sequence_ids_for_mask`` makes blocks of types 1 and 2 only, so audio
  stays causal on every layer). The soft tokens are transformers' own: the clips of the forward
  (``request.audio_inputs``) go as one batch, padded at the end with masked frames, through
  ``Gemma4Model.get_audio_features(input_features, input_features_mask)``, and
  ``pooler_output[attention_mask]`` (the valid tokens, clip by clip: exactly what
  ``Gemma4Model.forward`` scatters) replaces the audio rows of ``inputs_embeds``; each forward's
  ``executed`` notes say so (``audio_soft_tokens``) and give ``audio_rows_max_abs``, the largest
  difference from the rows the request carried. (``Gemma4Model.forward`` cannot merge audio into given
  ``inputs_embeds`` itself: it finds the audio positions by comparing ``inputs_embeds`` with the audio
  token's embedding.) transformers 5.24's audio tower runs only with eager attention, so with
  ``attn="sdpa"`` the text model takes sdpa and the audio tower eager (``executed
  ["audio_attn_implementation"]``), and it does not run in float64 (``Gemma4AudioAttention`` computes
  q/k/v in float32, then meets float64 parameters: "expected scalar type Float but found Double"), so a
  float64 backend does not claim ``audio_tower`` and takes the request's soft tokens as given (option
  ``audio_tower``). Measured on a two-clip prompt of e2b-audio-mini (11 and 7 soft tokens, one clip with
  masked padding frames; last rows, output-row and chunked prefill, decode): with the float64 patches of
  tests/hf_reference.py and tests/oracle/towers/test_audio_tower.py (tower on) worst 5.8e-12 against the oracle, the
  tower's soft tokens within 4.0e-14 of the oracle's; float32 as shipped worst 1.3e-3 (soft tokens
  5.9e-6), passing ``fp32``.
* ``multi``: one ``DynamicCache`` per sequence id, each sequence prefilled on its own; decode steps
  are interleaved across the sequences, as a server batches them.
* decode: one token per forward through the cache the prefill left, ``logits_to_keep=1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transformers

from ...protocol.serving import block_token_problem, padded_clips
from ...protocol.types import Request

__all__ = ["RequestMapping"]

VIDEO_TYPE = 2  # mm_token_type_ids of a video frame's tokens, as transformers' Gemma4Processor makes them


class RequestMapping:
    """The request -> transformers arguments half of ``TransformersBackend`` (a mixin): ``logits_to_keep``, the
    media blocks' ``mm_token_type_ids``, the soft tokens of transformers' own towers, ``inputs_embeds`` and the
    per-layer inputs, and the ``executed`` notes. It reads the backend's state: ``model``, ``text_model``,
    ``device``, ``torch_dtype``, ``vision``/``audio``/``unified`` and the tower options, ``ple``,
    ``pad_token_id``, ``conditional``, ``vision_masks``, the media token ids."""

    def _logits_to_keep(self, rows: list[int], T: int) -> tuple[int | torch.Tensor, int | list[int]]:
        """(the logits_to_keep argument, its JSON form) selecting ``rows`` of a T-token forward.

        The last k rows -> the integer k; anything else -> a 1-D LongTensor of the positions; no row
        -> an empty LongTensor (never 0, which transformers reads as "all rows").
        """
        if rows and rows == list(range(T - len(rows), T)):
            return len(rows), len(rows)
        return torch.tensor(rows, dtype=torch.long, device=self.device), list(rows)

    def _token_types(self, ids: list[int], images: Sequence[tuple[int, int]],
                     audio: Sequence[tuple[int, int]] = ()) -> list[int]:
        """``mm_token_type_ids`` of one forward's tokens (1 in the image blocks, 3 in the audio blocks, as
        the Gemma 4 processor makes them), checked: an image (audio) request needs a checkpoint with a
        vision (audio) tower, and every block holds only the image (audio) token."""
        types = [0] * len(ids)
        kind = "an audio-text" if self.audio else "an image-text" if self.vision else "a text-only"
        for what, spans, have, token, type_id in (("image", images, self.vision, self.image_token_id, 1),
                                                  ("audio", audio, self.audio, self.audio_token_id, 3)):
            if not spans:
                continue
            if not have:
                raise ValueError(f"{self.who}: {self._model_dir} has no {'vision' if what == 'image' else what}"
                                 f"_config ({kind} checkpoint); it cannot serve {what} prompts")
            frame = self.video_token_id if what == "image" else None
            for start, n in spans:
                if (why := block_token_problem(ids, start, n, what, token, frame)) is not None:
                    raise ValueError(f"{self.who}: {why}")
                types[start:start + n] = [VIDEO_TYPE if ids[start] == frame else type_id] * n
        return types

    def _stacked(self, inputs: Sequence, whose: str, why: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel values [n, R, C] in the model dtype, positions [n, R, 2]) of ``inputs`` (ImageInput each) as one
        batch on the device; ValueError when their shapes differ (``why`` says why they should not)."""
        shapes = {np.asarray(i.pixel_values).shape for i in inputs}
        if len(shapes) != 1:
            raise ValueError(f"{self.who}: {whose} pixel_values have different shapes {sorted(shapes)}; {why}")
        pv = np.stack([np.asarray(i.pixel_values, dtype=np.float64) for i in inputs])
        pos = np.stack([np.asarray(i.positions, dtype=np.int64) for i in inputs])
        return torch.from_numpy(pv).to(self.device, self.torch_dtype), torch.from_numpy(pos).to(self.device)

    def _frame_soft_tokens(self, frames: Sequence[tuple[int, int]], frame_inputs: Sequence) -> torch.Tensor:
        """The soft tokens of a forward's video frames, ``[sum of lengths, H]``, from transformers' own video
        path: the frames' patches and positions as one video through ``get_video_features``
        (``pixel_values_videos``, ``video_position_ids``, ``num_frames_per_video``); each frame must give as
        many soft tokens as its block has."""
        pv, pos = self._stacked(frame_inputs, "the video frames'", "a video's frames are resized to one size")
        out = self.model.model.get_video_features(pv, pos, num_frames_per_video=torch.tensor([len(frames)]),
                                                  return_dict=True)
        soft = torch.cat(list(out.pooler_output))
        if soft.shape[0] != sum(n for _, n in frames):
            raise ValueError(f"{self.who}: the video frames' blocks hold {sum(n for _, n in frames)} tokens but "
                             f"transformers' video features give {soft.shape[0]}")
        return soft

    def _audio_soft_tokens(self, audio: Sequence[tuple[int, int]], audio_inputs: Sequence) -> torch.Tensor:
        """The soft tokens of a forward's audio blocks, ``[sum of lengths, H]`` in the model dtype, from
        transformers' own audio tower: the clips as one batch (padded at the end to the longest clip with
        masked zero frames, as the feature extractor pads a batch) through
        ``Gemma4Model.get_audio_features``, then ``pooler_output[attention_mask]`` (the valid soft tokens,
        clip by clip: what ``Gemma4Model.forward`` scatters into the audio positions). Each clip must give
        as many soft tokens as its block has."""
        if len(audio_inputs) != len(audio):
            raise ValueError(f"{self.who}: {len(audio)} audio blocks but {len(audio_inputs)} audio_inputs")
        x, mask = padded_clips(audio_inputs, self.who)
        try:
            out = self.model.model.get_audio_features(torch.from_numpy(x).to(self.device, self.torch_dtype),
                                                      torch.from_numpy(mask).to(self.device), return_dict=True)
        except RuntimeError as exc:
            if self.torch_dtype == torch.float64:
                raise RuntimeError(f"{self.who}: transformers {transformers.__version__}'s audio tower does not run "
                                   f"in float64 ({exc}); use audio_tower='off' (the request's soft tokens) or "
                                   f"float32") from exc
            raise
        keep = out.attention_mask.to(torch.bool)
        counts = keep.sum(-1).tolist()
        for (start, n), c in zip(audio, counts, strict=True):
            if c != n:
                raise ValueError(f"{self.who}: the audio block ({start}, {n}) has {n} tokens but transformers' "
                                 f"audio tower gives {c} soft tokens for its clip")
        return out.pooler_output[keep]

    def _image_soft_tokens(self, images: Sequence[tuple[int, int]], image_inputs: Sequence) -> torch.Tensor:
        """Gemma 4 Unified: the soft tokens of a forward's image blocks, ``[sum of lengths, H]``, from
        transformers' own embedder: the images' padded patches and positions as one batch through
        ``Gemma4UnifiedModel.get_image_features`` (padding rows dropped per image); each image must give as
        many soft tokens as its block has."""
        pv, pos = self._stacked(image_inputs, "the images'", "Gemma 4 Unified's processor pads every image to "
                                                            "max_soft_tokens rows")
        out = self.model.model.get_image_features(pv, pos, return_dict=True)
        parts = list(out.pooler_output)
        for (start, n), part in zip(images, parts, strict=True):
            if part.shape[0] != n:
                raise ValueError(f"{self.who}: the image block ({start}, {n}) has {n} tokens but transformers' vision "
                                 f"embedder gives {part.shape[0]} soft tokens for its image")
        return torch.cat(parts)

    def _generate_media(self, request) -> dict[str, torch.Tensor]:
        """What ``generate`` takes for an MTP request after media, its own embedder and audio tower computing the
        soft tokens (image_tower and audio_tower on): ``mm_token_type_ids`` of the prompt, the images' padded
        patches and positions, the clips' frames and masks."""
        ids = [int(t) for t in request.tokens]
        kw = {"mm_token_type_ids": torch.tensor([self._token_types(ids, request.images, request.audio)],
                                                dtype=torch.long, device=self.device)}
        if request.images:
            kw["pixel_values"], kw["image_position_ids"] = self._stacked(
                request.image_inputs, "the images'", "Gemma 4 Unified's processor pads each to max_soft_tokens rows")
        if request.audio:
            x, mask = padded_clips(request.audio_inputs, self.who)
            kw["input_features"] = torch.from_numpy(x).to(self.device, self.torch_dtype)
            kw["input_features_mask"] = torch.from_numpy(mask).to(self.device)
        return kw

    def _embeddings_kwargs(self, ids: Any, embeddings: np.ndarray, images: Sequence[tuple[int, int]],
                           audio: Sequence[tuple[int, int]], audio_inputs: Sequence, image_inputs: Sequence,
                           types: list[int], token_types: list[int], notes: dict[str, Any]) -> dict[str, Any]:
        """The model's inputs of an embeddings forward: ``inputs_embeds`` (the image and audio blocks' rows from
        transformers' own towers when they are on), the per-layer inputs' token part (the pad row at media
        positions) and ``mm_token_type_ids``; what was done goes into ``notes``."""
        kwargs: dict[str, Any] = {}
        inputs_embeds = torch.tensor(np.asarray(embeddings)[None]).to(self.device, self.torch_dtype)
        if images and self.image_tower:
            if len(image_inputs) != len(images):
                raise ValueError(f"{self.who}: {len(images)} image blocks but {len(image_inputs)} image_inputs")
            frame = [types[start] == VIDEO_TYPE for start, _ in images]  # video frames, the rest images
            for is_frame, soft_of, note in ((False, self._image_soft_tokens, "get_image_features"),
                                            (True, self._frame_soft_tokens, "get_video_features")):
                spans = [b for b, f in zip(images, frame, strict=True) if f == is_frame]
                if not spans:
                    continue
                at = [start + i for start, n in spans for i in range(n)]
                soft = soft_of(spans, [x for x, f in zip(image_inputs, frame, strict=True) if f == is_frame])
                key = "video" if is_frame else "image"
                notes[f"{key}_soft_tokens"] = f"transformers vision tower or embedder ({note})"
                notes[f"{key}_rows_max_abs"] = float(np.abs(soft.double().cpu().numpy()
                                                            - np.asarray(embeddings, dtype=np.float64)[at]).max())
                inputs_embeds[0, at] = soft.to(inputs_embeds.dtype)
        if audio:
            at = [start + i for start, n in audio for i in range(n)]
            if self.audio_tower:
                soft = self._audio_soft_tokens(audio, audio_inputs)
                given = np.asarray(embeddings, dtype=np.float64)[at]
                notes["audio_soft_tokens"] = ("transformers audio tower (Gemma4Model.get_audio_features, "
                                              "pooler_output[attention_mask])")
                notes["audio_rows_max_abs"] = float(np.abs(soft.double().cpu().numpy() - given).max())
                inputs_embeds[0, at] = soft.to(inputs_embeds.dtype)  # Gemma4Model.forward's masked_scatter
            else:
                notes["audio_soft_tokens"] = "given (the request's embeddings)"
        kwargs["inputs_embeds"] = inputs_embeds
        if self.ple:
            # the token-identity part of the per-layer embeddings, looked up by id; at image and
            # audio positions the pad row (Gemma4Model.forward's llm_input_ids)
            ple_ids = ids
            if any(types):
                is_media = torch.tensor([types], dtype=torch.bool, device=self.device)
                ple_ids = torch.where(is_media, self.pad_token_id, ids)
            kwargs["per_layer_inputs"] = self.text_model.get_per_layer_inputs(ple_ids, None)
        if self.conditional and any(token_types):
            kwargs["mm_token_type_ids"] = torch.tensor([token_types], dtype=torch.long, device=self.device)
            notes["mm_token_type_ids"] = len(token_types)
            notes["mask_function"] = ("create_masks_for_generate with block_sequence_ids (Gemma4UnifiedModel"
                                      ".forward: the overlay on every layer, after the window)"
                                      if self.unified and self.vision_masks else
                                      "create_masks_for_vision_model" if self.vision_masks
                                      else "create_masks_for_generate")
        return kwargs

    def _notes(self, request: Request) -> dict[str, Any]:
        """full: the rows computed; last/embeddings, image and audio prompts: how the embeddings (and
        audio soft tokens), per-layer inputs and masks went in; multi: the caches."""
        if request.kind == "full":
            return {"rows": len(request.tokens)}
        ple = self.ple
        out: dict[str, Any] = {}
        if request.audio:
            out = {"audio": [list(b) for b in request.audio],
                   "audio_tower": (f"transformers {transformers.__version__} Gemma4Model.get_audio_features on "
                                   "request.audio_inputs (the clips of each forward as one batch), "
                                   "pooler_output[attention_mask] scattered into the audio rows of inputs_embeds"
                                   if self.audio_tower else "none: the request's soft tokens are used as given"),
                   "audio_mask": ("mm_token_type_ids 3 at audio tokens (from the sequence's start): never a "
                                  "vision block, causal on every layer"),
                   "inputs_embeds": "scaled (E[ids] * sqrt(H) at text rows, soft tokens unscaled at audio and "
                                    "image rows), cast to the model dtype",
                   "per_layer_inputs": (f"get_per_layer_inputs(token ids, pad_token_id {self.pad_token_id} at "
                                        f"audio and image positions)" if ple else None)}
        if request.images:
            return {**out, "images": [list(b) for b in request.images],
                    "inputs_embeds": "scaled (E[ids] * sqrt(H) at text rows, soft tokens unscaled at image rows), "
                                     "cast to the model dtype",
                    "per_layer_inputs": (f"get_per_layer_inputs(token ids, pad_token_id {self.pad_token_id} at "
                                         f"image positions)" if ple else None),
                    "image_mask": ("mm_token_type_ids (1 at image tokens, from the sequence's start; decode steps "
                                   "none) -> Gemma4UnifiedModel.forward's create_masks_for_generate with block ids: "
                                   "OR(causal or window, same block) on every layer (rule all-unclamped)"
                                   if self.unified and self.vision_masks else
                                   "mm_token_type_ids (1 at image tokens, from the sequence's start; decode steps "
                                   "none) -> create_masks_for_vision_model: sliding AND(window, OR(causal, same "
                                   "block)), full causal" if self.vision_masks else
                                   "causal (use_bidirectional_attention is not 'vision')"),
                    **({k: out[k] for k in ("inputs_embeds", "per_layer_inputs")} if out else {})}
        if out:
            return out
        if request.kind == "last" and request.entry == "embeddings":
            return {"inputs_embeds": "scaled (E[ids] * sqrt(H)), cast to the model dtype",
                    "per_layer_inputs": "get_per_layer_inputs(token ids)" if ple else None}
        if request.kind == "multi":
            return {"caches": "one DynamicCache per seq_id"}
        return {}
