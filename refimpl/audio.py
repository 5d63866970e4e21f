"""The Gemma 4 audio tower (a USM conformer) and its projection into the text width, one small pure
function per step (gemma4-multimodal-spec.md section 9; traps 22-24).

Shapes: T mel frames of one clip, F mel bins, C0/C1 subsampling channels, S = ceil(ceil(T/2)/2)
tokens after subsampling, D audio hidden, n heads, d = D/n head dim, W = attention_chunk_size,
L = attention_context_left - 1 past keys, R = attention_context_right future keys, C = W + L + R
keys per block, nb = ceil(S/W) blocks, P = output_proj_dims, H text hidden, M valid soft tokens.

    features [T, F], mask [T] (True = real frame)
      -> 2 x (features * mask -> Conv2d 3x3 s2 p1 -> LayerNorm over channels -> ReLU; mask[::2])
                                                                       [C1, S, ceil(F/4)], mask [S]
      -> flatten (freq, channel), input_proj_linear                     [S, D]
      -> conformer layers (macaron: FF1, local attention, light conv, FF2, norm_out)  [S, D]
      -> output_proj (with bias)                                        [S, P]
      -> keep the tokens whose decimated mask is True                   [M, P]
      -> embed_audio: scale-free RMSNorm, embedding_projection          [M, H]

Every step runs on all S positions, masked ones included, exactly as transformers does: masked
frames are only kept out as attention keys (and zeroed before each subsampling conv); the light
conv and the FFs process them like any other frame, and only the final selection drops them. A
masked frame that lies *between* real frames therefore does influence later real frames through the
causal depthwise conv, as in transformers. With the usual trailing padding it does not: the soft
tokens of a clip do not depend on how much padding follows it.

Soft tokens: token s is kept iff ``mask[4 s]`` is True (transformers decimates the frame mask with
``[::2]`` after each subsampling block and ``Gemma4Model.forward`` keeps
``pooler_output[audio_outputs.attention_mask]``); for a batch the kept rows are concatenated clip
by clip, the order they are scattered into the audio-token positions.

Exactly-as-transformers details that differ from a textbook conformer (transformers 5.24):

* The subsampling flatten width is ``(C0 // 4) * C1`` (input_proj_linear), so the mel-bin count F
  must satisfy ``ceil(F/4) == C0 // 4`` (F = 128 with C0 = 128 for the shipped towers).
* The FF RMSNorms and the layer's norm_pre_attn / norm_post_attn / norm_out use eps 1e-6 whatever
  ``rms_norm_eps`` says; the light conv's two norms, the subsampling LayerNorms and embed_audio's
  norm use ``rms_norm_eps``.
* Local attention mask (trap 24): query q sees key k iff k is a real frame and
  ``0 <= q - k < attention_context_left - 1`` or ``0 < k - q < attention_context_right``; the
  blocked context holds L = attention_context_left - 1 past keys, of which the farthest is never
  visible.
* Relative positions: the sinusoid table has ``C // 2 + 1`` rows for position values C//2 ... 0
  (``Gemma4AudioRelPositionalEncoding``), and the blocked rel-shift gives query i of a block, at
  context offset c, row ``c - i`` (value ``C//2 - c + i``). That is the distance q - k exactly
  when ``W + R == L`` (as shipped: 12 + 0 == 12); otherwise the transformers formula is kept.
  Offsets with ``c - i`` past the table get 0 and offsets with ``c < i`` (which the rel-shift
  fills with a neighbouring row's value) are always masked, so they are written as 0 here.
* ``q`` is scaled by ``d^-0.5 / ln 2 * softplus(per_dim_scale)`` and ``k`` by ``ln(1 + e) / ln 2``;
  the relative keys are not scaled. softplus here is the exact ``log(1 + e^x)``; torch's returns
  x itself above 20 (a difference below 2.1e-9, only for a per-dim scale above 20).
* The logits are soft-capped ``cap * tanh(x / cap)`` before masking; masked logits are *replaced*
  by ``attention_invalid_logits_value`` (not -inf), so a query with no visible key (a masked frame)
  averages uniformly over its C context values, zero-padded ones included, like transformers.
* Clamps at +-gradient_clipping (1e10 as shipped) around the FFs, attention and light conv.

Not in this module: the mel feature extractor (section 9 step 1) and merging the soft tokens into
the text stream (section 9 step 6). Compute dtype is the weights' dtype: float64 (exact) or float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .config_fields import check_positive, check_positive_float, get_field, required_positive, tower_section
from .errors import ConfigError, InputError
from .model import Trace
from .ops import clamp, linear, sigmoid, silu, softplus
from .schedule import rms_norm, softcap, softmax
from .weights import TowerWeights, clippable_tensors

TOWER = "model.audio_tower."
EMBED = "model.embed_audio."
SUB = TOWER + "subsample_conv_projection."
FIXED_NORM_EPS = 1e-6  # Gemma4RMSNorm's default, used by the FF and layer norms whatever rms_norm_eps says
HF_DEFAULTS = dict(hidden_act="silu", conv_kernel_size=5, residual_weight=0.5, attention_chunk_size=12,
                   attention_context_left=13, attention_context_right=0, attention_logit_cap=50.0,
                   attention_invalid_logits_value=-1.0e9, use_clipped_linears=True, rms_norm_eps=1e-6,
                   gradient_clipping=1e10)


# ----------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class AudioConfig:
    """``audio_config`` of a Gemma4ForConditionalGeneration config.json, plus the text width."""

    hidden_size: int  # D
    num_hidden_layers: int
    num_attention_heads: int  # n
    subsampling_conv_channels: tuple[int, int]  # (C0, C1)
    output_proj_dims: int  # P
    conv_kernel_size: int  # light conv's depthwise kernel
    residual_weight: float  # FF output scale (0.5: macaron)
    attention_chunk_size: int  # W
    attention_context_left: int  # L + 1
    attention_context_right: int  # R
    attention_logit_cap: float
    attention_invalid_logits_value: float
    use_clipped_linears: bool
    rms_norm_eps: float
    gradient_clipping: float
    text_hidden_size: int  # H: width of embed_audio's output

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_past(self) -> int:
        """L: past keys in each block's context."""
        return self.attention_context_left - 1

    @property
    def context_size(self) -> int:
        """C = W + L + R keys per block."""
        return self.attention_chunk_size + self.max_past + self.attention_context_right

    @property
    def num_rel_positions(self) -> int:
        """Rows of the relative-position table: values C//2 ... 0."""
        return self.context_size // 2 + 1

    @property
    def freq_out(self) -> int:
        """Frequency bins after subsampling, as input_proj_linear expects them: C0 // 4."""
        return self.subsampling_conv_channels[0] // 4

    @property
    def proj_in_dim(self) -> int:
        return self.freq_out * self.subsampling_conv_channels[1]


def parse_audio_config(raw: dict, where: str = "config.json") -> AudioConfig:
    """Build an ``AudioConfig`` from a parsed Gemma4ForConditionalGeneration config.json.

    The geometry (hidden_size, num_hidden_layers, num_attention_heads, subsampling_conv_channels,
    output_proj_dims) is required; the rest defaults as in transformers' ``Gemma4AudioConfig``.
    """
    audio, text_hidden, w = tower_section(
        raw, "audio_config", "embed_audio", "audio tower (a text-only model, or a "
        "Gemma4ForConditionalGeneration without audio such as the 26B/31B)", where)

    def required(key: str) -> int:
        return required_positive(audio, key, w)

    def optional_int(key: str) -> int:
        return get_field(audio, key, int, HF_DEFAULTS[key], w)

    def optional_float(key: str) -> float:
        value = get_field(audio, key, float, HF_DEFAULTS[key], w)
        if not math.isfinite(value):
            raise ConfigError(f"{w}: '{key}' must be a finite number, got {value}")
        return value

    D, layers, n, P = (required("hidden_size"), required("num_hidden_layers"), required("num_attention_heads"),
                       required("output_proj_dims"))
    if D % n:
        raise ConfigError(f"{w}: 'hidden_size' {D} is not divisible by 'num_attention_heads' {n}")
    if D % 2:
        raise ConfigError(
            f"{w}: 'hidden_size' {D} is odd; the relative-position sinusoids fill D/2 sin and D/2 cos channels"
        )
    channels = get_field(audio, "subsampling_conv_channels", list, where=w)
    if (len(channels) != 2 or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in channels)):
        raise ConfigError(
            f"{w}: 'subsampling_conv_channels' must be two positive integers [C0, C1], got {channels!r}"
        )
    if channels[0] < 4:
        raise ConfigError(
            f"{w}: 'subsampling_conv_channels'[0] is {channels[0]}; the input projection reads C0 // 4 frequency "
            "bins, so C0 must be at least 4"
        )
    act = get_field(audio, "hidden_act", str, HF_DEFAULTS["hidden_act"], w)
    if act != "silu":
        raise ConfigError(f"{w}: 'hidden_act' is {act!r}; the Gemma 4 audio tower uses 'silu'")
    kernel = check_positive(optional_int("conv_kernel_size"), "conv_kernel_size", w)
    chunk = check_positive(optional_int("attention_chunk_size"), "attention_chunk_size", w)
    left = check_positive(optional_int("attention_context_left"), "attention_context_left", w)
    right = optional_int("attention_context_right")
    if right < 0:
        raise ConfigError(f"{w}: field 'attention_context_right' must be >= 0, got {right}")
    cap = optional_float("attention_logit_cap")
    check_positive_float(cap, "attention_logit_cap", w)
    invalid = optional_float("attention_invalid_logits_value")
    if invalid >= 0:
        raise ConfigError(
            f"{w}: 'attention_invalid_logits_value' must be negative (the logit given to masked keys), got {invalid}"
        )
    eps = optional_float("rms_norm_eps")
    check_positive_float(eps, "rms_norm_eps", w)
    clip = optional_float("gradient_clipping")
    check_positive_float(clip, "gradient_clipping", w)
    return AudioConfig(
        hidden_size=D, num_hidden_layers=layers, num_attention_heads=n,
        subsampling_conv_channels=(channels[0], channels[1]), output_proj_dims=P, conv_kernel_size=kernel,
        residual_weight=optional_float("residual_weight"), attention_chunk_size=chunk,
        attention_context_left=left, attention_context_right=right, attention_logit_cap=cap,
        attention_invalid_logits_value=invalid,
        use_clipped_linears=get_field(audio, "use_clipped_linears", bool, HF_DEFAULTS["use_clipped_linears"], w),
        rms_norm_eps=eps, gradient_clipping=clip, text_hidden_size=text_hidden,
    )


def load_audio_config(model_dir: str | Path) -> AudioConfig:
    """Read the audio part of ``config.json`` from a checkpoint directory."""
    return AudioWeights.load_config(model_dir)


# ----------------------------------------------------------------------------------------------
# weights


def expected_audio_tensors(cfg: AudioConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the audio tower and its projector (full checkpoint names) and its shape."""
    D, P, (C0, C1), d = cfg.hidden_size, cfg.output_proj_dims, cfg.subsampling_conv_channels, cfg.head_dim
    clipped = cfg.use_clipped_linears
    t: dict[str, tuple[int, ...]] = {
        SUB + "layer0.conv.weight": (C0, 1, 3, 3),
        SUB + "layer0.norm.weight": (C0,),
        SUB + "layer1.conv.weight": (C1, C0, 3, 3),
        SUB + "layer1.norm.weight": (C1,),
        SUB + "input_proj_linear.weight": (D, cfg.proj_in_dim),
        TOWER + "output_proj.weight": (P, D),
        TOWER + "output_proj.bias": (P,),
        EMBED + "embedding_projection.weight": (cfg.text_hidden_size, P),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"{TOWER}layers.{i}."
        for ff in ("feed_forward1", "feed_forward2"):
            t.update(clippable_tensors(f"{p}{ff}.ffw_layer_1", (4 * D, D), clipped))
            t.update(clippable_tensors(f"{p}{ff}.ffw_layer_2", (D, 4 * D), clipped))
            t[f"{p}{ff}.pre_layer_norm.weight"] = (D,)
            t[f"{p}{ff}.post_layer_norm.weight"] = (D,)
        for proj in ("q_proj", "k_proj", "v_proj", "post"):
            t.update(clippable_tensors(f"{p}self_attn.{proj}", (D, D), clipped))
        t[p + "self_attn.relative_k_proj.weight"] = (D, D)
        t[p + "self_attn.per_dim_scale"] = (d,)
        t.update(clippable_tensors(p + "lconv1d.linear_start", (2 * D, D), clipped))
        t.update(clippable_tensors(p + "lconv1d.linear_end", (D, D), clipped))
        t[p + "lconv1d.depthwise_conv1d.weight"] = (D, 1, cfg.conv_kernel_size)
        t[p + "lconv1d.pre_layer_norm.weight"] = (D,)
        t[p + "lconv1d.conv_norm.weight"] = (D,)
        for norm in ("norm_pre_attn", "norm_post_attn", "norm_out"):
            t[f"{p}{norm}.weight"] = (D,)
    return t


class AudioWeights(TowerWeights):
    """The audio tensors of one checkpoint, validated against its config, decoded on demand.

    Only ``model.audio_tower.*`` and ``model.embed_audio.*`` are read (and checked: missing,
    mis-shaped, non-float and unexpected tensors under those prefixes are one error).
    """

    what = "audio"
    prefixes = (TOWER, EMBED)
    parse_config = staticmethod(parse_audio_config)
    expected_tensors = staticmethod(expected_audio_tensors)

    def query_scale(self, attn: str) -> np.ndarray:
        """[d]: softplus(per_dim_scale) of the attention ``attn`` ("...self_attn."), the query's per-channel scale."""
        return softplus(self[attn + "per_dim_scale"])


# ----------------------------------------------------------------------------------------------
# the math, one step per function


def conv2d_3x3_s2(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [Cin, T, F], weight [Cout, Cin, 3, 3] -> [Cout, ceil(T/2), ceil(F/2)]: stride 2, zero padding 1,
    no bias. out[o, t, f] = sum_{c,i,j} w[o, c, i, j] x[c, 2t + i - 1, 2f + j - 1]."""
    _, T, F = x.shape
    To, Fo = (T + 1) // 2, (F + 1) // 2
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1)))
    out = np.zeros((weight.shape[0], To, Fo), dtype=x.dtype)
    for i in range(3):
        for j in range(3):
            out += np.einsum("oc,ctf->otf", weight[:, :, i, j], xp[:, i:i + 2 * To:2, j:j + 2 * Fo:2])
    return out


def layer_norm_channels(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [C, T, F] normalised over C (biased variance), times weight [C]; no bias."""
    mean = x.mean(axis=0, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=0, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight[:, None, None]


def subsample_block(x: np.ndarray, mask: np.ndarray, conv: np.ndarray, norm: np.ndarray,
                    eps: float) -> tuple[np.ndarray, np.ndarray]:
    """x [Cin, T, F], mask [T] -> (ReLU(LayerNorm(conv(x * mask))) [Cout, ceil(T/2), ceil(F/2)], mask[::2])."""
    x = x * mask[None, :, None].astype(x.dtype)
    y = np.maximum(layer_norm_channels(conv2d_3x3_s2(x, conv), norm, eps), 0.0)
    return y, mask[::2]


def flatten_subsampled(x: np.ndarray) -> np.ndarray:
    """[C1, S, F4] -> [S, F4 * C1], channel fastest (index f * C1 + c)."""
    return x.transpose(1, 2, 0).reshape(x.shape[1], -1)


def feed_forward(x: np.ndarray, p: str, w: AudioWeights, cfg: AudioConfig) -> np.ndarray:
    """Macaron half-step FF: x + residual_weight * post_norm(clamp(W2 silu(W1 pre_norm(clamp(x))))).
    Both norms use eps 1e-6 (Gemma4RMSNorm's default), not rms_norm_eps."""
    g = cfg.gradient_clipping
    h = rms_norm(clamp(x, g), w[p + "pre_layer_norm.weight"], FIXED_NORM_EPS)
    h = w.clippable(silu(w.clippable(h, p + "ffw_layer_1")), p + "ffw_layer_2")
    h = rms_norm(clamp(h, g), w[p + "post_layer_norm.weight"], FIXED_NORM_EPS)
    return x + h * cfg.residual_weight


def relative_position_embeddings(cfg: AudioConfig, dtype: np.dtype) -> np.ndarray:
    """[C//2 + 1, D]: row r holds position value C//2 - r as [sin(v w) | cos(v w)], with D/2 timescales
    w_j = exp(-j ln(1e4) / max(D/2 - 1, 1)). Computed in float64, cast to the compute dtype."""
    half = cfg.hidden_size // 2
    inv = np.exp(np.arange(half) * -(math.log(10000.0) / max(half - 1, 1)))
    values = np.arange(cfg.context_size // 2, -1, -1, dtype=np.float64)
    angles = values[:, None] * inv[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(dtype)


def to_blocks(x: np.ndarray, W: int) -> np.ndarray:
    """[S, ...] -> [nb, W, ...]: consecutive query blocks, the last one zero-padded."""
    nb = -(-x.shape[0] // W)
    pad = [(0, nb * W - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return np.pad(x, pad).reshape(nb, W, *x.shape[1:])


def block_context(x: np.ndarray, W: int, past: int, future: int) -> np.ndarray:
    """[S, ...] -> [nb, C, ...] with C = past + W + future: block b's keys are positions
    b W - past ... b W + W + future - 1 (zero outside [0, S))."""
    S = x.shape[0]
    nb = -(-S // W)
    C = past + W + future
    pad = [(past, nb * W - S + future)] + [(0, 0)] * (x.ndim - 1)
    xp = np.pad(x, pad)
    index = np.arange(nb)[:, None] * W + np.arange(C)[None, :]  # [nb, C] into the padded sequence
    return xp[index]


def local_attention_mask(valid: np.ndarray, cfg: AudioConfig) -> np.ndarray:
    """bool [nb, W, C]: query b W + i may see context key b W + c - L iff that key is a real position
    (inside [0, S) and valid) and 0 <= q - k < L (trap 24: the farthest of the L past keys is never
    visible) or 0 < k - q < R. Padded query rows see nothing."""
    S, W, L, R = valid.shape[0], cfg.attention_chunk_size, cfg.max_past, cfg.attention_context_right
    nb = -(-S // W)
    q = np.arange(nb)[:, None, None] * W + np.arange(W)[None, :, None]  # [nb, W, 1]
    k = np.arange(nb)[:, None, None] * W + np.arange(cfg.context_size)[None, None, :] - L  # [nb, 1, C]
    dist = q - k
    in_window = ((dist >= 0) & (dist < L)) | ((dist < 0) & (-dist < R))
    key_ok = (k >= 0) & (k < S) & valid[np.clip(k, 0, S - 1)]
    return in_window & key_ok & (q < S)


def relative_logits(q_blocks: np.ndarray, rel_k: np.ndarray, C: int) -> np.ndarray:
    """Transformer-XL term [n, nb, W, C] from q_blocks [nb, W, n, d] and rel_k [Rr, n, d] (Rr = C//2 + 1
    table rows): the logit of query i at context offset c uses table row c - i, i.e. what the blocked
    rel-shift (pad to C + 1, flatten, crop) produces; 0 where c - i is outside the table (c < i only
    happens for keys outside the attention window, always masked)."""
    W = q_blocks.shape[1]
    bd = np.einsum("bind,rnd->nbir", q_blocks, rel_k)  # [n, nb, W, Rr]: query against every table row
    row = np.arange(C)[None, :] - np.arange(W)[:, None]  # [W, C]
    inside = (row >= 0) & (row < rel_k.shape[0])
    gathered = np.take_along_axis(bd, np.broadcast_to(np.clip(row, 0, rel_k.shape[0] - 1), bd.shape[:2] + row.shape),
                                  axis=-1)
    return np.where(inside, gathered, 0.0)


def local_attention(x: np.ndarray, valid: np.ndarray, p: str, w: AudioWeights, cfg: AudioConfig,
                    rel_pos: np.ndarray) -> np.ndarray:
    """Chunked local self-attention with relative positions on the normed x [S, D] -> [S, D].

    q = q_proj(x) d^-0.5 / ln 2 * softplus(per_dim_scale), k = k_proj(x) ln(1 + e) / ln 2, v = v_proj(x);
    queries in blocks of W, keys/values in each block's context of C; logits = q.k + relative term;
    soft cap; masked logits replaced by attention_invalid_logits_value; softmax; post projection.
    """
    S, n, d, W, C = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.attention_chunk_size, cfg.context_size
    a = p + "self_attn."
    q = w.clippable(x, a + "q_proj").reshape(S, n, d)
    k = w.clippable(x, a + "k_proj").reshape(S, n, d)
    v = w.clippable(x, a + "v_proj").reshape(S, n, d)
    q = q * ((d**-0.5) / math.log(2)) * w.query_scale(a)
    k = k * (math.log(1 + math.e) / math.log(2))

    qb = to_blocks(q, W)  # [nb, W, n, d]
    kb = block_context(k, W, cfg.max_past, cfg.attention_context_right)  # [nb, C, n, d]
    vb = block_context(v, W, cfg.max_past, cfg.attention_context_right)  # [nb, C, n, d]
    rel_k = linear(rel_pos, w[a + "relative_k_proj.weight"]).reshape(-1, n, d)  # [C//2 + 1, n, d]

    logits = np.einsum("bind,bcnd->nbic", qb, kb) + relative_logits(qb, rel_k, C)  # [n, nb, W, C]
    logits = softcap(logits, cfg.attention_logit_cap)
    logits = np.where(local_attention_mask(valid, cfg), logits, cfg.attention_invalid_logits_value)
    probs = softmax(logits, axis=-1)
    out = np.einsum("nbic,bcnd->bind", probs, vb).reshape(-1, n * d)[:S]  # [S, D]
    return w.clippable(out, a + "post")


def causal_depthwise_conv(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [S, D], weight [D, 1, K] -> [S, D]: out[t] = sum_j w[:, 0, j] x[t - K + 1 + j] (zeros before 0)."""
    K = weight.shape[-1]
    xp = np.pad(x, ((K - 1, 0), (0, 0)))
    S = x.shape[0]
    return sum(xp[j:j + S] * weight[:, 0, j] for j in range(K))


def light_conv(x: np.ndarray, p: str, w: AudioWeights, cfg: AudioConfig) -> np.ndarray:
    """x + linear_end(silu(conv_norm(clamp(causal_dwconv(GLU(linear_start(pre_norm(x)))))))).
    GLU: first half * sigmoid(second half). Both norms use rms_norm_eps."""
    eps = cfg.rms_norm_eps
    h = w.clippable(rms_norm(x, w[p + "pre_layer_norm.weight"], eps), p + "linear_start")
    a, b = np.split(h, 2, axis=-1)
    h = a * sigmoid(b)
    h = causal_depthwise_conv(h, w[p + "depthwise_conv1d.weight"])
    h = rms_norm(clamp(h, cfg.gradient_clipping), w[p + "conv_norm.weight"], eps)
    return x + w.clippable(silu(h), p + "linear_end")


def conformer_layer(i: int, x: np.ndarray, valid: np.ndarray, w: AudioWeights, cfg: AudioConfig,
                    rel_pos: np.ndarray) -> np.ndarray:
    """FF1; x + norm_post_attn(clamp(attn(norm_pre_attn(clamp(x))))); light conv; FF2; norm_out(clamp(x)).
    The three layer norms use eps 1e-6."""
    p, g = f"{TOWER}layers.{i}.", cfg.gradient_clipping
    x = feed_forward(x, p + "feed_forward1.", w, cfg)
    h = local_attention(rms_norm(clamp(x, g), w[p + "norm_pre_attn.weight"], FIXED_NORM_EPS), valid, p, w, cfg,
                        rel_pos)
    x = x + rms_norm(clamp(h, g), w[p + "norm_post_attn.weight"], FIXED_NORM_EPS)
    x = light_conv(x, p + "lconv1d.", w, cfg)
    x = feed_forward(x, p + "feed_forward2.", w, cfg)
    return rms_norm(clamp(x, g), w[p + "norm_out.weight"], FIXED_NORM_EPS)


def embed_audio(h: np.ndarray, projection: np.ndarray, eps: float) -> np.ndarray:
    """Tower output [M, P] -> text width [M, H]: scale-free RMSNorm (rms_norm_eps), embedding_projection."""
    return linear(rms_norm(h, None, eps), projection)


# ----------------------------------------------------------------------------------------------
# inputs and the tower


def check_features(features, mask, cfg: AudioConfig) -> tuple[np.ndarray, np.ndarray]:
    """(features [B, T, F] float, mask [B, T] bool) from one clip ([T, F], [T]) or a batch ([B, T, F], [B, T]).

    Raises ``InputError`` for wrong ranks or shapes, a mel-bin count the input projection cannot take
    (ceil(F/4) must be C0 // 4), a non-boolean mask or non-finite features.
    """
    x = np.asarray(features)
    m = np.asarray(mask)
    if x.ndim not in (2, 3) or not np.issubdtype(x.dtype, np.floating):
        raise InputError(
            f"features must be a float array [T, F] (one clip) or [B, T, F] (a batch) of log-mel frames, got "
            f"{x.dtype} {list(x.shape)}"
        )
    single = x.ndim == 2
    if single:
        x = x[None]
    B, T, F = x.shape
    if T == 0:
        raise InputError("features have no frames (T = 0); a clip needs at least one mel frame")
    if -(-F // 4) != cfg.freq_out:
        lo, hi = 4 * cfg.freq_out - 3, 4 * cfg.freq_out
        raise InputError(
            f"features have {F} mel bins; this tower's input projection reads {cfg.freq_out} bins after the two "
            f"stride-2 convs (subsampling_conv_channels[0] // 4), so F must be in [{lo}, {hi}] (the feature "
            "extractor's feature_size, 128 for the shipped towers)"
        )
    want = [T] if single else [B, T]
    if list(m.shape) != want:
        raise InputError(f"mask must have shape {want} (one flag per mel frame of features "
                         f"{list(np.shape(features))}), got {list(m.shape)}")
    if m.dtype != np.bool_:
        if not (np.issubdtype(m.dtype, np.integer) and np.isin(m, (0, 1)).all()):
            raise InputError(f"mask must be boolean (True = real frame) or 0/1 integers, got {m.dtype}")
        m = m.astype(bool)
    if not np.isfinite(x).all():
        raise InputError("features contain NaN or infinite values")
    return x, (m[None] if single else m)


def audio_tower_clip(features: np.ndarray, mask: np.ndarray, weights: AudioWeights, cfg: AudioConfig,
                     trace: Trace | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One checked clip, features [T, F], mask [T] bool -> (output_proj [S, P] for every token, token mask [S]).

    ``trace``, when given, receives "subsampled" [S, D] (after input_proj_linear), "layers.{i}" [S, D]
    and "output_proj" [S, P]; all S tokens, masked ones included.
    """
    w, dt, eps = weights, weights.dtype, cfg.rms_norm_eps
    x = features.astype(dt)[None]  # [1, T, F]: one input channel
    x, m = subsample_block(x, mask, w[SUB + "layer0.conv.weight"], w[SUB + "layer0.norm.weight"], eps)
    x, m = subsample_block(x, m, w[SUB + "layer1.conv.weight"], w[SUB + "layer1.norm.weight"], eps)
    h = linear(flatten_subsampled(x), w[SUB + "input_proj_linear.weight"])  # [S, D]
    if trace is not None:
        trace.put("subsampled", h)
    rel_pos = relative_position_embeddings(cfg, dt)
    for i in range(cfg.num_hidden_layers):
        h = conformer_layer(i, h, m, w, cfg, rel_pos)
        if trace is not None:
            trace.put(f"layers.{i}", h)
    out = linear(h, w[TOWER + "output_proj.weight"]) + w[TOWER + "output_proj.bias"]
    if trace is not None:
        trace.put("output_proj", out)
    return out, m


def audio_tower(features, mask, weights: AudioWeights, cfg: AudioConfig, trace: Trace | None = None) -> np.ndarray:
    """Soft tokens [M, H] (text width) of one clip (features [T, F], mask [T]) or a batch ([B, T, F], [B, T]).

    ``features`` are log-mel frames as transformers' ``Gemma4AudioFeatureExtractor`` emits them
    (``input_features``), ``mask`` its ``input_features_mask`` (True = real frame). Token s of a clip
    is kept iff ``mask[4 s]``; a batch's kept tokens are concatenated clip by clip, the rows
    ``Gemma4Model`` scatters into the audio-token positions. Computes in ``weights.dtype``.
    ``trace`` (single clip only) receives the ``audio_tower_clip`` tensors plus "soft_tokens" [M, H].
    """
    x, m = check_features(features, mask, cfg)
    if trace is not None and x.shape[0] != 1:
        raise InputError("trace is only supported for a single clip")
    proj = weights[EMBED + "embedding_projection.weight"]
    kept = []
    for clip, clip_mask in zip(x, m, strict=True):
        out, token_mask = audio_tower_clip(clip, clip_mask, weights, cfg, trace)
        kept.append(out[token_mask])
    e = weights.check_finite(embed_audio(np.concatenate(kept, axis=0), proj, cfg.rms_norm_eps))
    if trace is not None:
        trace.put("soft_tokens", e)
    return e


def num_soft_tokens(mask) -> int:
    """How many soft tokens a frame mask [T] or [B, T] yields: sum of mask[..., ::4]."""
    return int(np.asarray(mask, dtype=bool)[..., ::4].sum())


def load_audio_tower(model_dir: str | Path, dtype: str | np.dtype = "float64") -> tuple[AudioWeights, AudioConfig]:
    """(weights, cfg) of a checkpoint directory's audio tower, for ``audio_tower(..., weights, cfg)``."""
    return AudioWeights.load(model_dir, dtype)


__all__: Sequence[str] = [
    "AudioConfig", "AudioWeights", "parse_audio_config", "load_audio_config", "load_audio_tower",
    "expected_audio_tensors", "audio_tower", "audio_tower_clip", "check_features", "num_soft_tokens",
]
