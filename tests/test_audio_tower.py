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
import math

import numpy as np
import pytest

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


def _audio_patches(torch, mg):
    """(owner, attribute, original, float64 replacement, sha256 of the original in transformers 5.24.0)."""
    F64 = torch.float64
    F = torch.nn.functional
    orig_attn = mg.Gemma4AudioAttention.forward

    def audio_attention_forward_f64(self, hidden_states, position_embeddings, attention_mask=None):
        # Original: q/k/v_proj(...).float() and F.softmax(attn_weights, dim=-1, dtype=torch.float32).
        if hidden_states.dtype != F64:
            return orig_attn(self, hidden_states, position_embeddings, attention_mask)
        batch_size, seq_length, _ = hidden_states.shape
        hidden_shape = (batch_size, seq_length, self.num_heads, self.head_dim)

        query_states = self.q_proj(hidden_states).to(F64).view(hidden_shape)
        key_states = self.k_proj(hidden_states).to(F64).view(hidden_shape)
        value_states = self.v_proj(hidden_states).to(F64).view(hidden_shape)

        query_states = query_states * self.q_scale * F.softplus(self.per_dim_scale)
        key_states = key_states * self.k_scale

        query_states = self._convert_to_block(query_states)
        key_states = self._extract_block_context(key_states)
        value_states = self._extract_block_context(value_states)
        num_blocks = query_states.shape[1]

        relative_key_states = self.relative_k_proj(position_embeddings)
        relative_key_states = relative_key_states.view(-1, self.num_heads, self.head_dim)
        relative_key_states = relative_key_states.to(dtype=query_states.dtype)

        queries = query_states.permute(0, 3, 1, 2, 4)
        matrix_ac = queries @ key_states.permute(0, 3, 1, 4, 2)

        queries_flat = queries.reshape(batch_size, self.num_heads, -1, self.head_dim)
        matrix_bd = queries_flat @ relative_key_states.permute(1, 2, 0)
        matrix_bd = matrix_bd.reshape(batch_size, self.num_heads, num_blocks, self.chunk_size, -1)
        matrix_bd = self._rel_shift(matrix_bd)

        attn_weights = matrix_ac + matrix_bd
        _RAW_LOGITS.append(attn_weights.detach().abs().max().item())
        attn_weights = attn_weights / self.softcap
        attn_weights = torch.tanh(attn_weights)
        attn_weights = attn_weights * self.softcap

        if attention_mask is not None:
            attn_weights = attn_weights.masked_fill(attention_mask != 0, self.config.attention_invalid_logits_value)

        attn_weights = F.softmax(attn_weights, dim=-1, dtype=F64).to(value_states.dtype)
        attn_output = attn_weights @ value_states.permute(0, 3, 1, 2, 4)
        attn_output = attn_output.permute(0, 2, 3, 1, 4).reshape(batch_size, num_blocks * self.chunk_size, -1)
        attn_output = attn_output[:, :seq_length].contiguous()
        attn_output = self.post(attn_output.to(hidden_states.dtype))

        return attn_output, attn_weights

    return [
        (mg.Gemma4AudioAttention, "forward", orig_attn, audio_attention_forward_f64,
         "2294a6e7b7e7fca7b57e6c19569891b0dd7d243b04d9f80c7e032b8a0ba5aaba"),
    ]


_RAW_LOGITS: list[float] = []  # max |logit| before the cap, per attention call of the patched forward


def _audited(mg):
    """Read for float32 spots and left alone (see the module docstring); pinned so a change is noticed."""
    return [
        (mg.Gemma4AudioModel.forward,
         "bad9c8014ef9439d9f261a454b9496d15d970d403d05bca99d454d095cfb141d"),
        (mg.Gemma4AudioModel._convert_4d_mask_to_blocked_5d,
         "e8fecaab4b4615db01e8bcde461e3866592f91fd2c95d2f23288a19105fd6234"),
        (mg.sliding_window_mask_function,
         "85ccb9527d6d2b2e28f265edb13e546431833e47b1e3071896d659adf452a496"),
        (mg.Gemma4AudioRelPositionalEncoding.__init__,
         "6e8503a3923f81dedc457c90313337d3182c96e039958dc14360d16409d312cd"),
        (mg.Gemma4AudioRelPositionalEncoding.forward,
         "9a66b70b8db9fbfd99d55910fe0d29884957baf9f35a70f43cd187d7f44a8e11"),
        (mg.Gemma4AudioAttention.__init__,
         "083bee8b4db55367b4ae255694a3213550438442c25a3a87dce8c52527a54906"),
        (mg.Gemma4AudioAttention._convert_to_block,
         "92b3c69c2e47cadd4fbe25081a3bfa3f0085e5b1e0de373b5d3178655932fb70"),
        (mg.Gemma4AudioAttention._extract_block_context,
         "cae46334a66ec053ff7cd856b5677e6e4c7518d78a94f644b05182791300ef4b"),
        (mg.Gemma4AudioAttention._rel_shift,
         "aecae69ff567aeeb2372610ed213adfeb8006a37b541611f7a1d963974ed514e"),
        (mg.Gemma4AudioSubSampleConvProjectionLayer.forward,
         "19e89d8e6a5159c56f6996699fda49ae633f93bf2fd852b6965d102f1f37bf27"),
        (mg.Gemma4AudioSubSampleConvProjection.forward,
         "db88c9e86a829bb78ccce26b7d228428abc8478edaea91ec0223b93cc244ee6b"),
        (mg.Gemma4AudioFeedForward.forward,
         "bbc8a2fc0282ffeb6be77a2c2672332d59fd4fd0cd0361f05790389f1c80e3e0"),
        (mg.Gemma4AudioCausalConv1d.forward,
         "2153424712184fbcd47827056f50cac56aa489db710bf639ec6afa763e20a9bc"),
        (mg.Gemma4AudioLightConv1d.__init__,
         "166d6e64e113f64656d3734aff5c1e799f35f4ab6ad13ececf5dc3ca47fdd714"),
        (mg.Gemma4AudioLightConv1d.forward,
         "a9f967064fcc16e111b45c510a88af43ef99b0f031f071d2fd38f4db7bcf704c"),
        (mg.Gemma4AudioLayer.forward,
         "1e524db5d2ead758ead1112d3f6b697a9f826f9f44c9f23c292e8510fd37520c"),
        (mg.Gemma4ClippableLinear.forward,
         "9edb64f3c5e32da184b5f77594cc6ab741c18f9a01bca671c5895488b45f87c4"),
        (mg.Gemma4MultimodalEmbedder.forward,
         "20af6ddd8e1c4772517ee1956b4580faafde11e0b1e513bcbb60698dd20eb227"),
        (mg.Gemma4Model.get_audio_features,
         "f20cfcf62d4c7156d2314f1e2b03d3b16e65fd6a8012daf5535c138ce6ec5d36"),
    ]


@contextlib.contextmanager
def audio_float64_exact(torch, mg, hf_reference):
    """hf_reference.float64_exact() (RMSNorm) plus the float64 copy of Gemma4AudioAttention.forward."""
    with hf_reference.audited_float64_exact(_audio_patches(torch, mg), _audited(mg), "tests/test_audio_tower.py"):
        yield


def recompute_audio_buffers(torch, mg, model) -> None:
    """The non-persistent audio buffers, same formulas, in float64 (each checked against the old value).

    ``from_pretrained(dtype=float64)`` leaves them float64 in dtype but float32-rounded in value
    (inv_timescales is off by up to ~4e-8 relative); softcap is only exact for float32-representable caps.
    """
    for name, module in model.named_modules():
        if isinstance(module, mg.Gemma4AudioRelPositionalEncoding):
            half = module.hidden_size // 2
            inc = math.log(10000.0) / max(half - 1, 1)
            new = torch.exp(torch.arange(half, dtype=torch.float64) * -inc)[None, None]
            old = module.inv_timescales
            if old.shape != new.shape or not torch.allclose(old.to(torch.float64), new, rtol=1e-6, atol=0):
                raise RuntimeError(f"{name}.inv_timescales: float64 recomputation disagrees with transformers")
            module.inv_timescales = new
        if isinstance(module, mg.Gemma4AudioAttention):
            cap = float(module.config.attention_logit_cap)
            if not math.isclose(module.softcap.item(), cap, rel_tol=1e-6):
                raise RuntimeError(f"{name}.softcap: {module.softcap.item()} is not the config's {cap}")
            module.softcap = torch.tensor(cap, dtype=torch.float64)


def _randomise(torch, model, seed: int) -> None:
    """Random audio weights: norms around 1, clip bounds finite and biting, q/k large (logits well past
    the cap), the rest N(0, 0.1^2)-ish scaled to their fan-in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "audio" not in name or not t.is_floating_point() or "inv_timescales" in name or name.endswith("softcap"):
                continue
            parts = name.split(".")
            last = parts[-1]
            if last == "weight" and "norm" in parts[-2]:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif last in ("input_min", "output_min"):
                t.copy_(-(0.8 + 0.8 * torch.rand((), generator=g)))
            elif last in ("input_max", "output_max"):
                t.copy_(0.8 + 0.8 * torch.rand((), generator=g))
            elif last == "per_dim_scale":
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif parts[-3] in ("q_proj", "k_proj"):
                t.copy_(1.2 * torch.randn(t.shape, generator=g))
            elif "conv.weight" in name and "depthwise" not in name:
                t.copy_(0.4 * torch.randn(t.shape, generator=g))
            else:
                fan_in = t.shape[-1] if t.ndim > 1 else 1
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(fan_in))
        for name, t in model.named_parameters():  # the text/vision side does not matter here
            if "audio" not in name and t.is_floating_point():
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


@pytest.fixture(scope="module")
def checkpoints(torch_one_thread, tmp_path_factory):
    """{variant: (checkpoint dir, float64 HF model)}."""
    torch, mg, _ = torch_one_thread
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    out = {}
    for seed, (variant, extra) in enumerate(VARIANTS.items()):
        cfg = Gemma4Config(text_config=dict(TEXT), vision_config=None, audio_config={**AUDIO, **extra}, **TOKEN_IDS)
        model = Gemma4ForConditionalGeneration(cfg)
        _randomise(torch, model, seed)
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
    _RAW_LOGITS.clear()
    theirs = hf_soft_tokens(torch_one_thread, hf, x, mask)
    raw_logit = max(_RAW_LOGITS)
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
