"""mlx-vlm (Apple's MLX, vision and audio models) as a conformance backend: ``conformance check --backend mlx-vlm``.

The checkpoint is loaded with mlx-vlm's own loader (``mlx_vlm.utils.load_model``: its ``gemma4`` model for
``Gemma4ForConditionalGeneration`` checkpoints, with the vision and audio towers the config has, its
``gemma4_text`` model for ``Gemma4ForCausalLM`` ones, its ``gemma4_unified`` model for Gemma 4 Unified's
``Gemma4UnifiedForConditionalGeneration``, with its encoder-free vision and audio embedders; its
``sanitize()``), and every request is served
through mlx-vlm's own prompt caches (``mlx_vlm.models.cache.make_prompt_cache(model.language_model)``:
``KVCache`` for full layers, ``RotatingKVCache(max_size=sliding_window)`` for sliding ones), the way
``mlx_vlm.generate``'s ``generate_step`` drives them: every prompt forward with ``logits_to_keep`` (which
mlx-vlm applies before the first KV-shared layer), decode one token per call with ``logits_to_keep=1``.
How each model type is called is in ``families.py`` (one ``Family`` per config.json ``model_type``); the
request handling (validation, micro-batches, one prompt cache per sequence id, interleaved decode) is
``conformance.protocol.serving.CachedBackend``'s.

* **Image prompts** (``gemma4`` and ``gemma4_unified`` checkpoints with a ``vision_config``): the
  request's merged embeddings
  (``E[ids] * sqrt(H)`` at text rows, the soft tokens unscaled at image rows: the ``inputs_embeds``
  that ``Model.get_input_embeddings`` builds from pixels) go in as ``inputs_embeds``; with
  ``image_tower`` on (the default), each forward's images (``request.image_inputs``: patches and their
  (x, y) positions, as the processor gives them) go into ``get_input_embeddings(input_ids,
  pixel_values=..., image_position_ids=...)``, so mlx-vlm's own vision tower (Unified: its
  ``vision_embedder`` on the padded model patches) computes the image rows (``executed``:
  ``image_rows_max_abs`` against the rows the request carried). The per-layer inputs
  are ``get_input_embeddings``' own (token id 0 at image positions, the context part projected from the
  embeddings); ``mm_token_type_ids`` (the processor's: 1 at image tokens, 3 at audio tokens) of the
  whole sequence so far go to ``language_model``, which builds the vision block masks itself on
  ``use_bidirectional_attention == "vision"`` checkpoints.
* **Audio prompts** (checkpoints with an ``audio_config``): as images; with ``audio_tower`` on (the
  default), each forward's clips (``request.audio_inputs``: log-mel features, or Unified's raw
  640-sample frames, with frame masks) go as one padded batch, as mlx-vlm's feature extractors pad
  them, into ``get_input_embeddings(input_ids, input_features=..., input_features_mask=...)``, so
  mlx-vlm's own audio tower (Unified: ``embed_audio``) computes the audio rows (``executed``:
  ``audio_rows_max_abs``).
* **Text** (every model type): token ids as ids; the ``embeddings`` entry point takes the scaled
  convention (``language_model(inputs_embeds=...)``; for ``gemma4_text``, whose ``input_embeddings`` are
  raw, the backend divides by sqrt(H) in float64 first).
* **Config keys.** mlx-vlm's config dataclasses read the legacy keys and have defaults of their own;
  every key they read is derived with ``refimpl.config`` (and ``refimpl.unified`` for Unified's
  embedders) and, where config.json lacks it (or says ``"vision_config": null``, which mlx-vlm's loader
  cannot build), mlx-vlm reads a patched config.json
  in a temporary view of the checkpoint (``config.py``). The built model is then checked layer by
  layer against refimpl's derivation: a checkpoint mlx-vlm cannot represent is a ``BackendError``.
* **dtype.** float32 only (profile ``fp32``): weights are cast to float32 as they load.
* **Quantised weights.** An MLX quantised directory (``mlx_vlm.convert -q``: a ``quantization`` block,
  packed weights with scales and biases) loads as it is, as ``QuantizedLinear`` / ``QuantizedEmbedding``
  layers (``weight_formats`` ``mlx-affine``): graded against the oracle of those same weights (a set generated
  from that directory), at ``fp32``. Option ``quantize`` (``"<bits>:<group size>"`` or a mixed recipe,
  ``quantise.py``) quantises an unquantised checkpoint at open as ``mlx_vlm.convert -q`` would, to grade the
  quantised engine against the unquantised oracle (default profile ``q4`` up to 4 bits, else ``q8``).
* **MTP** (mode ``generate``, capability ``mtp_generate``): mlx-vlm's own assisted decoding loop with the
  assistant at ``request.drafter``, loaded by mlx-vlm's drafter loader (``mtp.py``, which also says how far
  mlx-vlm follows the convention it claims, ``rotating/P-1``; option ``mtp_convention`` claims another one);
  the prompt's last row from a forward of its own. On a ``gemma4_text`` target mlx-vlm has no MTP (an error).

Known divergences are listed, with their reasons, in
``conformance/backends/mlx_vlm/expectations/mlx-vlm-float32.json``.

    conformance check --backend mlx-vlm [--backend-option image_tower=off] [--backend-option audio_tower=off]
                                        [--backend-option mtp_convention=target-cache/P]
                                        [--backend-option quantize=4:64]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx  # the registry turns a missing mlx / mlx_vlm into an install hint (the 'mlx' extra)
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_vlm.models.cache import make_prompt_cache
from mlx_vlm.utils import load_model

from refimpl.errors import check_choice
from refimpl.mtp import CONVENTIONS

from ...check.profiles import PROFILES
from ...protocol.serving import CachedBackend, block_token_problem, padded_clips
from ...protocol.types import BackendError, Capabilities, Request, Response
from ..mlx_common import read_configs, versions
from .config import checkpoint_view, config_patch, remove_view
from .families import Family, family_for, geometry_problems
from .mtp import CONVENTION as MTP_CONVENTION
from .mtp import assisted_generate, load_assistant
from .quantise import quantize_option, quantized

__all__ = ["MlxVlmBackend", "DTYPES", "TOWER_OPTIONS", "EXPECTATIONS_DIR"]

DTYPES = ("float32",)
TOWER_OPTIONS = ("on", "off")
EXPECTATIONS_DIR = Path(__file__).resolve().parent / "expectations"
IMAGE_TYPE, VIDEO_TYPE, AUDIO_TYPE = 1, 2, 3  # mm_token_type_ids, as mlx-vlm's Gemma4Processor makes them


def _versions() -> dict[str, str]:
    return versions("mlx", "mlx-vlm")



class SequenceState:
    """One sequence: its mlx-vlm prompt cache and the ``mm_token_type_ids`` of every token it holds."""

    def __init__(self, cache: list):
        self.cache = cache
        self.token_types: list[int] = []


class MlxVlmBackend(CachedBackend):
    """mlx-vlm behind the backend protocol (``conformance.protocol.Backend``).

    Options: ``dtype`` ("float32"); ``image_tower`` ("on", the default: mlx-vlm's vision tower computes
    the image soft tokens from ``request.image_inputs`` and the backend claims ``image_tower``; "off":
    the request's soft tokens are used as given); ``audio_tower`` (the same for audio, from
    ``request.audio_inputs``); ``mtp_convention`` (the MTP convention claimed, one of ``refimpl.mtp.CONVENTIONS``;
    default ``rotating/P-1``, the one mlx-vlm follows: ``mtp.py``; another one shows where and how far
    mlx-vlm departs from it); ``quantize`` (``"<bits>:<group size>"``, e.g. "4:64", or ``"mixed_3_6:64"``:
    quantise an unquantised checkpoint at open as ``mlx_vlm.convert -q`` does, ``quantise.py``; a checkpoint
    already quantised is loaded as it is); ``default_profile`` (default "fp32"; with ``quantize``, "q4" up to 4
    bits and for the mixed recipes, else "q8").
    """

    who = "mlx-vlm backend"

    def __init__(self, dtype: str = "float32", image_tower: str = "on", audio_tower: str = "on",
                 mtp_convention: str = MTP_CONVENTION, default_profile: str | None = None,
                 quantize: str | None = None):
        super().__init__()
        for option, value, choices in (("dtype", dtype, DTYPES), ("image_tower", image_tower, TOWER_OPTIONS),
                                       ("audio_tower", audio_tower, TOWER_OPTIONS),
                                       ("mtp_convention", mtp_convention, CONVENTIONS)):
            check_choice(f"option {option}", value, choices, who="mlx-vlm backend", error=ValueError)
        self.quantize = None if quantize is None else quantize_option(quantize)
        if default_profile is None:
            default_profile = "fp32" if self.quantize is None else (
                "q4" if isinstance(self.quantize[0], str) or self.quantize[0] <= 4 else "q8")
        check_choice("option default_profile", default_profile, PROFILES, who="mlx-vlm backend", error=ValueError)
        self.dtype = dtype
        self.image_tower, self.audio_tower = image_tower == "on", audio_tower == "on"
        self.mtp_convention = mtp_convention
        self.name = (f"mlx-vlm-{dtype}" + ("" if self.image_tower else "-image-tower-off")
                     + ("" if self.audio_tower else "-audio-tower-off")
                     + ("" if mtp_convention == MTP_CONVENTION else "-mtp-" + mtp_convention.replace("/", "-"))
                     + ("" if quantize is None else f"-q{quantize.replace(':', '-g')}"))
        self.capabilities = Capabilities(
            full_forward=True, last_plain=True, last_seq_id=True, last_embeddings=True,
            embedding_convention="scaled", interior_rows=True, output_rows=True, ubatch=True,
            chunked_prefill=True, multi_sequence=True, decode=True, image_prompts=True, audio_prompts=True,
            audio_tower=self.audio_tower, image_tower=self.image_tower, video_prompts=True, mtp_generate=True,
            mtp_conventions=mtp_convention, default_profile=default_profile,
            weight_formats="safetensors,mlx-affine",  # mlx-vlm loads a quantised directory as QuantizedLinear layers
        )
        # the divergences are the vision mask's, whichever soft tokens are used: one file per dtype
        shipped = EXPECTATIONS_DIR / f"mlx-vlm-{dtype}.json"
        self.expectations_file = shipped if shipped.is_file() else None
        self.family: Family | None = None
        self.text_config = None  # refimpl.config.TextConfig of the open checkpoint
        self.config_patch: dict[str, dict[str, Any]] = {}
        self.load_info: dict[str, Any] = {}
        self.vision = self.audio = False  # the checkpoint has a vision_config / an audio_config
        self.media_ids: dict[str, int | None] = {}
        self._model_dir: Path | None = None
        self._prompt_cache: dict[str, int] = {}

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        cfg, raw = read_configs(model_dir, "mlx-vlm")
        family = family_for(raw, str(model_dir))
        patch = config_patch(raw, cfg, family.model_type)
        view = checkpoint_view(model_dir, raw, patch) if patch else None
        try:
            model = load_model(view or model_dir)
        except Exception as exc:  # whatever mlx-vlm raises, name the loader and the directory
            detail = " ".join(str(exc).split())  # one line, whatever mlx-vlm's message looks like
            if len(detail) > 400:
                detail = detail[:400] + " ..."
            raise BackendError(f"mlx-vlm backend: mlx_vlm.utils.load_model cannot load {model_dir}: "
                               f"{type(exc).__name__}: {detail}") from exc
        finally:
            remove_view(view)  # the weights are in memory (load_model evaluates them)
        model_class = f"{type(model).__module__}.{type(model).__name__}"
        if not type(model).__module__.startswith(family.mlx_module + "."):
            raise BackendError(f"mlx-vlm backend: {model_dir}: mlx-vlm built {model_class}, expected a model of "
                               f"{family.mlx_module}")
        stored = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())})
        target = getattr(mx, self.dtype)
        model.update(tree_map(lambda v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v,
                              model.parameters()))
        if self.quantize is not None and "quantization" not in raw:
            model, _ = quantized(model, raw, *self.quantize)
        mx.eval(model.parameters())
        self.model, self.family, self.text_config, self.config_patch = model, family, cfg, patch
        self._model_dir = model_dir
        self.vision = family.media and isinstance(raw.get("vision_config"), dict)
        self.audio = family.media and isinstance(raw.get("audio_config"), dict)
        self.media_ids = {"image": getattr(model.config, "image_token_id", None) if family.media else None,
                          "audio": getattr(model.config, "audio_token_id", None) if family.media else None,
                          "video": getattr(model.config, "video_token_id", None) if family.media else None}
        try:
            problems = geometry_problems(family, model, cfg)
            if problems:
                raise BackendError("mlx-vlm backend: mlx-vlm builds a different model than the checkpoint's "
                                   "config.json describes (mlx-vlm cannot express this configuration): "
                                   + "; ".join(problems))
            self._warm_up()
        except BaseException:
            self.close()
            raise
        caches = [type(c).__name__ for c in make_prompt_cache(model.language_model)]
        self._prompt_cache = {kind: caches.count(kind) for kind in dict.fromkeys(caches)}
        towers = {name: getattr(model, name, None) is not None for name in family.towers}
        self.load_info = {
            "loader": "mlx_vlm.utils.load_model", "model_class": model_class, "model_type": family.model_type,
            "architecture": cfg.architecture, "serialisation": cfg.serialisation, "stored_dtypes": stored,
            "dtype": self.dtype, "versions": _versions(), "config_patch": patch, "caches": caches,
            "towers": towers if family.media else {}, "media_token_ids": self.media_ids,
            "quantization": raw.get("quantization") if "quantization" in raw else (
                None if self.quantize is None else {"quantized_at_open": ":".join(map(str, self.quantize))}),
        }

    def close(self) -> None:
        self.model = None
        self.family = None
        self.text_config = None
        self.vision = self.audio = False
        self.media_ids = {}
        self._prompt_cache = {}
        self.drafters = {}
        self._states = {}

    def run(self, request: Request) -> Response:
        """CachedBackend's request handling; MTP requests (mode ``generate``) through mlx-vlm's own MTP loop
        (``conformance.backends.mlx_vlm.mtp``)."""
        if request.kind == "mtp":
            return self._mtp(request)
        return super().run(request)

    def _mtp(self, request: Request) -> Response:
        drafter = self.own_mtp_drafter(request, self.mtp_convention, "mlx-vlm's own MTP loop",
                                       lambda path: load_assistant(path, self.dtype))
        # the prompt's last row from a plain forward of its own
        logits, _ = self._forward(request.tokens, [len(request.tokens) - 1], self._new_state())
        mtp, notes = assisted_generate(self.model, drafter, request,
                                       set(self.text_config.eos_token_ids))
        return Response(logits, None, self._executed("mtp", convention=self.mtp_convention, **notes), mtp=mtp)

    # -- checks at open -------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """One single-token forward through a throwaway prompt cache (mlx compiles its kernels on the
        first call); a model that cannot run at all fails here, at open."""
        try:
            cache = make_prompt_cache(self.model.language_model)
            ids = mx.array([[self.text_config.bos_token_id or 0]], dtype=mx.int32)
            mx.eval(self.family.decode(self.model, ids, cache))
        except Exception as exc:
            raise BackendError(f"mlx-vlm backend: a one-token forward of the loaded model fails: "
                               f"{type(exc).__name__}: {exc}") from exc

    # -- engine hooks ---------------------------------------------------------------------------

    @property
    def out_dtype(self):
        return np.float32

    def _new_state(self) -> SequenceState:
        return SequenceState(make_prompt_cache(self.model.language_model))

    def _state_len(self, state: SequenceState) -> int:
        return int(state.cache[0].offset)

    def _token_types(self, ids: list[int], images: Sequence[tuple[int, int]],
                     audio: Sequence[tuple[int, int]]) -> list[int]:
        """``mm_token_type_ids`` of one forward's tokens by the rule of mlx-vlm's ``Gemma4Processor`` (1 at the
        image token, 2 at the video token, 3 at the audio token), checked: an image (audio) request needs a
        checkpoint with a vision (audio) config, and every block holds only the image (audio) token."""
        kind = ("a text-only" if not self.family.media else
                "an audio-text" if self.audio and not self.vision else "an image-text" if self.vision else
                "a text-only conditional")
        for what, spans, have, config in (("image", images, self.vision, "vision_config"),
                                          ("audio", audio, self.audio, "audio_config")):
            if not spans:
                continue
            if not have:
                raise ValueError(f"{self.who}: {self._model_dir} has no {config} ({kind} checkpoint); it cannot "
                                 f"serve {what} prompts")
            token, frame = self.media_ids[what], self.media_ids["video"] if what == "image" else None
            for start, n in spans:
                if (why := block_token_problem(ids, start, n, what, token, frame)) is not None:
                    raise ValueError(f"{self.who}: {why}")
        if not self.family.media:
            return [0] * len(ids)
        rule = {self.media_ids["image"]: IMAGE_TYPE, self.media_ids["video"]: VIDEO_TYPE,
                self.media_ids["audio"]: AUDIO_TYPE}
        return [rule.get(t, 0) for t in ids]

    def _audio_features(self, audio_inputs: Sequence) -> tuple[mx.array, mx.array]:
        """A forward's clips as mlx-vlm's feature extractor batches them: features ``[n, T, F]`` padded at the
        end with zero frames, ``input_features_mask`` ``[n, T]`` (True at valid frames)."""
        x, mask = padded_clips(audio_inputs, self.who)
        return mx.array(x.astype(np.float32)), mx.array(mask)

    def _image_pixels(self, image_inputs: Sequence) -> dict[str, Any]:
        """A forward's images as mlx-vlm's ``get_input_embeddings`` takes them from its processor: the
        patches ``[N, C]`` (values in [0, 1]) and their (x, y) positions ``[N, 2]`` of each image, packed
        as the family's model takes them (``Family.image_kwargs``)."""
        pixels, positions = [], []
        for k, image in enumerate(image_inputs):
            pv, pos = np.asarray(image.pixel_values), np.asarray(image.positions)
            if pv.ndim != 2 or pos.shape != (pv.shape[0], 2):
                raise ValueError(f"{self.who}: image {k}: pixel_values {pv.shape} and positions {pos.shape} must "
                                 f"be [N, C] and [N, 2]")
            pixels.append(pv)
            positions.append(pos)
        return self.family.image_kwargs(pixels, positions)

    @staticmethod
    def _logits_to_keep(rows: list[int], T: int) -> int | None:
        """mlx-vlm's ``logits_to_keep`` for a forward whose ``rows`` are wanted: the suffix from the first
        wanted row (None: every row); a forward with no wanted row keeps 1, as generate's prefill chunks do."""
        if not rows:
            return 1
        keep = T - rows[0]
        return None if keep == T else keep

    def _forward(self, tokens: Sequence[int], rows: list[int], state: SequenceState,
                 embeddings: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
                 audio: Sequence[tuple[int, int]] = (), audio_inputs: Sequence = (),
                 image_inputs: Sequence = ()) -> tuple[np.ndarray, dict]:
        """One prompt forward continuing ``state``; the logits of ``rows`` as float32 ``[R, V]`` and notes
        (``logits_to_keep``, ``mm_token_type_ids``, ``image_rows_max_abs``, ``audio_rows_max_abs``)."""
        T = len(tokens)
        id_list = [int(t) for t in tokens]
        types = self._token_types(id_list, images, audio)
        keep = self._logits_to_keep(rows, T)
        towers: dict[str, Any] = {}
        if images and self.image_tower:
            if len(image_inputs) != len(images):
                raise ValueError(f"{self.who}: {len(images)} image blocks but {len(image_inputs)} image_inputs")
            frame = [types[start] == VIDEO_TYPE for start, _ in images]  # video frames, through the video keywords
            for what, want in (("image", False), ("video", True)):
                chosen = [x for x, f in zip(image_inputs, frame, strict=True) if f == want]
                if chosen:
                    kw = self._image_pixels(chosen)
                    towers[what] = kw if what == "image" else {"pixel_values_videos": kw["pixel_values"],
                                                               "video_position_ids": kw["image_position_ids"]}
        if audio and self.audio_tower:
            x, mask = self._audio_features(audio_inputs)
            towers["audio"] = {"input_features": x, "input_features_mask": mask}
        before = self._state_len(state)
        ids = mx.array([id_list], dtype=mx.int32)
        logits, notes = self.family.prompt(self.model, ids, state.cache, embeddings, self.hidden_size, keep,
                                           token_types=state.token_types + types, tower_inputs=towers)
        mx.eval(logits, [c.state for c in state.cache])
        after = self._state_len(state)
        if after != before + T:
            raise RuntimeError(f"{self.who}: the prompt cache holds {after} tokens after a {T}-token forward "
                               f"from {before}")
        state.token_types += types
        kept = T if keep is None else keep
        if logits.shape != (kept, self.vocab_size):
            raise RuntimeError(f"{self.who}: logits_to_keep={keep} gave logits of shape {tuple(logits.shape)}, "
                               f"expected {(kept, self.vocab_size)}")
        return self._logit_rows(logits, [r - (T - kept) for r in rows]), {"logits_to_keep": keep or 0, **notes}

    def _decode_step(self, state: SequenceState, token: int) -> np.ndarray:
        """One teacher-forced decode step as generate's ``_step``: the id alone, ``logits_to_keep=1``."""
        before = self._state_len(state)
        logits = self.family.decode(self.model, mx.array([[int(token)]], dtype=mx.int32), state.cache)
        mx.eval(logits, [c.state for c in state.cache])
        if self._state_len(state) != before + 1:
            raise RuntimeError(f"{self.who}: the prompt cache did not grow by one token in a decode step")
        state.token_types.append(0)
        return self._logit_rows(logits, [logits.shape[0] - 1])[0]

    @staticmethod
    def _logit_rows(logits: mx.array, rows: Sequence[int]) -> np.ndarray:
        if not rows:
            return np.empty((0, logits.shape[-1]), dtype=np.float32)
        return np.array(logits[mx.array([int(r) for r in rows], dtype=mx.int32)].astype(mx.float32))

    def _executed(self, path: str, **extra) -> dict[str, Any]:
        v = _versions()
        return {"path": path, "engine": f"mlx-vlm {v['mlx-vlm']}, mlx {v['mlx']}", "model": self.load_info.get(
                    "model_class"), "dtype": self.dtype, "device": str(mx.default_device()), "fresh_state": True,
                "cache": "mlx_vlm.models.cache.make_prompt_cache(model.language_model)",
                "prompt_cache": self._prompt_cache,
                "rows": "logits_to_keep = the suffix from the first requested row (mlx-vlm trims before the first "
                        "KV-shared layer); requested rows selected from it; decode logits_to_keep=1",
                "config_patch": self.config_patch, **extra}

    def _notes(self, request: Request) -> dict[str, Any]:
        """How embeddings, per-layer inputs, masks and audio soft tokens went in (media and embeddings
        requests); the rows of a full request; the caches of a multi request."""
        if request.kind == "full":
            return {"rows": len(request.tokens)}
        ple = bool(self.text_config.hidden_size_per_layer_input)
        out: dict[str, Any] = {}
        if request.images or request.audio:
            vision_masks = self.text_config.use_bidirectional_attention == "vision"
            out = {"inputs_embeds": "scaled (E[ids] * sqrt(H) at text rows, soft tokens unscaled at media rows), "
                                    "float32, as language_model(inputs_embeds=...)",
                   "per_layer_inputs": ("Model.get_input_embeddings(input_ids): token id 0 at image/audio/video "
                                        "token positions" if ple else None),
                   "token_types": "mm_token_type_ids by the processor's rule (1 image, 3 audio), from the sequence's "
                                  "start; decode steps none"}
            if request.images:
                out["images"] = [list(b) for b in request.images]
                out["image_tower"] = (f"mlx-vlm {self.family.tower_modules['image']} via Model.get_input_embeddings("
                                      "pixel_values, image_position_ids) on each forward's images, scattered into "
                                      "the image token rows" if self.image_tower else
                                      "none: the request's soft tokens are used as given")
                out["image_mask"] = ("mlx-vlm Gemma4TextModel._make_masks: the same-block overlay OR-ed into the "
                                     "mask of every layer type (full and sliding), only when the forward's mask is "
                                     "square (no cached prefix)" if vision_masks else
                                     "causal (use_bidirectional_attention is not 'vision')")
            if request.audio:
                out["audio"] = [list(b) for b in request.audio]
                out["audio_tower"] = (f"mlx-vlm {self.family.tower_modules['audio']} via Model.get_input_embeddings("
                                      "input_features, input_features_mask) on each forward's clips as one padded "
                                      "batch, scattered into the audio token rows" if self.audio_tower else
                                      "none: the request's soft tokens are used as given")
            return out
        if request.kind == "last" and request.entry == "embeddings":
            return {"inputs_embeds": ("scaled, as language_model(inputs_embeds=...)" if self.family.media else
                                      "scaled / sqrt(H), as language_model(input_embeddings=...), which scales by "
                                      "sqrt(H)"),
                    "per_layer_inputs": "looked up by the token ids" if ple else None}
        if request.kind == "multi":
            return {"caches": "one make_prompt_cache(model.language_model) per seq_id"}
        return {}
