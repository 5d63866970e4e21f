"""refimpl.vision (the Gemma 4 vision tower + embed_vision) against Hugging Face transformers.

A tiny random ``Gemma4ForConditionalGeneration`` (vision: hidden 32, 2 layers, 2 heads, head_dim 16,
patch 4, pooling 3, table 64) is written by transformers; its image inputs come from transformers'
own ``Gemma4ImageProcessorPil`` (patch 4, pooling 3, max_soft_tokens 70, so every image is padded to
630 patches) for three image sizes processed as one batch. Each image's soft tokens from
``model.model.get_image_features`` (vision tower + embed_vision, eager attention) are compared with
``refimpl.vision.vision_tower`` on the same (padded) patches, for five towers: plain,
``standardize=True`` (26B/31B style), ``use_clipped_linears=True`` (E2B/E4B style, with finite
random bounds that do clip), head_dim 24 with grouped KV heads, and the 26B/31B head_dim 72 with
both features.

transformers in float64 still computes parts of the vision path in float32. Found in 5.24.0:

* ``Gemma4RMSNorm.forward`` ``.float()`` (every vision norm, the q/k/v norms and embed_vision's
  pre-projection norm)                              -> hf_reference.float64_exact()
* ``eager_attention_forward`` softmax ``dtype=torch.float32`` (the vision attention's eager
  path)                                             -> hf_reference.float64_exact()
* ``Gemma4VisionRotaryEmbedding.inv_freq`` / ``original_inv_freq`` buffers built with a float32
  ``arange`` and stay float32 in a float64 model    -> recomputed here in float64
* ``Gemma4VisionRotaryEmbedding.forward``: ``position_ids.float() * inv_freq.float()``
                                                    -> patched here
* ``Gemma4VisionPooler._avg_pool_by_positions``: one-hot weights ``.float()`` and
  ``hidden_states.float()`` (a float32 matmul)     -> patched here
* ``Gemma4VisionPooler.forward``: ``hidden_states.float() * root_hidden_size`` (returns float32)
                                                    -> patched here
* ``Gemma4VisionModel.forward`` standardize: ``std_bias.float()``, ``std_scale.float()``. Left
  alone: it is exact whenever the stored values are float32-representable (F32/BF16 checkpoints;
  asserted below), and the pooled input is float64 once the pooler is patched.
* ``Gemma4VisionPatchEmbedder.forward`` computes ``2 * (pixel_values - 0.5)`` in the dtype of the
  pixels it is given; the processor returns float32, so the test hands float64 pixels to transformers
  (the same values refimpl gets).
Also checked: SDPA (the vision default) is replaced by eager (SDPA in float64 measured the same,
7e-15); the bidirectional padding mask is built in the embeddings' dtype; GELUTanh and the clippable
linears compute in the input dtype. Measured effect of each float32 spot alone (the others patched):
RoPE angles 6e-7, RMSNorm + softmax 1e-6, pooling matmul 1e-7, pooler scale 8e-8, inv_freq buffer
1e-7, float32 pixels 1.5e-7.

Needs torch, transformers and pillow (the PIL image processor); those tests skip without them.

The replaced functions are copies of transformers 5.24.0 with float32 -> float64 only, pinned by the
sha256 of their source (like tests/hf_reference.py); the audited-but-unpatched ones are pinned too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json

import numpy as np
import pytest
from hf_towers import randomise_vision, recompute_vision_inv_freq, vision_float64_exact

from refimpl.errors import ConfigError, InputError, WeightsError
from refimpl.model import Trace
from refimpl.safetensors_io import write_safetensors
from refimpl.vision import (
    VisionWeights,
    expected_vision_tensors,
    load_vision_config,
    load_vision_tower,
    parse_vision_config,
    vision_tower,
    vision_tower_batch,
)

# float64 rounding through 2 layers, pooling and the projection (soft tokens up to ~2.5 in size).
# Measured worst case over the 3 images x 5 towers below: 3.8e-14 (hd72_all), 7.9e-15 (hd24_gqa),
# 9.2e-15 (clipped), 6.7e-15 (plain), 5.3e-15 (standardize). A looser bound would hide real bugs.
EXACT_BOUND = 2e-13
# transformers as shipped (float32 norms, softmax, RoPE angles, pooling inside a float64 model) vs the
# float64 oracle: measured 0.9e-6 to 2.4e-6. Each float32 spot alone is visible (1e-7 to 1e-6).
SHIPPED_BOUND = 2e-5

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64)
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=0,
            layer_types=["sliding_attention", "full_attention"])
TOKEN_IDS = dict(image_token_id=500, boi_token_id=501, eoi_token_id=502, audio_token_id=503, boa_token_id=504,
                 eoa_token_index=505, video_token_id=506)
VARIANTS = {
    "plain": {},
    "standardize": {"standardize": True},
    "clipped": {"use_clipped_linears": True},
    # head_dim 24 (6 RoPE frequencies per axis) with 3 query heads sharing 1 KV head
    "hd24_gqa": {"head_dim": 24, "num_attention_heads": 3, "num_key_value_heads": 1},
    # the 26B/31B head_dim 72 (18 frequencies per axis) with both features on
    "hd72_all": {"head_dim": 72, "standardize": True, "use_clipped_linears": True},
}
VARIANT_FLAG = {"standardize": "standardize", "clipped": "use_clipped_linears"}
# (height, width) of the random RGB images. The processor resizes (PIL bicubic) to multiples of
# 12 px within 630 patches: 84x108 px (21x27 patches, 63 soft tokens, wide), 96x96 (24x24, 64,
# upscaled square), 156x60 (39x15, 65, tall); all three padded to 630 patches in one batch.
IMAGE_SIZES = [(40, 56), (30, 30), (90, 36)]


# ----------------------------------------------------------------------------------------------
# transformers, float64 throughout (needs torch, transformers, pillow)


@pytest.fixture(scope="module")
def processed(torch_one_thread):
    """The processor's batch for IMAGE_SIZES: pixel_values [3, 630, 48] f32, image_position_ids [3, 630, 2]."""
    pytest.importorskip("PIL")
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    proc = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70)
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SIZES]
    out = proc(images=images, return_tensors="np")
    return (np.asarray(out["pixel_values"]), np.asarray(out["image_position_ids"]),
            [int(n) for n in out["num_soft_tokens_per_image"]])


@pytest.fixture(scope="module")
def checkpoints(torch_one_thread, tmp_path_factory):
    """{variant: (checkpoint dir, float64 HF model with float64 buffers)}."""
    torch, mg, _ = torch_one_thread
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    out = {}
    for seed, (variant, extra) in enumerate(VARIANTS.items()):
        cfg = Gemma4Config(text_config=dict(TEXT), vision_config={**VISION, **extra}, audio_config=None, **TOKEN_IDS)
        model = Gemma4ForConditionalGeneration(cfg)
        randomise_vision(torch, model, seed)
        path = tmp_path_factory.mktemp(f"vision_{variant}")
        model.save_pretrained(path)
        hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                            use_safetensors=True)
        hf.eval()
        assert hf.config.vision_config._attn_implementation == "eager"
        recompute_vision_inv_freq(torch, mg, hf)
        out[variant] = (path, hf)
    return out


def hf_soft_tokens(torch_one_thread, hf, pixel_values, positions, exact=True) -> list[np.ndarray]:
    """get_image_features' per-image embed_vision output, float64 pixels in."""
    torch, mg, hf_reference = torch_one_thread
    ctx = vision_float64_exact(torch, mg, hf_reference) if exact else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        out = hf.model.get_image_features(torch.from_numpy(pixel_values.astype(np.float64)),
                                          torch.from_numpy(positions.astype(np.int64)))
    return [t.numpy().astype(np.float64) for t in out.pooler_output]


@pytest.mark.hf
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vision_tower_equals_transformers_in_float64(variant, checkpoints, processed, torch_one_thread):
    path, hf = checkpoints[variant]
    pixel_values, positions, n_soft = processed
    weights, cfg = load_vision_tower(path)
    extra = VARIANTS[variant]
    assert cfg.standardize == extra.get("standardize", False)
    assert cfg.use_clipped_linears == extra.get("use_clipped_linears", False)
    if cfg.standardize:  # the unpatched .float() on these buffers is exact only for float32 values
        for name in ("model.vision_tower.std_bias", "model.vision_tower.std_scale"):
            assert np.array_equal(weights[name], weights[name].astype(np.float32))
    theirs = hf_soft_tokens(torch_one_thread, hf, pixel_values, positions)
    ours = vision_tower_batch(pixel_values, positions, weights, cfg)
    diffs = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.shape == b.shape == (n_soft[i], TEXT["hidden_size"])
        diffs.append(float(np.abs(a - b).max()))
    print(f"\n{variant}: max |refimpl - transformers| per image {IMAGE_SIZES}: " + ", ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) < EXACT_BOUND, f"{variant}: max |refimpl - transformers| per image = {diffs}"
    assert n_soft == [63, 64, 65]  # the grids named at IMAGE_SIZES
    if variant in VARIANT_FLAG:  # the feature changes the result (the bounds do clip; std is not ~identity)
        cfg_off = dataclasses.replace(cfg, **{VARIANT_FLAG[variant]: False})
        weights_off = copy.copy(weights)
        weights_off.cfg = cfg_off
        without = vision_tower(pixel_values[0], positions[0], weights_off, cfg_off)
        assert np.abs(without - theirs[0]).max() > 0.1


@pytest.mark.hf
def test_transformers_as_shipped_is_only_float32_close(checkpoints, processed, torch_one_thread):
    """Without the float64 patches transformers is visibly worse: proof the patches are in effect."""
    path, hf = checkpoints["standardize"]
    pixel_values, positions, _ = processed
    ours = vision_tower_batch(pixel_values, positions, *load_vision_tower(path))
    stock = hf_soft_tokens(torch_one_thread, hf, pixel_values, positions, exact=False)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours, stock, strict=True))
    print(f"\nstock transformers (float64 model, float32 spots) vs refimpl: {diff:.2e}")
    assert 1e3 * EXACT_BOUND < diff < SHIPPED_BOUND


@pytest.mark.hf
def test_float32_refimpl_is_float32_close(checkpoints, processed):
    path, _ = checkpoints["plain"]
    pixel_values, positions, _ = processed
    exact = vision_tower(pixel_values[0], positions[0], *load_vision_tower(path))
    low = vision_tower(pixel_values[0], positions[0], *load_vision_tower(path, "float32"))
    assert low.dtype == np.float32
    assert np.abs(exact - low).max() < 1e-4


# ----------------------------------------------------------------------------------------------
# without transformers: a synthetic checkpoint written by refimpl


def _config(**vision) -> dict:
    return {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": {"hidden_size": 24},
            "vision_config": {**VISION, **vision}}


def _write(path, raw: dict, seed: int = 0, drop: str | None = None):
    cfg = parse_vision_config(raw)
    rng = np.random.default_rng(seed)
    tensors = {name: rng.normal(0.0, 0.3, shape)
               for name, shape in expected_vision_tensors(cfg).items() if name != drop}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    write_safetensors(path / "model.safetensors", tensors, dtype="F64")
    return path


def _grid(ph: int, pw: int, pad: int = 0, seed: int = 1):
    rng = np.random.default_rng(seed)
    xs, ys = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
    pos = np.stack([xs, ys], axis=-1).reshape(-1, 2)
    pix = rng.random((ph * pw, 48))
    return np.concatenate([pix, np.zeros((pad, 48))]), np.concatenate([pos, -np.ones((pad, 2), dtype=np.int64)])


def test_padding_and_patch_order_do_not_change_the_soft_tokens(tmp_path):
    weights, cfg = load_vision_tower(_write(tmp_path / "c", _config(standardize=True)))
    pix, pos = _grid(6, 9)
    trace = Trace()
    base = vision_tower(pix, pos, weights, cfg, trace=trace)
    assert base.shape == (6, 24) and trace.tensors["pooled"].shape == (6, 32)
    padded_pix, padded_pos = _grid(6, 9, pad=27)
    assert np.array_equal(vision_tower(padded_pix, padded_pos, weights, cfg), base)
    perm = np.random.default_rng(3).permutation(len(pos))  # attention and pooling by position are order-free
    assert np.abs(vision_tower(pix[perm], pos[perm], weights, cfg) - base).max() < 1e-13


def test_bad_inputs_are_clear_errors(tmp_path):
    weights, cfg = load_vision_tower(_write(tmp_path / "c", _config()))
    pix, pos = _grid(3, 6)
    with pytest.raises(InputError, match=r"\[N, 48\]"):
        vision_tower(pix[:, :47], pos, weights, cfg)
    bad = pos.copy()
    bad[4] = (-1, 2)
    with pytest.raises(InputError, match="only \\(-1, -1\\) marks a padding patch"):
        vision_tower(pix, bad, weights, cfg)
    with pytest.raises(InputError, match="exactly once"):
        vision_tower(pix[:-1], pos[:-1], weights, cfg)
    pix4, pos4 = _grid(3, 4)
    with pytest.raises(InputError, match="multiples of the pooling kernel 3"):
        vision_tower(pix4, pos4, weights, cfg)
    with pytest.raises(InputError, match="every patch is padding"):
        vision_tower(pix, -np.ones_like(pos), weights, cfg)


def test_config_and_weight_errors(tmp_path):
    with pytest.raises(ConfigError, match="no 'vision_config'"):
        parse_vision_config({"text_config": {"hidden_size": 8}})
    with pytest.raises(ConfigError, match="'head_dim' 18 is not a multiple of 4"):
        parse_vision_config(_config(head_dim=18))
    with pytest.raises(ConfigError, match="rope_type"):
        parse_vision_config(_config(rope_parameters={"rope_type": "yarn", "rope_theta": 100.0}))
    raw = _config()
    del raw["vision_config"]["patch_size"]
    with pytest.raises(ConfigError, match="'patch_size' is missing"):
        parse_vision_config(raw)
    old = parse_vision_config(_config(rope_parameters={"rope_type": "default", "rope_theta": 100.0}))
    assert old.rope_theta == 100.0 and old == parse_vision_config(_config())
    path = _write(tmp_path / "m", _config(), drop="model.vision_tower.encoder.layers.1.self_attn.k_norm.weight")
    with pytest.raises(WeightsError, match="missing tensor 'model.vision_tower.encoder.layers.1.self_attn.k_norm"):
        VisionWeights(path, load_vision_config(path))
    path = _write(tmp_path / "s", _config(standardize=True))
    (path / "config.json").write_text(json.dumps(_config()))
    with pytest.raises(WeightsError, match="standardize buffers"):
        load_vision_tower(path)
