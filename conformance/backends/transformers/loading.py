"""Loading a Gemma 4 checkpoint into transformers for the transformers backend (and tests/hf_reference.py).

Both checkpoint layouts load (:func:`checkpoint_layout`): ``Gemma4ForCausalLM`` (tensors ``model.*``) and
``Gemma4ForConditionalGeneration`` (config under ``text_config``, tensors ``model.language_model.*``; without a
``vision_config`` or ``audio_config`` only the text model is built, with one the whole image-text / audio-text
model); Gemma 4 Unified as ``Gemma4Unified{ForConditionalGeneration,ForCausalLM}``.
:func:`load_gemma4_causal_lm`, :func:`load_gemma4_conditional_generation` and :func:`load_gemma4_unified` are the
loaders; every weight must come from the checkpoint (a silently random-initialised model is refused). They load
safetensors only (``use_safetensors=True``; a directory with only a pickled ``pytorch_model.bin`` is refused:
unpickling can run code), see docs/backends.md, "Security". :func:`resolve_device` maps the ``device`` option.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4UnifiedForCausalLM,
    Gemma4UnifiedForConditionalGeneration,
)

from refimpl.errors import check_choice, choice_message

from ...protocol.types import BackendError

__all__ = ["DEVICES", "DTYPES", "WHO", "checkpoint_layout", "has_audio", "has_vision", "is_unified",
           "load_gemma4_causal_lm", "load_gemma4_conditional_generation", "load_gemma4_unified", "resolve_device"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")
CONDITIONAL_KEY_MAPPING = {r"^model\.language_model\.": "model."}

WHO = "transformers backend"  # how its messages name it


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
