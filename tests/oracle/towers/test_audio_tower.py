"""refimpl.audio (the Gemma 4 audio tower + embed_audio) against Hugging Face transformers.

Tiny random ``Gemma4ForConditionalGeneration`` checkpoints (audio: hidden 32, 2 layers, 2 heads,
subsampling channels (16, 8) so 16 mel bins, light-conv kernel 5, output_proj_dims 24; text hidden
64) are written by transformers. Three clips of T = 41 mel frames (11 tokens after subsampling: not
a multiple of the chunk) go through ``model.model.get_audio_features`` as one batch: one fully
valid, one with 11 masked tail frames, one with a masked hole in the middle. The rows transformers
keeps (``pooler_output[audio_outputs.attention_mask]``, what ``Gemma4Model.forward`` scatters) are
compared with ``refimpl.audio.audio_tower`` for three towers:

* ``plain``: chunk 4, context_left 5 (the shipped W + R == L relation), rms_norm_eps 1e-3 (so the
  norms hard-wired to 1e-6 and those using rms_norm_eps are told apart), q/k weights large enough
  that the logit cap 50 bites (|logits| up to ~400 before the cap, asserted).
* ``clipped``: use_clipped_linears with finite random bounds that do clip.
* ``context``: chunk 3, context_left 6, context_right 2, cap 5: future keys, W + R != L (the
  relative-position quirk), another cap.

transformers 5.24 in float64 still computes parts of the audio path in float32. Found:

* ``Gemma4RMSNorm.forward`` ``.float()`` (every conformer norm and embed_audio's pre-projection
  norm)                                             -> hf_reference.float64_exact()
* ``Gemma4AudioAttention.forward``: ``q_proj(...).float()``, ``k_proj(...).float()``,
  ``v_proj(...).float()`` and ``F.softmax(..., dtype=torch.float32)`` -> patched here (a copy with
  float64). Unpatched, a float64 model does not even run: the float32 queries times the float64
  ``softplus(per_dim_scale)`` become float64 while the keys stay float32, and the matmul raises
  "expected scalar type Float but found Double" (asserted below).
* ``Gemma4AudioRelPositionalEncoding.inv_timescales`` and ``Gemma4AudioAttention.softcap`` are
  non-persistent buffers made in the default dtype at construction; ``from_pretrained(dtype=
  float64)`` builds them in float64 (asserted equal to a float64 recomputation / the config value).
Checked and left alone: the subsampling casts to the conv weight dtype and its LayerNorm, the
clamps (``finfo`` of the working dtype), the causal conv, GLU, SiLU, the clippable linears, the
mask (``create_bidirectional_mask`` in the embeddings' dtype, ``finfo(float64).min`` padding) and
the embedder compute in the input dtype. These are pinned by sha256 of their source like the copy.

"As shipped" is therefore a float32 transformers model (the only dtype it runs the audio tower in
besides bf16), compared with the float64 oracle at a float32-scale bound.

Needs torch and transformers; those tests skip without them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json

import numpy as np
import pytest
from hf_towers import AUDIO_RAW_LOGITS, audio_float64_exact, randomise_audio, recompute_audio_buffers

import refimpl.audio as audio_mod
from refimpl.audio import (
    AudioWeights,
    audio_tower,
    expected_audio_tensors,
    load_audio_config,
    load_audio_tower,
    num_soft_tokens,
    parse_audio_config,
)
from refimpl.errors import ConfigError, InputError, WeightsError
from refimpl.model import Trace
from refimpl.safetensors_io import write_safetensors

# float64 rounding through subsampling, 2 conformer layers and the projections (soft tokens |y| up to ~3.3).
# The soft tokens come out of ~30 chained products (subsampling convolutions of up to 144 terms, per layer
# projections and FFN products of 32 to 128 terms, attention over at most 12 keys, the output
# projections), each adding about sqrt(n) u |y| (u = 1.1e-16) when the roundings do not line up: about
# 30 * 8 * 1.1e-16 * 3.3 = 9e-14 per implementation, in whatever order its BLAS sums. Measured worst case
# over the 3 clips (27 soft tokens) per tower, across OpenBLAS's SkylakeX, Haswell (= Zen), Sandybridge and
# Prescott kernels and torch's AVX-512, AVX2 and default CPU code: 1.4e-14 (plain), 2.9e-14 (clipped, Haswell
# kernels), 9.8e-15 (context). 1e-13 is 3.5x that and within the estimate; the smallest real defects
# looked for here (a norm's eps, a float32 spot) are 1e-4 and 1e-7.
EXACT_BOUND = 1e-13
# transformers in float32 (as shipped) vs the float64 oracle: measured 3.3e-6 on the plain tower.
SHIPPED_BOUND = 3e-5

N_MELS = 16
T_FRAMES = 41
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[16, 8],
             conv_kernel_size=5, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
             output_proj_dims=24, use_clipped_linears=False, rms_norm_eps=1e-3)
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=0,
            layer_types=["sliding_attention", "full_attention"])
TOKEN_IDS = dict(image_token_id=500, boi_token_id=501, eoi_token_id=502, audio_token_id=503, boa_token_id=504,
                 eoa_token_index=505, video_token_id=506)
VARIANTS = {
    "plain": {},
    "clipped": {"use_clipped_linears": True},
    "context": {"attention_chunk_size": 3, "attention_context_left": 6, "attention_context_right": 2,
                "attention_logit_cap": 5.0},
}


def _masks() -> np.ndarray:
    m = np.ones((3, T_FRAMES), dtype=bool)
    m[1, 30:] = False  # masked tail: tokens 0..7 of 11 kept
    m[2, 9:22] = False  # a hole: tokens 3, 4, 5 dropped
    return m


# ----------------------------------------------------------------------------------------------
# transformers, float64 throughout (needs torch, transformers)




@pytest.fixture(scope="module")
def checkpoints(torch_one_thread, tmp_path_factory):
    """{variant: (checkpoint dir, float64 HF model)}."""
    torch, mg, _ = torch_one_thread
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    out = {}
    for seed, (variant, extra) in enumerate(VARIANTS.items()):
        cfg = Gemma4Config(text_config=dict(TEXT), vision_config=None, audio_config={**AUDIO, **extra}, **TOKEN_IDS)
        model = Gemma4ForConditionalGeneration(cfg)
        randomise_audio(torch, model, seed)
        path = tmp_path_factory.mktemp(f"audio_{variant}")
        model.save_pretrained(path)
        hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float64, use_safetensors=True)
        hf.eval()
        assert hf.config.audio_config._attn_implementation == "eager"
        recompute_audio_buffers(torch, mg, hf)
        out[variant] = (path, hf)
    return out


@pytest.fixture(scope="module")
def features():
    """[3, T, 16] log-mel-like features (masked frames zero, as the feature extractor leaves them), mask [3, T]."""
    rng = np.random.default_rng(7)
    x = rng.normal(-2.0, 1.5, (3, T_FRAMES, N_MELS))
    mask = _masks()
    return x * mask[..., None], mask


def hf_soft_tokens(torch_one_thread, hf, x, mask, exact=True) -> np.ndarray:
    """The rows Gemma4Model.forward keeps: get_audio_features(...).pooler_output[attention_mask]."""
    torch, mg, hf_reference = torch_one_thread
    ctx = audio_float64_exact(torch, mg, hf_reference) if exact else contextlib.nullcontext()
    dtype = next(hf.parameters()).dtype
    with torch.no_grad(), ctx:
        out = hf.model.get_audio_features(torch.from_numpy(x).to(dtype), torch.from_numpy(mask))
    kept = out.pooler_output[out.attention_mask]
    return kept.to(torch.float64).numpy()


@pytest.mark.hf
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_audio_tower_equals_transformers_in_float64(variant, checkpoints, features, torch_one_thread):
    path, hf = checkpoints[variant]
    x, mask = features
    weights, cfg = load_audio_tower(path)
    extra = VARIANTS[variant]
    assert cfg.use_clipped_linears == extra.get("use_clipped_linears", False)
    assert cfg.attention_chunk_size == extra.get("attention_chunk_size", 4)
    AUDIO_RAW_LOGITS.clear()
    theirs = hf_soft_tokens(torch_one_thread, hf, x, mask)
    raw_logit = max(AUDIO_RAW_LOGITS)
    ours = audio_tower(x, mask, weights, cfg)
    assert ours.shape == theirs.shape == (num_soft_tokens(mask), TEXT["hidden_size"]) == (11 + 8 + 8, 64)
    diff = float(np.abs(ours - theirs).max())
    print(f"\n{variant}: max |refimpl - transformers| = {diff:.2e} (|soft tokens| up to {np.abs(theirs).max():.2f}; "
          f"max |logit| before the cap {raw_logit:.0f}, cap {cfg.attention_logit_cap})")
    assert diff < EXACT_BOUND
    if not cfg.use_clipped_linears:  # (the clip bounds keep q, k and so the logits small)
        assert raw_logit > 2 * cfg.attention_logit_cap  # the cap bites
    # per clip equals the batch (the batch rows are the clips' rows in order). Not bit for bit: one clip's
    # matrices have fewer rows than the batch's, so BLAS blocks (and rounds) the products differently
    # depending on the kernel (measured: identical with OpenBLAS's SkylakeX kernels, up to 1.3e-15 with its
    # Haswell, Zen or Prescott ones). Float64 rounding of the same tower, so the EXACT_BOUND above;
    # a clip leaking into another or rows out of order are off by more than 0.05 (the wrong variants below).
    rows = np.cumsum([0] + [num_soft_tokens(m) for m in mask])
    for b in range(3):
        assert np.abs(audio_tower(x[b], mask[b], weights, cfg) - ours[rows[b]:rows[b + 1]]).max() < EXACT_BOUND

    # wrong variants are far off
    def off(**change) -> float:
        cfg2 = dataclasses.replace(cfg, **change)
        w2 = copy.copy(weights)
        w2.cfg = cfg2
        return float(np.abs(audio_tower(x, mask, w2, cfg2) - theirs).max())

    # The blocking itself is invisible: the mask depends on q - k only, so another chunk size changes the
    # result only through the relative table's C // 2 (C = W + L + R). W + 1 keeps C // 2 here (C is even).
    W, C = cfg.attention_chunk_size, cfg.context_size
    assert C % 2 == 0 and off(attention_chunk_size=W + 1) < EXACT_BOUND
    wrong = {"chunk - 1": off(attention_chunk_size=W - 1),
             "chunk + 2": off(attention_chunk_size=W + 2),
             "context_left + 1": off(attention_context_left=cfg.attention_context_left + 1),
             "context_left - 1": off(attention_context_left=cfg.attention_context_left - 1)}
    if raw_logit > 2 * cfg.attention_logit_cap:
        wrong["no logit cap"] = off(attention_logit_cap=1e300)
    if cfg.attention_context_right:
        wrong["no right context"] = off(attention_context_right=0)
    if cfg.use_clipped_linears:
        wrong["no clipping"] = off(use_clipped_linears=False)
    print("  wrong variants: " + ", ".join(f"{k} {v:.2f}" for k, v in wrong.items()))
    assert min(wrong.values()) > 0.05, wrong


@pytest.mark.hf
def test_trap24_mask_and_norm_eps_matter(checkpoints, features, torch_one_thread, monkeypatch):
    """Admitting the farthest context key (q - k == L, the possible USM off-by-one) or using
    rms_norm_eps in the norms that transformers hard-wires to 1e-6 are both visibly wrong."""
    path, hf = checkpoints["plain"]
    x, mask = features
    weights, cfg = load_audio_tower(path)
    theirs = hf_soft_tokens(torch_one_thread, hf, x, mask)
    original = audio_mod.local_attention_mask

    def one_more_key(valid, cfg):
        widened = dataclasses.replace(cfg, attention_context_left=cfg.attention_context_left + 1)
        return original(valid, widened)[..., 1:]  # same blocks, window dist <= L

    monkeypatch.setattr(audio_mod, "local_attention_mask", one_more_key)
    assert np.abs(audio_tower(x, mask, weights, cfg) - theirs).max() > 0.05
    monkeypatch.setattr(audio_mod, "local_attention_mask", original)
    monkeypatch.setattr(audio_mod, "FIXED_NORM_EPS", cfg.rms_norm_eps)
    assert np.abs(audio_tower(x, mask, weights, cfg) - theirs).max() > 1e-4


@pytest.mark.hf
def test_transformers_as_shipped(checkpoints, features, torch_one_thread):
    """Stock transformers cannot run the audio tower in float64; in float32 it is only float32-close."""
    torch, _, _ = torch_one_thread
    from transformers import Gemma4ForConditionalGeneration

    path, hf = checkpoints["plain"]
    x, mask = features
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Double"):
        hf_soft_tokens(torch_one_thread, hf, x, mask, exact=False)
    hf32 = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    hf32.eval()
    stock = hf_soft_tokens(torch_one_thread, hf32, x.astype(np.float32), mask, exact=False)
    ours = audio_tower(x.astype(np.float32).astype(np.float64), mask, *load_audio_tower(path))
    diff = float(np.abs(ours - stock).max())
    print(f"\nstock transformers (float32) vs refimpl float64: {diff:.2e}")
    assert 1e-7 < diff < SHIPPED_BOUND  # float32-scale, and far from the float64 agreement


@pytest.mark.hf
def test_float32_refimpl_is_float32_close(checkpoints, features):
    path, _ = checkpoints["clipped"]
    x, mask = features
    exact = audio_tower(x, mask, *load_audio_tower(path))
    low = audio_tower(x, mask, *load_audio_tower(path, "float32"))
    assert low.dtype == np.float32
    assert 1e-9 < np.abs(exact - low).max() < SHIPPED_BOUND


# ----------------------------------------------------------------------------------------------
# without transformers: a synthetic checkpoint written by refimpl


def _config(**audio) -> dict:
    return {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": {"hidden_size": 24},
            "audio_config": {**AUDIO, **audio}}


def _write(path, raw: dict, seed: int = 0, drop: str | None = None):
    cfg = parse_audio_config(raw)
    rng = np.random.default_rng(seed)
    tensors = {name: rng.normal(0.0, 0.3, shape) for name, shape in expected_audio_tensors(cfg).items() if name != drop}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    write_safetensors(path / "model.safetensors", tensors, dtype="F64")
    return path


def test_trailing_padding_does_not_change_the_soft_tokens(tmp_path):
    weights, cfg = load_audio_tower(_write(tmp_path / "c", _config()))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(26, N_MELS))
    trace = Trace()
    base = audio_tower(x, np.ones(26, bool), weights, cfg, trace=trace)
    assert base.shape == (7, 24) and trace.tensors["layers.1"].shape == (7, 32)
    assert trace.tensors["output_proj"].shape == (7, 24)
    padded = np.concatenate([x, np.zeros((15, N_MELS))])
    pmask = np.arange(41) < 26
    assert np.abs(audio_tower(padded, pmask, weights, cfg) - base).max() < 1e-13  # rounding only
    assert audio_tower(padded, pmask.astype(np.int64), weights, cfg).shape == (7, 24)


def test_bad_inputs_are_clear_errors(tmp_path):
    weights, cfg = load_audio_tower(_write(tmp_path / "c", _config()))
    x, mask = np.zeros((20, N_MELS)), np.ones(20, bool)
    with pytest.raises(InputError, match=r"features have 12 mel bins; .* so F must be in \[13, 16\]"):
        audio_tower(x[:, :12], mask, weights, cfg)
    with pytest.raises(InputError, match=r"features must be a float array \[T, F\] \(one clip\) or \[B, T, F\]"):
        audio_tower(x[0], mask, weights, cfg)
    with pytest.raises(InputError, match=r"features must be a float array"):
        audio_tower(x.astype(np.int64), mask, weights, cfg)
    with pytest.raises(InputError, match=r"mask must have shape \[20\] .* got \[19\]"):
        audio_tower(x, mask[:19], weights, cfg)
    with pytest.raises(InputError, match=r"mask must have shape \[2, 20\]"):
        audio_tower(np.stack([x, x]), mask, weights, cfg)
    with pytest.raises(InputError, match="mask must be boolean"):
        audio_tower(x, mask * 0.5, weights, cfg)
    with pytest.raises(InputError, match=r"no frames \(T = 0\)"):
        audio_tower(x[:0], mask[:0], weights, cfg)
    bad = x.copy()
    bad[3, 2] = np.nan
    with pytest.raises(InputError, match="NaN or infinite"):
        audio_tower(bad, mask, weights, cfg)
    assert audio_tower(x, np.zeros(20, bool), weights, cfg).shape == (0, 24)  # no valid frame: no token


def test_config_and_weight_errors(tmp_path):
    with pytest.raises(ConfigError, match="no 'audio_config'; this checkpoint has no audio tower"):
        parse_audio_config({"text_config": {"hidden_size": 8}, "audio_config": None})
    with pytest.raises(ConfigError, match="'text_config' must be an object"):
        parse_audio_config({"audio_config": AUDIO})
    with pytest.raises(ConfigError, match="'hidden_size' 30 is not divisible by 'num_attention_heads' 4"):
        parse_audio_config(_config(hidden_size=30, num_attention_heads=4))
    with pytest.raises(ConfigError, match="'hidden_size' 33 is odd"):
        parse_audio_config(_config(hidden_size=33, num_attention_heads=3))
    with pytest.raises(ConfigError, match=r"'subsampling_conv_channels' must be two positive integers \[C0, C1\]"):
        parse_audio_config(_config(subsampling_conv_channels=[16, 8, 4]))
    with pytest.raises(ConfigError, match="C0 must be at least 4"):
        parse_audio_config(_config(subsampling_conv_channels=[2, 8]))
    with pytest.raises(ConfigError, match="'hidden_act' is 'gelu'"):
        parse_audio_config(_config(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="'attention_chunk_size' must be positive, got 0"):
        parse_audio_config(_config(attention_chunk_size=0))
    with pytest.raises(ConfigError, match="'attention_context_right' must be >= 0, got -1"):
        parse_audio_config(_config(attention_context_right=-1))
    with pytest.raises(ConfigError, match="'attention_logit_cap' must be a positive number, got 0.0"):
        parse_audio_config(_config(attention_logit_cap=0))
    with pytest.raises(ConfigError, match="'attention_invalid_logits_value' must be negative"):
        parse_audio_config(_config(attention_invalid_logits_value=0.0))
    with pytest.raises(ConfigError, match="field 'use_clipped_linears' must be bool"):
        parse_audio_config(_config(use_clipped_linears="yes"))
    raw = _config()
    del raw["audio_config"]["output_proj_dims"]
    with pytest.raises(ConfigError, match="required field 'output_proj_dims' is missing"):
        parse_audio_config(raw)
    raw = _config()
    for key in ("attention_chunk_size", "attention_context_left", "attention_context_right", "rms_norm_eps",
                "use_clipped_linears"):
        del raw["audio_config"][key]
    shipped = parse_audio_config(raw)  # transformers' defaults
    assert (shipped.attention_chunk_size, shipped.max_past, shipped.context_size, shipped.num_rel_positions) \
        == (12, 12, 24, 13)
    assert shipped.use_clipped_linears and shipped.rms_norm_eps == 1e-6 and shipped.attention_logit_cap == 50.0

    name = "model.audio_tower.layers.1.self_attn.relative_k_proj.weight"
    path = _write(tmp_path / "m", _config(), drop=name)
    with pytest.raises(WeightsError, match=f"missing tensor '{name}' \\(expected shape \\[32, 32\\]\\)"):
        AudioWeights(path, load_audio_config(path))
    path = _write(tmp_path / "c", _config(use_clipped_linears=True))
    (path / "config.json").write_text(json.dumps(_config()))
    with pytest.raises(WeightsError, match="clip bounds, but the config sets use_clipped_linears to false"):
        load_audio_tower(path)
    path = _write(tmp_path / "s", _config(conv_kernel_size=3))
    (path / "config.json").write_text(json.dumps(_config()))
    with pytest.raises(WeightsError, match=r"tensor 'model.audio_tower.layers.0.lconv1d.depthwise_conv1d.weight' "
                                           r"has shape \[32, 1, 3\], expected \[32, 1, 5\]"):
        load_audio_tower(path)
    with pytest.raises(InputError, match="dtype must be float64 or float32"):
        load_audio_tower(path, "float16")
