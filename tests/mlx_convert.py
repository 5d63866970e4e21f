"""An MLX quantised checkpoint made from a synthetic preset by mlx-lm's own quantiser, as ``mlx_lm.convert -q``
makes one: the checkpoint loaded with mlx-lm (``load_model``, with the config keys mlx-lm reads as the mlx-lm
backend hands them), ``quantize_model`` (mlx-lm's Gemma 4 predicate, or a mixed recipe), ``save_model``, and
config.json with the ``quantization`` block ``quantize_model`` returns (its other keys the checkpoint's own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

mlx_lm_utils = pytest.importorskip("mlx_lm.utils", reason="mlx-lm is not installed (the 'mlx' extra)")


def quantise(model_dir: Path, out: Path, bits: int, group_size: int, recipe: str | None = None,
             dtype: str | None = None, mode: str = "affine") -> Path:
    """``model_dir`` quantised at ``bits`` / ``group_size`` (``recipe``: mlx-lm's mixed_3_6 and the like; ``mode``:
    mlx's affine, mxfp4, nvfp4 or mxfp8, as ``convert --q-mode``) into ``out``; ``dtype`` (float16, bfloat16):
    every float parameter cast first, as ``convert --dtype``."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.convert import mixed_quant_predicate_builder

    from conformance.backends.mlx_lm.backend import _model_config, config_patch
    from refimpl import load_config

    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model, _ = mlx_lm_utils.load_model(model_dir, model_config=_model_config(raw, config_patch(raw,
                                                                                                load_config(model_dir))))
    if dtype is not None:
        target = getattr(mx, dtype)
        model.update(tree_map_with_path(lambda k, v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v,
                                        model.parameters()))
    predicate = None if recipe is None else mixed_quant_predicate_builder(recipe, model, group_size)
    model, config = mlx_lm_utils.quantize_model(model, dict(raw), group_size, bits, mode=mode,
                                                quant_predicate=predicate)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    mlx_lm_utils.save_model(out, model)
    for f in model_dir.iterdir():
        if f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return out


def quantise_vlm(model_dir: Path, out: Path, bits: int, group_size: int, recipe: str | None = None) -> Path:
    """``model_dir`` quantised as ``mlx_vlm.convert -q`` quantises it (``quantize_model`` with convert's own
    predicate, or a mixed recipe: conformance/backends/mlx_vlm/quantise.py) into ``out``: loaded by mlx-vlm
    through the mlx-vlm backend's config view (as the backend loads it), ``save_weights``, and config.json with
    the ``quantization`` block (its other keys the checkpoint's own). The names are mlx-vlm's
    (``language_model.model.X``, ``vision_tower.X``, ``embed_vision.X``, ...), the audio tower's convolutions in
    MLX's layout."""
    from mlx_vlm.utils import load_model, save_weights

    from conformance.backends.mlx_vlm.config import checkpoint_view, config_patch, remove_view
    from conformance.backends.mlx_vlm.families import family_for
    from conformance.backends.mlx_vlm.quantise import quantized
    from refimpl import load_config

    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    patch = config_patch(raw, load_config(model_dir), family_for(raw, str(model_dir)).model_type)
    view = checkpoint_view(model_dir, raw, patch) if patch else None
    try:
        model = load_model(view or model_dir)
    finally:
        remove_view(view)
    model, config = quantized(model, raw, recipe if recipe is not None else bits, group_size)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_weights(out, model)
    for f in model_dir.iterdir():
        if f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return out
