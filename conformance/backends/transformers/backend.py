"""Hugging Face transformers (PyTorch) as a conformance backend.

It drives ``transformers.Gemma4ForCausalLM`` (``Gemma4ForConditionalGeneration`` for an image-text or
audio-text checkpoint) the way a serving stack built on transformers does, and claims every capability
of the protocol, image and audio prompts included (``audio_tower`` too, except in float64: see below). The request
handling (validation, micro-batches, one cache
per sequence id, decode) is ``conformance.protocol.serving.CachedBackend``'s; this module supplies the
forward, and with it how each request kind reaches transformers:

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
* traces (``request.trace``; the points of ``conformance.protocol.trace``): forward hooks on the text
  model's modules, installed for one forward and removed after it (:meth:`TransformersBackend._tracing`):
  ``embed`` the input of decoder layer 0 (a forward pre-hook: ``inputs_embeds``, soft tokens merged), per
  layer ``attn_out`` / ``ffn_out`` / ``ple_add`` the outputs of ``post_attention_layernorm`` /
  ``post_feedforward_layernorm`` (on MoE layers after the expert branch is added) /
  ``post_per_layer_input_norm``, ``router.experts`` the top-k indices of ``router``, ``residual`` the
  layer's output (``layer_scalar`` applied), ``final_norm`` the output of the final ``norm``. Each keeps
  the forward's output rows; a layer after ``_maybe_slice_kv_shared_inputs`` sees only the last ``k``
  positions, so a row is taken at its offset from the end.

Options (``--backend-option KEY=VALUE``):

``dtype``   ``"float32"`` (default), ``"float64"``, ``"bfloat16"``. transformers' float64 is not a
            pure float64 model: RMSNorm, the attention softmax (eager), the RoPE angles and the MoE
            router softmax stay float32 (see tests/hf_reference.py), so float64 is graded with the
            ``fp32`` profile like float32; bfloat16 with ``bf16``. Logits come back as float32
            (float64 for the float64 model).
``attn``    ``"eager"`` (default) or ``"sdpa"`` (``attn_implementation``).
``device``  ``"auto"`` (default: CUDA when ``torch.cuda.is_available()``, else CPU), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``.
``experts`` ``"auto"`` (default: ``"eager"`` for float64, which ``grouped_mm`` refuses, and for
            float32 on CUDA, where torch's grouped GEMM takes bfloat16 only; transformers' default,
            ``grouped_mm``, otherwise), ``"eager"``, ``"grouped_mm"``, ``"batched_mm"``
            (``experts_implementation`` of the MoE blocks).
``threads`` ``None`` (default: leave torch's thread count alone) or an int for
            ``torch.set_num_threads`` (process-wide; 1 is fastest for the tiny synthetic sets).
``image_tower`` ``"off"`` (default: the image soft tokens the request's embeddings carry) or ``"on"``
            (Gemma 4 Unified only: transformers' own vision embedder,
            ``Gemma4UnifiedModel.get_image_features``, computes them from ``request.image_inputs``, the
            padded 48-pixel patches and positions; claims ``image_tower``). Named in the backend's name.
``audio_tower`` ``"auto"`` (default: ``"on"`` except for float64, where transformers' audio tower does not
            run), ``"on"`` (compute the audio soft tokens with transformers' audio tower from
            ``request.audio_inputs``; claims ``audio_tower``), ``"off"`` (use the soft tokens the
            request's embeddings carry). Named in the backend's name when not ``"auto"``.

Measured on the bundled sets (260 cases, CPU, torch 2.13.0+cpu, transformers 5.24.0; worst row
max_abs against the float64 oracle):

==================  =======  ==========================  ===============================
dtype / attn        profile  result                      worst max_abs
==================  =======  ==========================  ===============================
float32 / eager     fp32     260 pass                    3.1e-4 (e2b-mini full/B/T19 r11)
float32 / sdpa      fp32     260 pass                    3.5e-4 (same row)
float64 / eager     fp32     260 pass                    2.6e-4 (e4b-mini full/B/T19 r15)
float64 / sdpa      fp32     260 pass                    9.6e-5 (same row)
bfloat16 / eager    bf16     231 pass, 29 known failure  12.1 (26b-a4b-mini, router flip)
bfloat16 / sdpa     bf16     241 pass, 19 known failure  12.1 (same)
==================  =======  ==========================  ===============================

float64 is float32-close only, because of its float32 spots (sdpa computes the attention softmax in
float64, one spot fewer than eager, hence its smaller error). With those spots made float64
(tests/hf_reference.py) the backend passes all 260 cases at ``exact-f64`` (worst 1.6e-12), so its
caches, index tensors and micro-batches add nothing. The bf16 failures are MoE router near-ties and
ill-conditioned per-layer-input norms that a stock bf16 forward over the whole base reproduces row for
row; they are listed, with their causes, in expectations files per device, because bf16 rounding is
kernel-specific (``conformance/backends/transformers/expectations/transformers-bfloat16-{eager,sdpa}-{cpu,cuda}.json``,
picked by :func:`shipped_expectations`; CUDA measured on an H200). On a busy 2-core machine torch's
default threads made a full run 10-20x slower than ``threads=1`` (90-220 s instead of 8-13 s).

The name shows the configuration: ``transformers-float32-eager`` (plus ``-experts-<impl>`` when
``experts`` is given explicitly); the device, versions and the path taken are in every case's
``executed`` record. Both checkpoint layouts load: ``Gemma4ForCausalLM`` (tensors ``model.*``) and
``Gemma4ForConditionalGeneration`` (config under ``text_config``, tensors ``model.language_model.*``;
without a ``vision_config`` or ``audio_config`` only the text model is built, with one the whole
image-text / audio-text model).
:func:`load_gemma4_causal_lm` (tests/hf_reference.py uses it too) and
:func:`load_gemma4_conditional_generation` are the loaders; ``executed["model"]`` names the class.
They load safetensors only (``use_safetensors=True``; a directory with only a pickled
``pytorch_model.bin`` is refused: unpickling can run code), see docs/backends.md, "Security".

    conformance check --backend transformers
    conformance check --backend transformers --backend-option dtype=bfloat16 --backend-option attn=sdpa
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import (
    DynamicCache,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4UnifiedForCausalLM,
    Gemma4UnifiedForConditionalGeneration,
)

from refimpl.errors import check_choice, choice_message

from ...protocol.serving import CachedBackend, padded_clips
from ...protocol.types import BackendError, Capabilities, Request, Response
from .mtp import CONVENTION as MTP_CONVENTION
from .mtp import assisted_generate, load_assistant

__all__ = ["ATTN_IMPLEMENTATIONS", "AUDIO_TOWER_OPTIONS", "DTYPES", "EXPERTS_IMPLEMENTATIONS", "TransformersBackend",
           "checkpoint_layout", "has_audio", "has_vision", "is_unified", "load_gemma4_causal_lm",
           "load_gemma4_conditional_generation", "load_gemma4_unified", "resolve_device", "shipped_expectations"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
EXPERTS_IMPLEMENTATIONS = ("auto", "eager", "grouped_mm", "batched_mm")
DEVICES = ("auto", "cpu", "cuda")
AUDIO_TOWER_OPTIONS = ("auto", "on", "off")
IMAGE_TOWER_OPTIONS = ("off", "on")
# CUDA TF32: "off" (default) turns it off for matmuls and cuDNN convolutions (the audio tower's
# subsampling Conv2d), so float32 means float32; "torch" keeps torch's defaults (matmuls off,
# convolutions on: on an H200 that moves the audio soft tokens by ~0.1 and fails the fp32 profile)
TF32_OPTIONS = ("off", "torch")
CONDITIONAL_KEY_MAPPING = {r"^model\.language_model\.": "model."}
EXPECTATIONS_DIR = Path(__file__).resolve().parent / "expectations"


WHO = "transformers backend"  # how its messages name it



# ----------------------------------------------------------------------------------------------
# loading


def checkpoint_layout(model_dir: str | os.PathLike) -> tuple[str, dict]:
    """("causal" | "conditional", raw config.json) of a Gemma 4 checkpoint directory.

    "conditional" is the published ``Gemma4ForConditionalGeneration`` form (text config under
    ``text_config``, text tensors under ``model.language_model.``); "causal" is ``Gemma4ForCausalLM``.
    Raises BackendError when there is no readable config.json or it is not a Gemma 4 config.
    """
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendError(f"{model_dir}: cannot read config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise BackendError(f"{model_dir}: config.json is not a JSON object")
    if "text_config" in raw:
        text = raw["text_config"] if isinstance(raw["text_config"], dict) else {}
        layout, types = "conditional", (raw.get("model_type"), text.get("model_type"))
    else:
        layout, types = "causal", (raw.get("model_type"),)
    known = ("gemma4", "gemma4_text", None) if not is_unified(raw) else UNIFIED_MODEL_TYPES + (None,)
    if not all(t in known for t in types) or not any(types):
        raise BackendError(f"{model_dir}: config.json is not a Gemma 4 config (model_type {raw.get('model_type')!r})")
    return layout, raw


UNIFIED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")


def is_unified(raw: dict) -> bool:
    """Whether a raw config.json is a Gemma 4 Unified one (its architecture or model type)."""
    archs = raw.get("architectures") or []
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return (any(isinstance(a, str) and a.startswith("Gemma4Unified") for a in archs)
            or raw.get("model_type") in UNIFIED_MODEL_TYPES or text.get("model_type") in UNIFIED_MODEL_TYPES)


def load_gemma4_unified(model_dir: str | os.PathLike, dtype: str | torch.dtype = "float32", *,
                        attn_implementation: str = "eager", experts_implementation: str | None = None,
                        device: str | torch.device = "cpu"):
    """Load a Gemma 4 Unified checkpoint as an eval-mode ``Gemma4UnifiedForConditionalGeneration``
    (conditional layout: the text model and whichever encoder-free embedders the config has) or
    ``Gemma4UnifiedForCausalLM`` (causal layout), by plain ``from_pretrained``; every weight must come
    from the checkpoint. ``experts_implementation`` is ignored (no MoE). BackendError on any failure."""
    kwargs = _load_kwargs(dtype, attn_implementation, None)
    layout, raw = checkpoint_layout(model_dir)
    _require_safetensors(model_dir)
    cls = Gemma4UnifiedForConditionalGeneration if layout == "conditional" else Gemma4UnifiedForCausalLM
    model, info = _from_pretrained(cls, model_dir, kwargs, f"Gemma 4 Unified, {layout} layout")
    text = model.model.language_model if layout == "conditional" else model.model
    return _checked(model, info, text.embed_tokens, f"{model_dir} (Gemma 4 Unified, {layout} layout)", device)


SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _require_safetensors(model_dir: str | os.PathLike) -> None:
    """Refuse a checkpoint whose weights are pickled PyTorch files only (``pytorch_model.bin`` and the like):
    unpickling can run arbitrary code, so every ``from_pretrained`` here passes ``use_safetensors=True``
    and this says why such a directory cannot be served (BackendError)."""
    path = Path(model_dir)
    if any((path / n).is_file() for n in SAFETENSORS_WEIGHTS):
        return
    try:
        pickled = sorted(p.name for p in path.iterdir() if p.is_file() and (p.suffix in PICKLE_SUFFIXES
                                                                          or p.name.endswith(".bin.index.json")))
    except OSError:
        pickled = []
    if pickled:
        raise BackendError(f"{model_dir}: no safetensors weights ({' or '.join(SAFETENSORS_WEIGHTS)}), only pickled "
                           f"PyTorch files ({', '.join(pickled)}); the transformers backend loads safetensors only "
                           "(unpickling a checkpoint can run arbitrary code): convert it to safetensors")


@contextlib.contextmanager
def _quiet_progress_bar():
    """Hide transformers' "Loading weights" progress bar for one load; restore the setting after."""
    logging = transformers.utils.logging
    enabled = logging.is_progress_bar_enabled()
    if enabled:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def load_gemma4_causal_lm(model_dir: str | os.PathLike, dtype: str | torch.dtype = "float32", *,
                          attn_implementation: str = "eager", experts_implementation: str | None = None,
                          device: str | torch.device = "cpu") -> Gemma4ForCausalLM:
    """Load a Gemma 4 checkpoint directory as an eval-mode ``Gemma4ForCausalLM`` on ``device``.

    Both layouts (:func:`checkpoint_layout`): a causal checkpoint goes through
    ``Gemma4ForCausalLM.from_pretrained`` as it is; for a conditional one only the text model is
    built, from ``config.text_config``, and the tensors are renamed with from_pretrained's
    ``key_mapping={"^model.language_model.": "model."}`` (vision / audio tensors stay unused).
    Plain ``from_pretrained`` on a conditional directory would find none of its weights and silently
    return a randomly initialised model, so every weight of the text model must come from the
    checkpoint (``lm_head.weight`` is tied to ``model.embed_tokens.weight``) and no shape may
    mismatch. ``experts_implementation=None`` keeps transformers' default (``grouped_mm``, which
    refuses float64: pass ``"eager"`` there).

    Safetensors only (``use_safetensors=True``): a directory with only pickled weights is refused.
    Every failure is a BackendError that names the directory and the reason.
    """
    kwargs = _load_kwargs(dtype, attn_implementation, experts_implementation)
    layout, _ = checkpoint_layout(model_dir)
    _require_safetensors(model_dir)
    try:
        with _quiet_progress_bar():
            if layout == "conditional":
                kwargs["config"] = transformers.AutoConfig.from_pretrained(os.fspath(model_dir)).get_text_config()
                kwargs["key_mapping"] = CONDITIONAL_KEY_MAPPING
            model, info = Gemma4ForCausalLM.from_pretrained(os.fspath(model_dir), **kwargs)
    except Exception as exc:  # whatever transformers raises, the checkpoint cannot be served
        raise BackendError(f"transformers {transformers.__version__} cannot load {model_dir} ({layout} layout): "
                           f"{type(exc).__name__}: {exc}") from exc
    return _checked(model, info, model.model.embed_tokens, f"{model_dir} ({layout} layout)", device)


def _from_pretrained(cls, model_dir: str | os.PathLike, kwargs: dict[str, Any], what: str):
    """(model, loading info) of ``cls.from_pretrained(model_dir, **kwargs)`` without the progress bar;
    whatever transformers raises is a BackendError naming the directory and ``what`` it was loaded as."""
    try:
        with _quiet_progress_bar():
            return cls.from_pretrained(os.fspath(model_dir), **kwargs)
    except Exception as exc:  # whatever transformers raises, the checkpoint cannot be served
        raise BackendError(f"transformers {transformers.__version__} cannot load {model_dir} ({what}): "
                           f"{type(exc).__name__}: {exc}") from exc


def _checked(model, info: dict, embed_tokens, what: str, device: str | torch.device):
    """The loaded model in eval mode on ``device``, after checking that every weight came from the
    checkpoint (``lm_head.weight`` aside: it is tied), none mismatched, and the head is tied."""
    missing = set(info["missing_keys"]) - {"lm_head.weight"}
    if missing or info["mismatched_keys"]:
        raise BackendError(f"transformers cannot load {what}: weights missing {sorted(missing)} / mismatched "
                           f"{sorted(map(str, info['mismatched_keys']))}")
    if model.lm_head.weight.data_ptr() != embed_tokens.weight.data_ptr():
        raise BackendError(f"transformers cannot load {what}: lm_head is not tied to embed_tokens")
    model.eval()
    return model.to(device)


def has_vision(raw_config: dict) -> bool:
    """Whether a checkpoint's raw config.json (:func:`checkpoint_layout`) has a vision tower (a
    non-null top-level ``vision_config``): an image-text ``Gemma4ForConditionalGeneration``."""
    return isinstance(raw_config.get("vision_config"), dict)


def has_audio(raw_config: dict) -> bool:
    """Whether a checkpoint's raw config.json has an audio tower (a non-null top-level ``audio_config``):
    an audio-text ``Gemma4ForConditionalGeneration``."""
    return isinstance(raw_config.get("audio_config"), dict)


def _load_kwargs(dtype: str | torch.dtype, attn_implementation: str,
                 experts_implementation: str | None) -> dict[str, Any]:
    torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if torch_dtype is None:
        check_choice("dtype", dtype, DTYPES, error=ValueError)
    # use_safetensors: never a pickled pytorch_model.bin (unpickling can run code), whatever the directory holds
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation,
                              "output_loading_info": True, "use_safetensors": True}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    return kwargs


def load_gemma4_conditional_generation(model_dir: str | os.PathLike, dtype: str | torch.dtype = "float32", *,
                                       attn_implementation: str = "eager",
                                       experts_implementation: str | None = None,
                                       device: str | torch.device = "cpu") -> Gemma4ForConditionalGeneration:
    """Load an image-text or audio-text Gemma 4 checkpoint (conditional layout with a ``vision_config``
    and/or an ``audio_config``) as an eval-mode ``Gemma4ForConditionalGeneration`` on ``device``: the
    whole model as published (text model, vision tower and ``embed_vision``, audio tower and
    ``embed_audio``, whichever the config has), by plain ``from_pretrained``. Every weight must come from the checkpoint
    (``lm_head.weight`` is tied to ``model.language_model.embed_tokens.weight``) and no shape may mismatch.

    Safetensors only, as :func:`load_gemma4_causal_lm`.
    Every failure is a BackendError that names the directory and the reason.
    """
    kwargs = _load_kwargs(dtype, attn_implementation, experts_implementation)
    layout, raw = checkpoint_layout(model_dir)
    if layout != "conditional" or not (has_vision(raw) or has_audio(raw)):
        raise BackendError(f"{model_dir}: not an image-text or audio-text checkpoint (no vision_config or "
                           f"audio_config); load it with load_gemma4_causal_lm")
    _require_safetensors(model_dir)
    what = "conditional layout, " + "+".join(m for m, on in (("vision", has_vision(raw)), ("audio", has_audio(raw)))
                                             if on)
    if has_audio(raw) and attn_implementation != "eager":
        # Gemma4AudioModel refuses any attention but eager ("does not support an attention implementation
        # through torch.nn.functional.scaled_dot_product_attention yet"): the text (and vision) model
        # takes the one asked for, the audio tower eager
        kwargs["attn_implementation"] = {"text_config": attn_implementation, "audio_config": "eager",
                                         **({"vision_config": attn_implementation} if has_vision(raw) else {})}
    model, info = _from_pretrained(Gemma4ForConditionalGeneration, model_dir, kwargs, what)
    return _checked(model, info, model.model.language_model.embed_tokens, f"{model_dir} ({what})", device)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; ``"cpu"``; ``"cuda"`` / ``"cuda:N"`` (must exist)."""
    if not isinstance(device, str) or not (device in DEVICES or device.startswith("cuda:")):
        check_choice("device", device, DEVICES, who=WHO, error=ValueError, hint=" (or cuda:N)")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(choice_message("device", device, DEVICES, who=WHO, hint=" (or cuda:N)")) from exc
    if not torch.cuda.is_available():
        raise BackendError(f"transformers backend: device {device!r} was requested but CUDA is not available "
                           f"(torch {torch.__version__}: torch.cuda.is_available() is False); "
                           f"use device='cpu' or device='auto'")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise BackendError(f"transformers backend: device {device!r} was requested but only {count} CUDA "
                           f"device(s) are visible")
    return dev


def shipped_expectations(name: str, device: torch.device) -> Path | None:
    """The expectations file shipped for a configuration: ``<name>-<device type>.json`` (reduced-precision
    rounding is kernel-specific, so e.g. the bf16 known failures measured on CPU apply to CPU only), else
    ``<name>.json``, else None. ``-image-tower-on`` is not part of the file name: computing the image soft
    tokens with transformers' own embedder changes no recorded divergence (measured on 12b-mini)."""
    name = name.removesuffix("-image-tower-on")
    for candidate in (EXPECTATIONS_DIR / f"{name}-{device.type}.json", EXPECTATIONS_DIR / f"{name}.json"):
        if candidate.is_file():
            return candidate
    return None


# ----------------------------------------------------------------------------------------------
# the backend


class SequenceState:
    """One sequence's state: its ``DynamicCache`` and the ``mm_token_type_ids`` of every token the cache
    holds (1 at image tokens, 3 at audio tokens, 0 elsewhere). transformers' vision mask reads the block ids by absolute
    position (``blockwise_overlay`` indexes them with the kv position, and a sliding cache layer's keys
    start at ``kv_offset`` > 0), so a forward continuing the cache passes them from the sequence's start,
    as ``Gemma4ForConditionalGeneration.prepare_inputs_for_generation`` does for a prefill chunk."""

    __slots__ = ("cache", "token_types")

    def __init__(self, cache: DynamicCache):
        self.cache = cache
        self.token_types: list[int] = []


class TransformersBackend(CachedBackend):
    """``transformers.Gemma4ForCausalLM`` (``Gemma4ForConditionalGeneration`` for image-text and audio-text
    checkpoints) behind the backend protocol (``conformance.protocol.Backend``).

    Options: ``dtype`` ("float32", "float64", "bfloat16"), ``attn`` ("eager", "sdpa"), ``device``
    ("auto", "cpu", "cuda", "cuda:N"), ``experts`` ("auto", "eager", "grouped_mm", "batched_mm"),
    ``threads`` (None or an int >= 1), ``audio_tower`` ("auto", "on", "off"), ``tf32`` ("off", "torch";
    CUDA only), ``image_tower`` ("off", "on": Gemma 4 Unified's image soft tokens from transformers'
    own embedder). See the module docstring.
    """

    who = "transformers backend"

    def __init__(self, dtype: str = "float32", attn: str = "eager", device: str = "auto",
                 experts: str = "auto", threads: int | None = None, audio_tower: str = "auto", tf32: str = "off",
                 image_tower: str = "off"):
        super().__init__()
        for option, value, choices in (("dtype", dtype, DTYPES), ("attn", attn, ATTN_IMPLEMENTATIONS),
                                       ("experts", experts, EXPERTS_IMPLEMENTATIONS)):
            check_choice(option, value, choices, who=WHO, error=ValueError)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"transformers backend: threads must be None or an integer >= 1, got {threads!r}")
        for option, value, choices in (("audio_tower", audio_tower, AUDIO_TOWER_OPTIONS),
                                       ("image_tower", image_tower, IMAGE_TOWER_OPTIONS)):
            check_choice(option, value, choices, who=WHO, error=ValueError)
        self.image_tower = image_tower == "on"
        self.tf32 = check_choice("tf32", tf32, TF32_OPTIONS, who=WHO, error=ValueError)
        self.dtype = dtype
        self.torch_dtype = DTYPES[dtype]
        self.attn = attn
        self.device = resolve_device(device)
        if experts == "auto":
            # grouped_mm refuses float64 everywhere, and on CUDA takes bfloat16 only (torch's
            # _grouped_mm_cuda checks); None keeps transformers' default (grouped_mm)
            cuda_f32 = dtype == "float32" and self.device.type == "cuda"
            self.experts = "eager" if dtype == "float64" or cuda_f32 else None
        else:
            self.experts = experts
        self.threads = threads
        # transformers 5.24's audio tower does not run in float64 (Gemma4AudioAttention computes q/k/v in
        # float32, then multiplies by float64 parameters: "expected scalar type Float but found Double"),
        # so a float64 model takes the soft tokens the request gives unless told otherwise
        self.audio_tower = audio_tower == "on" or (audio_tower == "auto" and dtype != "float64")
        self.name = (f"transformers-{dtype}-{attn}" + ("" if experts == "auto" else f"-experts-{experts}")
                     + ("" if audio_tower == "auto" else f"-audio-tower-{audio_tower}")
                     + ("" if tf32 == "off" else f"-tf32-{tf32}")
                     + ("" if image_tower == "off" else "-image-tower-on"))
        self.capabilities = Capabilities(
            full_forward=True, last_plain=True, last_seq_id=True, last_embeddings=True,
            embedding_convention="scaled", interior_rows=True, output_rows=True, ubatch=True,
            chunked_prefill=True, multi_sequence=True, decode=True, image_prompts=True, audio_prompts=True,
            audio_tower=self.audio_tower, image_tower=self.image_tower, hidden_states=True, mtp_generate=True,
            mtp_conventions=MTP_CONVENTION, traces=True, default_profile="bf16" if dtype == "bfloat16" else "fp32",
        )
        self.expectations_file = shipped_expectations(self.name, self.device)
        self.model: Gemma4ForCausalLM | Gemma4ForConditionalGeneration | None = None
        self.layout: str | None = None
        self.vision = False  # the checkpoint has a vision tower: Gemma4ForConditionalGeneration
        self.audio = False  # the checkpoint has an audio tower: Gemma4ForConditionalGeneration
        self.unified = False  # a Gemma 4 Unified checkpoint: Gemma4Unified{ForConditionalGeneration,ForCausalLM}
        self.text_config: Any = None
        self.text_model: Any = None  # the Gemma4TextModel (per-layer inputs)
        self.image_token_id: int | None = None
        self.audio_token_id: int | None = None
        self._model_dir: Path | None = None
        self._cache_kw = "cache"
        self._device_info: dict[str, Any] = {}

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self.layout, raw = checkpoint_layout(model_dir)
        self.vision, self.audio = has_vision(raw), has_audio(raw)
        self.unified = is_unified(raw)
        if self.image_tower and not (self.unified and self.vision):
            raise BackendError(f"transformers backend: image_tower=on computes the image soft tokens with Gemma 4 "
                               f"Unified's vision embedder (get_image_features); {model_dir} is not a Gemma 4 Unified "
                               "checkpoint with a vision_config")
        loader = (load_gemma4_unified if self.unified else
                  load_gemma4_conditional_generation if self.conditional else load_gemma4_causal_lm)
        try:
            self.model = loader(model_dir, self.torch_dtype, attn_implementation=self.attn,
                                experts_implementation=self.experts, device=self.device)
        except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
            raise BackendError(f"transformers backend: {model_dir} does not fit on {self.device}: {exc}") from exc
        self._model_dir = Path(model_dir)
        self.text_config = self.model.config.get_text_config()
        # the text model: under model.language_model when a conditional class was loaded (an image-text or
        # audio-text Gemma 4, or any conditional-layout Gemma 4 Unified), else model.model
        wraps_text = self.conditional or (self.unified and self.layout == "conditional")
        self.text_model = self.model.model.language_model if wraps_text else self.model.model
        self.image_token_id = int(self.model.config.image_token_id) if self.vision else None
        self.audio_token_id = int(self.model.config.audio_token_id) if self.audio else None
        params = inspect.signature(type(self.model).forward).parameters
        # transformers 5.24 renamed past_key_values -> cache (the old name is deprecated until 5.40)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._device_info = {}
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            if self.tf32 == "off":
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            self._device_info = {"gpu": torch.cuda.get_device_name(self.device),
                                 "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                                 "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32)}

    def close(self) -> None:
        self.model = None
        self.drafters = {}
        self.layout = None
        self.vision = self.audio = self.unified = False
        self.text_config = self.text_model = self.image_token_id = self.audio_token_id = self._model_dir = None
        self._states = {}
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.empty_cache()

    def run(self, request: Request) -> Response:
        """CachedBackend's request handling, under ``torch.inference_mode()``; MTP requests (mode ``generate``)
        through transformers' own assisted generation (``conformance.backends.transformers.mtp``)."""
        with torch.inference_mode():
            if request.kind == "mtp":
                return self._mtp(request)
            return super().run(request)

    def _mtp(self, request: Request) -> Response:
        drafter = self.own_mtp_drafter(request, MTP_CONVENTION, "transformers' own assisted generation",
                                       lambda path: load_assistant(path, self.torch_dtype, self.attn, self.device))
        self._hidden = [] if request.hidden else None
        try:  # the prompt's last row (and its hidden state) from a forward of its own
            logits, _ = self._forward_rows(self._forward(request.tokens, [len(request.tokens) - 1], self._new_state()))
            hidden = self._take_hidden(1)
        finally:
            self._hidden = None
        mtp, notes = assisted_generate(self.model, drafter, request, self.pad_token_id)
        return Response(logits, None, self._executed("mtp", **notes), hidden=hidden, mtp=mtp)

    # -- engine hooks ---------------------------------------------------------------------------

    @property
    def out_dtype(self):
        return np.float64 if self.dtype == "float64" else np.float32

    @property
    def conditional(self) -> bool:
        """Whether the open checkpoint runs as ``Gemma4ForConditionalGeneration`` (a vision or audio tower)."""
        return self.vision or self.audio

    @property
    def vision_masks(self) -> bool:
        """Whether transformers builds block masks on this checkpoint: a ``Gemma4ForConditionalGeneration``
        whose text config says ``use_bidirectional_attention == "vision"`` (``Gemma4Model.forward`` then
        calls ``create_masks_for_vision_model`` when given ``mm_token_type_ids``; only types 1 and 2 form
        blocks, so audio tokens, type 3, stay causal)."""
        return self.conditional and self.text_config.use_bidirectional_attention == "vision"

    @property
    def ple(self) -> bool:
        """Whether the text model has per-layer inputs (Gemma 4 Unified never has)."""
        return bool(getattr(self.text_config, "hidden_size_per_layer_input", 0)) and not self.unified

    @property
    def pad_token_id(self) -> int:
        """The id whose per-layer-input row image and audio positions take (``text_config.pad_token_id``, as in
        ``Gemma4Model.forward``; 0 when the config has none)."""
        pad = self.text_config.pad_token_id
        return 0 if pad is None else int(pad)

    def _new_state(self) -> SequenceState:
        return SequenceState(DynamicCache(config=self.model.config))

    def _state_len(self, state: SequenceState) -> int:
        return state.cache.get_seq_length()

    def _logits_to_keep(self, rows: list[int], T: int) -> tuple[int | torch.Tensor, int | list[int]]:
        """(the logits_to_keep argument, its JSON form) selecting ``rows`` of a T-token forward.

        The last k rows -> the integer k; anything else -> a 1-D LongTensor of the positions; no row
        -> an empty LongTensor (never 0, which transformers reads as "all rows").
        """
        if rows and rows == list(range(T - len(rows), T)):
            return len(rows), len(rows)
        return torch.tensor(rows, dtype=torch.long, device=self.device), list(rows)

    def _numpy(self, logits: torch.Tensor) -> np.ndarray:
        out = logits.detach()
        if out.dtype not in (torch.float32, torch.float64):
            out = out.float()  # bfloat16 -> float32 on the way out
        return out.cpu().numpy()

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
            for start, n in spans:
                if any(t != token for t in ids[start:start + n]):
                    raise ValueError(f"{self.who}: the {what} block ({start}, {n}) holds tokens other than the "
                                     f"{what} token {token}")
                types[start:start + n] = [type_id] * n
        return types

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
        if len(image_inputs) != len(images):
            raise ValueError(f"{self.who}: {len(images)} image blocks but {len(image_inputs)} image_inputs")
        rows = {np.asarray(i.pixel_values).shape for i in image_inputs}
        if len(rows) != 1:
            raise ValueError(f"{self.who}: the images' pixel_values have different shapes {sorted(rows)}; Gemma 4 "
                             "Unified's processor pads every image to max_soft_tokens rows")
        pv = np.stack([np.asarray(i.pixel_values, dtype=np.float64) for i in image_inputs])
        pos = np.stack([np.asarray(i.positions, dtype=np.int64) for i in image_inputs])
        out = self.model.model.get_image_features(torch.from_numpy(pv).to(self.device, self.torch_dtype),
                                                  torch.from_numpy(pos).to(self.device), return_dict=True)
        parts = list(out.pooler_output)
        for (start, n), part in zip(images, parts, strict=True):
            if part.shape[0] != n:
                raise ValueError(f"{self.who}: the image block ({start}, {n}) has {n} tokens but transformers' vision "
                                 f"embedder gives {part.shape[0]} soft tokens for its image")
        return torch.cat(parts)

    @contextlib.contextmanager
    def _tracing(self, rows: list[int], T: int):
        """While tracing (``self._trace`` is not None): forward hooks on the text model for one ``T``-token
        forward, yielding the dict they fill, point name -> numpy [len(rows), ...] at ``rows``; the hooks are
        removed on exit. Otherwise yields None and hooks nothing.

        A hooked tensor covers the forward's ``S`` positions, ``S == T`` or, in the KV-shared layers after
        ``_maybe_slice_kv_shared_inputs`` (integer ``logits_to_keep``), the last ``S`` (= the output rows):
        row ``r`` is at ``r - (T - S)``."""
        if self._trace is None:
            yield None
            return
        trace: dict[str, np.ndarray] = {}

        def keep(name: str, x: torch.Tensor) -> None:
            x = x.detach().reshape(-1, x.shape[-1])  # [1, S, D] (the router's indices: [S, k]) -> [S, D]
            at = torch.tensor([r - (T - x.shape[0]) for r in rows], dtype=torch.long, device=x.device)
            x = x.index_select(0, at)
            trace[name] = x.cpu().numpy() if not x.is_floating_point() else self._numpy(x)

        def on_output(name: str, pick=lambda out: out):
            return lambda module, args, out: keep(name, pick(out))

        model = self.text_model
        hooks = [model.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: keep("embed", args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True)]
        for i, layer in enumerate(model.layers[:self.text_config.num_hidden_layers]):
            p = f"layers.{i}."
            hooks += [layer.post_attention_layernorm.register_forward_hook(on_output(p + "attn_out")),
                      layer.post_feedforward_layernorm.register_forward_hook(on_output(p + "ffn_out")),
                      layer.register_forward_hook(on_output(p + "residual"))]
            if getattr(layer, "router", None) is not None:  # MoE: (probabilities, top-k weights, top-k index)
                hooks.append(layer.router.register_forward_hook(on_output(p + "router.experts", lambda out: out[2])))
            if getattr(layer, "post_per_layer_input_norm", None) is not None:  # per-layer inputs
                hooks.append(layer.post_per_layer_input_norm.register_forward_hook(on_output(p + "ple_add")))
        hooks.append(model.norm.register_forward_hook(on_output("final_norm")))
        try:
            yield trace
        finally:
            for hook in hooks:
                hook.remove()

    def _forward(self, tokens: Sequence[int], rows: list[int], state: SequenceState,
                 embeddings: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
                 audio: Sequence[tuple[int, int]] = (), audio_inputs: Sequence = (),
                 logits_to_keep: Any = None, image_inputs: Sequence = ()) -> tuple:
        """One forward of ``tokens`` continuing the cache of ``state``; returns (logits of ``rows``
        [R, V], notes: ``{"logits_to_keep": the logits_to_keep used, in JSON form}``, plus
        ``mm_token_type_ids`` (how many were passed) and ``mask_function`` (the one ``Gemma4Model.forward``
        picks with them) when they were passed). A forward with no output row still runs every layer and writes the
        cache
        (logits_to_keep = an empty index tensor). With hidden states asked, a third element: the final norm's
        output at ``rows``; with traces asked (:meth:`_tracing`), a fourth: the trace of ``rows``.

        Image blocks (``images``, with ``embeddings``): the per-layer inputs' token part is looked up at
        ``pad_token_id`` in the blocks; on an image-text model every embeddings forward of a sequence
        that holds an image token passes ``mm_token_type_ids`` from the sequence's start (decode steps,
        which come without embeddings, pass none, as ``generate`` does).

        Audio blocks (``audio``, with ``embeddings`` and ``audio_inputs``): likewise (type 3, pad row),
        and with ``audio_tower`` on, the blocks' rows of ``inputs_embeds`` are replaced by the soft tokens
        of transformers' own audio tower (:meth:`_audio_soft_tokens`); notes ``audio_soft_tokens`` (where
        they came from) and ``audio_rows_max_abs`` (max |tower - given rows|)."""
        T = len(tokens)
        id_list = [int(t) for t in tokens]
        types = self._token_types(id_list, images, audio)
        ids = torch.tensor([id_list], dtype=torch.long, device=self.device)
        if logits_to_keep is None:
            logits_to_keep, shown = self._logits_to_keep(rows, T)
        else:
            shown = logits_to_keep
        notes: dict[str, Any] = {"logits_to_keep": shown}
        kwargs: dict[str, Any] = {self._cache_kw: state.cache, "use_cache": True, "logits_to_keep": logits_to_keep}
        token_types = state.token_types + types
        if embeddings is None:
            kwargs["input_ids"] = ids
        else:
            kwargs.update(self._embeddings_kwargs(ids, embeddings, images, audio, audio_inputs, image_inputs, types,
                                                  token_types, notes))
        if self._hidden is not None:
            kwargs["output_hidden_states"] = True  # hidden_states[-1]: the final norm's output (capture_outputs)
        before = state.cache.get_seq_length()
        with self._tracing(rows, T) as trace:
            out = self.model(**kwargs)
        after = state.cache.get_seq_length()
        if after != before + T:
            raise RuntimeError(f"transformers backend: the cache holds {after} tokens after a {T}-token forward "
                               f"from {before}")
        state.token_types = token_types
        logits = out.logits[0]
        if logits.shape != (len(rows), self.vocab_size):
            raise RuntimeError(f"transformers backend: logits_to_keep={shown!r} gave logits of shape "
                               f"{tuple(logits.shape)}, expected {(len(rows), self.vocab_size)}")
        hidden = self._numpy(out.hidden_states[-1][0, rows]) if self._hidden is not None else None
        if trace is not None:
            return self._numpy(logits), notes, hidden, trace
        if hidden is not None:
            return self._numpy(logits), notes, hidden
        return self._numpy(logits), notes

    def _embeddings_kwargs(self, ids: Any, embeddings: np.ndarray, images: Sequence[tuple[int, int]],
                           audio: Sequence[tuple[int, int]], audio_inputs: Sequence, image_inputs: Sequence,
                           types: list[int], token_types: list[int], notes: dict[str, Any]) -> dict[str, Any]:
        """The model's inputs of an embeddings forward: ``inputs_embeds`` (the image and audio blocks' rows from
        transformers' own towers when they are on), the per-layer inputs' token part (the pad row at media
        positions) and ``mm_token_type_ids``; what was done goes into ``notes``."""
        kwargs: dict[str, Any] = {}
        inputs_embeds = torch.tensor(np.asarray(embeddings)[None]).to(self.device, self.torch_dtype)
        if images and self.image_tower:
            at = [start + i for start, n in images for i in range(n)]
            soft = self._image_soft_tokens(images, image_inputs)
            notes["image_soft_tokens"] = "transformers vision embedder (Gemma4UnifiedModel.get_image_features)"
            notes["image_rows_max_abs"] = float(np.abs(soft.double().cpu().numpy()
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

    def _forward_all(self, tokens: Sequence[int], state: SequenceState) -> tuple:
        """The full forward: ``logits_to_keep=0`` (all rows)."""
        return self._forward(tokens, list(range(len(tokens))), state, logits_to_keep=0)

    def _executed(self, path: str, **extra) -> dict[str, Any]:
        return {"path": path, "engine": f"transformers {transformers.__version__}, torch {torch.__version__}",
                "model": type(self.model).__name__, "layout": self.layout, "dtype": self.dtype,
                "attn_implementation": self.attn,
                "experts_implementation": getattr(self.model.config, "_experts_implementation", None),
                **({"audio_attn_implementation": self.model.config.audio_config._attn_implementation}
                   if self.audio else {}),
                "device": str(self.device), **self._device_info, "cache": "DynamicCache", "fresh_state": True,
                **extra}

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
