"""What mlx-vlm reads from a checkpoint's config.json, against what the config means (refimpl's derivation),
and the checkpoint view that hands mlx-vlm the difference.

mlx-vlm builds its models from dataclass configs with defaults of their own (``TextConfig`` of
``mlx_vlm.models.gemma4.config`` and ``ModelConfig`` of ``mlx_vlm.models.gemma4_text.config``:
``use_double_wide_mlp=True``, ``num_kv_shared_layers=20``, a 4:1 ``layer_types`` pattern, a 30.0 softcap,
the legacy ``global_head_dim`` / ``num_global_key_value_heads`` only, ...). :func:`config_patch` derives
every key mlx-vlm reads from a ``refimpl.config.TextConfig`` and lists those the checkpoint lacks or
states in a form mlx-vlm reads differently. Unlike mlx-lm, mlx-vlm's ``load_model`` takes no config
override, so :func:`checkpoint_view` writes the patched config.json into a temporary directory next to
links to the checkpoint's other files (the checkpoint itself is never written), and mlx-vlm's own
loader reads that directory.

For Gemma 4 Unified (``gemma4_unified``) the embedders' keys are derived too (:func:`unified_tower_keys`):
mlx-vlm's ``VisionConfig`` does not derive ``model_patch_size`` from ``patch_size x pooling_kernel_size``
(its default is 48) and sizes both projections by ``output_proj_dims`` (default 3840 and 640), where
the model (and refimpl) take ``mm_embed_dim`` and ``audio_embed_dim``.

One top-level key is patched as well: an explicit ``"vision_config": null`` (an audio-text checkpoint).
``mlx_vlm.utils.load_model`` fills an absent ``vision_config`` with ``{}`` (``setdefault``) but keeps an
explicit null, and ``mlx_vlm.models.gemma4.Model`` then fails building its vision tower from None
(``AttributeError: 'NoneType' object has no attribute 'model_type'``). The view drops the key, so
mlx-vlm builds its default vision tower, which holds no checkpoint weight and which mlx-vlm's loader then
disables itself (``_drop_modules_without_weights``: "Checkpoint has no weights for module(s):
vision_tower, embed_vision").
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from refimpl.legacy_keys import legacy_text_keys
from refimpl.unified import parse_unified_audio_config, parse_unified_vision_config

from ..mlx_common import ABSENT, same, text_key_patch

__all__ = ["ABSENT", "checkpoint_view", "config_patch", "mlx_vlm_text_keys", "patched_config", "remove_view", "same",
           "unified_tower_keys"]

_MISSING = object()


def mlx_vlm_text_keys(cfg, family: str) -> dict[str, Any]:
    """The value of every text-config key mlx-vlm's ``family`` ("gemma4_text" or "gemma4") reads,
    derived from a ``refimpl.config.TextConfig`` (which resolves both serialisations and every default):
    the legacy serialisation's keys (``refimpl.legacy_keys.legacy_text_keys``, as for mlx-lm), and for the
    conditional model the vision-block switch. Geometry it cannot express is caught after loading."""
    keys = legacy_text_keys(cfg)
    if family == "gemma4":  # only the conditional model's text config has the vision-block switch
        keys["use_bidirectional_attention"] = cfg.use_bidirectional_attention
    return keys


def unified_tower_keys(raw: dict) -> dict[str, Any]:
    """The embedder keys mlx-vlm's ``gemma4_unified`` configs read, as ``{"<top>.SECTION.KEY": value}``,
    derived with ``refimpl.unified`` (only for the towers the checkpoint has)."""
    keys: dict[str, Any] = {}
    if isinstance(raw.get("vision_config"), dict):
        v = parse_unified_vision_config(raw)
        keys.update({"<top>.vision_config.patch_size": v.patch_size,
                     "<top>.vision_config.pooling_kernel_size": v.pooling_kernel_size,
                     "<top>.vision_config.model_patch_size": v.model_patch_size,
                     "<top>.vision_config.mm_embed_dim": v.mm_embed_dim,
                     "<top>.vision_config.mm_posemb_size": v.mm_posemb_size,
                     "<top>.vision_config.output_proj_dims": v.mm_embed_dim,
                     "<top>.vision_config.rms_norm_eps": v.rms_norm_eps})
    if isinstance(raw.get("audio_config"), dict):
        a = parse_unified_audio_config(raw)
        keys.update({"<top>.audio_config.audio_embed_dim": a.audio_embed_dim,
                     "<top>.audio_config.output_proj_dims": a.audio_embed_dim,
                     "<top>.audio_config.rms_norm_eps": a.rms_norm_eps})
    return keys


def _lookup(raw: dict, path: list[str]) -> Any:
    node: Any = raw
    for name in path:
        if not isinstance(node, dict) or name not in node:
            return _MISSING
        node = node[name]
    return node


def config_patch(raw: dict, cfg, family: str) -> dict[str, dict[str, Any]]:
    """The keys to hand mlx-vlm so it builds the model refimpl derives from ``raw`` (a parsed config.json)
    and ``cfg`` (its ``TextConfig``), for mlx-vlm's model ``family``.

    Returns ``{key: {"was": value or "absent", "now": derived value or "absent"}}``: keys of the text
    section are plain names, top-level keys of the conditional layout ``"<top>.KEY"``. A key is patched
    when config.json lacks it or states it in a form mlx-vlm reads differently (``per_layer_config``
    instead of the legacy keys; a last layer that is not full attention, which transformers and refimpl
    force to full), ``<top>.vision_config`` when it is an explicit null, and for ``gemma4_unified`` the
    embedder keys ``<top>.vision_config.KEY`` / ``<top>.audio_config.KEY`` (see the module docstring).
    """
    conditional = isinstance(raw.get("text_config"), dict)
    text = raw["text_config"] if conditional else raw
    text_family = "gemma4" if family == "gemma4_unified" else family  # Unified's TextConfig is gemma4's
    # mlx-vlm reads a rope entry's "type" too; its use_bidirectional_attention defaults to None, like the spec's
    patch = text_key_patch(text, mlx_vlm_text_keys(cfg, text_family), type_keys=("type", "rope_type"),
                           defaults={"use_bidirectional_attention": None})
    if conditional and "vision_config" in raw and raw["vision_config"] is None:
        patch["<top>.vision_config"] = {"was": None, "now": ABSENT}
    if family == "gemma4_unified":
        for key, want in unified_tower_keys(raw).items():
            have = _lookup(raw, key.removeprefix("<top>.").split("."))
            if have is _MISSING or not same(have, want):
                patch[key] = {"was": ABSENT if have is _MISSING else have, "now": want}
    return patch


def patched_config(raw: dict, patch: dict[str, dict[str, Any]]) -> dict:
    """config.json with ``patch`` applied (a new dict; ``raw`` is not changed)."""
    out = json.loads(json.dumps(raw))
    text = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    for key, change in patch.items():
        if key.startswith("<top>."):
            *parents, name = key.removeprefix("<top>.").split(".")
            target = out
            for parent in parents:
                target = target[parent]
        else:
            target, name = text, key
        if change["now"] == ABSENT:
            target.pop(name, None)
        else:
            target[name] = change["now"]
    return out


def checkpoint_view(model_dir: Path, raw: dict, patch: dict[str, dict[str, Any]]) -> Path:
    """A new temporary directory that mlx-vlm's loader reads as the checkpoint: the patched config.json
    and a symbolic link to every other file of ``model_dir``. The caller removes it (``remove_view``)."""
    view = Path(tempfile.mkdtemp(prefix="gemma4-conformance-mlx-vlm-view-"))
    for entry in sorted(Path(model_dir).iterdir()):
        if entry.name != "config.json":
            os.symlink(entry.resolve(), view / entry.name)
    (view / "config.json").write_text(json.dumps(patched_config(raw, patch), indent=2) + "\n", encoding="utf-8")
    return view


def remove_view(view: Path | None) -> None:
    """Remove a directory made by :func:`checkpoint_view` (its links and config.json, never their targets)."""
    if view is None or not view.is_dir():
        return
    for entry in view.iterdir():
        entry.unlink()
    view.rmdir()
