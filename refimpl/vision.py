"""The Gemma 4 vision tower and its projection into the text width, one small pure function per step
(gemma4-multimodal-spec.md sections 4.1-4.6; weight names section 8).

Shapes: N patches of one image, C = 3 p^2 values per patch, D vision hidden, I vision MLP width,
n heads, K KV heads, d head dim, s = d/2 channels per RoPE axis, k pooling kernel, M = N / k^2 soft
tokens, H text hidden.

    pixels [N, C] in [0, 1], positions [N, 2] = (x, y)
      -> patch embedding W_in (2 x - 1) + T[0, x] + T[1, y]                    [N, D]
      -> L encoder layers (sandwich norms, bidirectional attention with 2-D RoPE,
         q/k norms with weight, scale-free v norm, scale 1; GeGLU MLP)          [N, D]
      -> average pooling of each k x k block of patches, times sqrt(D)         [M, D]
      -> (standardize: (h - std_bias) * std_scale)                             [M, D]
      -> scale-free RMSNorm, embedding_projection                              [M, H]

Input contract (what transformers' ``Gemma4ImageProcessor`` / ``Gemma4ImageProcessorPil`` emit):
``pixel_patches`` are already patchified, each patch ordered (row in patch, column in patch,
channel) with the channel fastest, values rescaled to [0, 1] and not normalised (the model does
``2 (x - 0.5)`` itself); ``positions`` hold (x = column, y = row) of each patch. The processor pads
every image to ``max_soft_tokens * k^2`` patches with zero pixels and position (-1, -1).

Padding: a row whose position is (-1, -1) is a padding patch. transformers masks padding patches
out as attention keys, zeroes them before pooling and drops the pooled slots that received none, so
they have no effect on the real patches' soft tokens; here they are simply removed up front, which is
the same computation. Any other negative coordinate is an error. The real patches must cover one
full ``ph x pw`` grid (each cell once, any order) with ``ph`` and ``pw`` multiples of k, as the
processor guarantees; the soft tokens come out row-major over the pooled ``ph/k x pw/k`` grid.

Outside that contract transformers 5.24 behaves in ways this oracle does not copy: it derives k from
the padded length (which must be k^2 * (padded length / pooling_kernel_size^2), else ValueError),
and with pooling_kernel_size 1 it skips pooling and then indexes with the padding mask where it
means the validity mask, returning the padding rows (or nothing). Shipped towers use k = 3.

Not in this module: resizing/patchifying images (section 3) and merging soft tokens into the text
stream (section 5). The compute dtype is the weights' dtype: float64 (exact) or float32; RoPE angles
are computed in float64 and cast, as in ``refimpl.model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .config_fields import check_positive_float, get_field, required_positive, tower_section
from .errors import ConfigError, InputError
from .model import Trace
from .ops import linear, rope_cos_sin
from .schedule import apply_rope_2d, attention, geglu, rms_norm
from .weights import TowerWeights, clippable_tensors

TOWER = "model.vision_tower."
EMBED = "model.embed_vision."
ROPE_TYPES = ("axial", "default")  # transformers 5.24 rewrites "default" (older configs) to "axial"


# ----------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class VisionConfig:
    """``vision_config`` of a Gemma4ForConditionalGeneration config.json, plus the text width."""

    hidden_size: int  # D
    intermediate_size: int  # I
    num_hidden_layers: int  # L
    num_attention_heads: int  # n
    num_key_value_heads: int  # K
    head_dim: int  # d
    rms_norm_eps: float
    rope_theta: float
    patch_size: int  # p
    pooling_kernel_size: int  # k
    position_embedding_size: int  # rows of each half of the position table
    use_clipped_linears: bool
    standardize: bool
    text_hidden_size: int  # H: width of embed_vision's output

    @property
    def patch_dim(self) -> int:
        """C = 3 p^2 values per patch."""
        return 3 * self.patch_size**2


def parse_vision_config(raw: dict, where: str = "config.json") -> VisionConfig:
    """Build a ``VisionConfig`` from a parsed Gemma4ForConditionalGeneration config.json.

    The geometry fields (sizes, layers, heads, head_dim, patch and pooling sizes, table size) are
    required; the rest default as in transformers' ``Gemma4VisionConfig``.
    """
    vision, text_hidden, w = tower_section(
        raw, "vision_config", "embed_vision", "vision tower (a text-only Gemma4ForCausalLM or a "
        "Gemma4ForConditionalGeneration saved without vision)", where)

    def required(key: str) -> int:
        return required_positive(vision, key, w)

    D, I, L = required("hidden_size"), required("intermediate_size"), required("num_hidden_layers")  # noqa: E741 - I: the intermediate size (spec)
    n, K, d = required("num_attention_heads"), required("num_key_value_heads"), required("head_dim")
    p, k, table = required("patch_size"), required("pooling_kernel_size"), required("position_embedding_size")
    if n % K:
        raise ConfigError(
            f"{w}: {n} attention heads are not divisible by {K} KV heads ('num_key_value_heads'); choose a KV head "
            "count that divides num_attention_heads"
        )
    if d % 4:
        raise ConfigError(
            f"{w}: 'head_dim' {d} is not a multiple of 4; the 2-D RoPE gives each axis d/2 channels, rotated as "
            "d/4 rotate-half pairs"
        )
    eps = get_field(vision, "rms_norm_eps", float, 1e-6, w)
    check_positive_float(eps, "rms_norm_eps", w)
    act = vision.get("hidden_activation", vision.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{w}: 'hidden_activation' is {act!r}; the Gemma 4 vision tower uses 'gelu_pytorch_tanh'")
    theta = _vision_rope_theta(vision, w)
    clipped = get_field(vision, "use_clipped_linears", bool, False, w)
    standardize = get_field(vision, "standardize", bool, False, w)
    return VisionConfig(
        hidden_size=D, intermediate_size=I, num_hidden_layers=L, num_attention_heads=n, num_key_value_heads=K,
        head_dim=d, rms_norm_eps=eps, rope_theta=theta, patch_size=p, pooling_kernel_size=k,
        position_embedding_size=table, use_clipped_linears=clipped, standardize=standardize,
        text_hidden_size=text_hidden,
    )


def _vision_rope_theta(vision: dict, where: str) -> float:
    """rope_parameters {rope_type: axial | default, rope_theta}; absent -> theta 100 (transformers' default)."""
    rope = vision.get("rope_parameters")
    legacy_theta = get_field(vision, "rope_theta", float, None, where)
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: 'rope_parameters' must be an object {{rope_type, rope_theta}}, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: 'rope_parameters.rope_type' is {rope_type!r}; the vision tower's 2-D RoPE is 'axial' "
            "(older configs write 'default', which means the same)"
        )
    theta = get_field(rope, "rope_theta", float, legacy_theta if legacy_theta is not None else 100.0,
                 f"{where} rope_parameters")
    check_positive_float(theta, "rope_parameters.rope_theta", where)
    return theta


def load_vision_config(model_dir: str | Path) -> VisionConfig:
    """Read the vision part of ``config.json`` from a checkpoint directory."""
    return VisionWeights.load_config(model_dir)


# ----------------------------------------------------------------------------------------------
# weights


def expected_vision_tensors(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the vision tower and its projector (full checkpoint names) and its shape."""
    D, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741 - I: the intermediate size (spec)
    n, K = cfg.num_attention_heads, cfg.num_key_value_heads
    t: dict[str, tuple[int, ...]] = {
        TOWER + "patch_embedder.input_proj.weight": (D, cfg.patch_dim),
        TOWER + "patch_embedder.position_embedding_table": (2, cfg.position_embedding_size, D),
        EMBED + "embedding_projection.weight": (cfg.text_hidden_size, D),
    }
    if cfg.standardize:
        t[TOWER + "std_bias"] = (D,)
        t[TOWER + "std_scale"] = (D,)
    linears = {"self_attn.q_proj": (n * d, D), "self_attn.k_proj": (K * d, D), "self_attn.v_proj": (K * d, D),
               "self_attn.o_proj": (D, n * d), "mlp.gate_proj": (I, D), "mlp.up_proj": (I, D), "mlp.down_proj": (D, I)}
    for i in range(cfg.num_hidden_layers):
        p = f"{TOWER}encoder.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[p + norm + ".weight"] = (D,)
        t[p + "self_attn.q_norm.weight"] = (d,)
        t[p + "self_attn.k_norm.weight"] = (d,)
        for name, shape in linears.items():
            t.update(clippable_tensors(p + name, shape, cfg.use_clipped_linears))
    return t


class VisionWeights(TowerWeights):
    """The vision tensors of one checkpoint, validated against its config, decoded on demand.

    Only ``model.vision_tower.*`` and ``model.embed_vision.*`` are read (and checked: missing,
    mis-shaped and unexpected tensors under those prefixes are one error). The position table is
    read row by row from the memory map, never whole.
    """

    what = "vision"
    prefixes = (TOWER, EMBED)
    parse_config = staticmethod(parse_vision_config)
    expected_tensors = staticmethod(expected_vision_tensors)

    def unexpected_hint(self, name: str) -> str:
        return super().unexpected_hint(name) or (" (standardize buffers, but the config sets standardize to false)"
                                                 if name in (TOWER + "std_bias", TOWER + "std_scale") else "")

    def position_rows(self, axis: int, index: np.ndarray) -> np.ndarray:
        """T[axis, index] [N, D] of the position table (axis 0: x, 1: y), gathered from the memory map."""
        return self.store.rows(TOWER + "patch_embedder.position_embedding_table", (axis, index), self.dtype)


# ----------------------------------------------------------------------------------------------
# the math, one step per function


def patch_embed(pixels: np.ndarray, input_proj: np.ndarray) -> np.ndarray:
    """pixels [N, C] in [0, 1] -> W_in (2 (x - 0.5)) [N, D]; no bias, no mean/std normalisation."""
    return linear(2.0 * (pixels - 0.5), input_proj)


def position_embed(rows_x: np.ndarray, rows_y: np.ndarray) -> np.ndarray:
    """Factorised 2-D learned position: T[0, x] + T[1, y]; rows_x/rows_y [N, D] already gathered."""
    return rows_x + rows_y


def vision_rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[d/4]: 1 / theta^(2j / s) over the per-axis width s = d/2 (not over d)."""
    s = head_dim // 2
    return 1.0 / theta ** (np.arange(0, s, 2) / s)


def vision_rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, ...]:
    """positions [N, 2] (x, y), inv_freq [d/4] (float64) -> cos_x, sin_x, cos_y, sin_y, each [N, d/4], in
    float64: the angles of each axis, for ``apply_rope_2d``."""
    return (*rope_cos_sin(positions[:, 0], inv_freq), *rope_cos_sin(positions[:, 1], inv_freq))


def vision_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [N, n, d], k/v [N, K, d] -> [N, n, d]: every patch sees every patch, scale 1.0."""
    N = q.shape[0]
    return attention(q, k, v, np.ones((N, N), dtype=bool))


def avg_pool_by_position(h: np.ndarray, positions: np.ndarray, k: int) -> np.ndarray:
    """h [N, D] over a full (ph, pw) grid -> [ph/k * pw/k, D]: mean of each k x k block (divisor k^2),
    row-major over the pooled grid: slot = (y // k) * (pw / k) + x // k."""
    pw = int(positions[:, 0].max()) + 1
    ph = int(positions[:, 1].max()) + 1
    slot = (positions[:, 1] // k) * (pw // k) + positions[:, 0] // k
    out = np.zeros(((ph // k) * (pw // k), h.shape[-1]), dtype=h.dtype)
    np.add.at(out, slot, h)
    return out / (k * k)


def scale_pooled(h: np.ndarray, hidden_size: int) -> np.ndarray:
    """The pooler's sqrt(D) factor (before standardize)."""
    return h * hidden_size**0.5


def standardize(h: np.ndarray, std_bias: np.ndarray, std_scale: np.ndarray) -> np.ndarray:
    """(h - std_bias) * std_scale, per channel (26B/31B towers)."""
    return (h - std_bias) * std_scale


def embed_vision(h: np.ndarray, projection: np.ndarray, eps: float) -> np.ndarray:
    """Soft tokens [M, D] -> text width [M, H]: scale-free RMSNorm, then embedding_projection (no bias)."""
    return linear(rms_norm(h, None, eps), projection)


# ----------------------------------------------------------------------------------------------
# layers and the tower


def encoder_attention(x: np.ndarray, p: str, w: VisionWeights, cfg: VisionConfig,
                      rope: tuple[np.ndarray, ...]) -> np.ndarray:
    """Attention sub-block on the input-normed x [N, D]: q/k norms with weight, v norm without, 2-D RoPE."""
    N, n, K, d, eps = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    a = p + "self_attn."
    q = w.clippable(x, a + "q_proj").reshape(N, n, d)
    k = w.clippable(x, a + "k_proj").reshape(N, K, d)
    v = w.clippable(x, a + "v_proj").reshape(N, K, d)
    q = apply_rope_2d(rms_norm(q, w[a + "q_norm.weight"], eps), *rope)
    k = apply_rope_2d(rms_norm(k, w[a + "k_norm.weight"], eps), *rope)
    v = rms_norm(v, None, eps)
    o = vision_attention(q, k, v).reshape(N, n * d)
    return w.clippable(o, a + "o_proj")


def encoder_mlp(x: np.ndarray, p: str, w: VisionWeights) -> np.ndarray:
    """GeGLU on the pre-FFN-normed x [N, D]: down(gelu_tanh(gate x) * up x), each a clippable linear."""
    m = p + "mlp."
    gate = w.clippable(x, m + "gate_proj")
    up = w.clippable(x, m + "up_proj")
    return w.clippable(geglu(gate, up), m + "down_proj")


def encoder_layer(i: int, h: np.ndarray, w: VisionWeights, cfg: VisionConfig,
                  rope: tuple[np.ndarray, ...]) -> np.ndarray:
    """Sandwich layer: h + post_attn_norm(attn(input_norm h)); then h + post_ffn_norm(mlp(pre_ffn_norm h))."""
    p, eps = f"{TOWER}encoder.layers.{i}.", cfg.rms_norm_eps
    a = encoder_attention(rms_norm(h, w[p + "input_layernorm.weight"], eps), p, w, cfg, rope)
    h = h + rms_norm(a, w[p + "post_attention_layernorm.weight"], eps)
    m = encoder_mlp(rms_norm(h, w[p + "pre_feedforward_layernorm.weight"], eps), p, w)
    return h + rms_norm(m, w[p + "post_feedforward_layernorm.weight"], eps)


def real_patches(pixel_patches, positions, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Check one image's inputs and drop its padding rows (position (-1, -1)).

    Returns (pixels [N, C], positions [N, 2] int64) of the real patches. Raises ``InputError`` for
    wrong shapes, other negative or out-of-table positions, or real patches that do not cover one
    full grid whose sides are multiples of the pooling kernel.
    """
    pixels = np.asarray(pixel_patches)
    pos = np.asarray(positions)
    C, k = cfg.patch_dim, cfg.pooling_kernel_size
    if pixels.ndim != 2 or pixels.shape[1] != C or not np.issubdtype(pixels.dtype, np.floating):
        raise InputError(
            f"pixel_patches must be a float array [N, 3*p*p] = [N, {C}] (one image, patchified), got "
            f"{pixels.dtype} {list(pixels.shape)}"
        )
    if pos.shape != (pixels.shape[0], 2) or not np.issubdtype(pos.dtype, np.integer):
        raise InputError(
            f"positions must be an integer array [N, 2] = [{pixels.shape[0]}, 2] of (x, y), got {pos.dtype} "
            f"{list(pos.shape)}"
        )
    pad = np.all(pos == -1, axis=-1)
    pixels, pos = pixels[~pad], pos[~pad].astype(np.int64)
    if pos.shape[0] == 0:
        raise InputError("every patch is padding (position (-1, -1)); an image needs at least one real patch")
    bad = np.nonzero((pos < 0).any(axis=-1))[0]
    if bad.size:
        raise InputError(
            f"real patch {int(bad[0])} has position (x, y) = {tuple(int(v) for v in pos[bad[0]])}; "
            "only (-1, -1) marks a padding patch and real positions are >= 0"
        )
    over = np.nonzero((pos >= cfg.position_embedding_size).any(axis=-1))[0]
    if over.size:
        raise InputError(
            f"patch position {tuple(int(v) for v in pos[over[0]])} is outside the position table "
            f"[0, {cfg.position_embedding_size}) (position_embedding_size)"
        )
    pw, ph = int(pos[:, 0].max()) + 1, int(pos[:, 1].max()) + 1
    cells = np.unique(pos[:, 1] * pw + pos[:, 0])
    if cells.size != pos.shape[0] or cells.size != pw * ph:
        raise InputError(
            f"the {pos.shape[0]} real patches do not cover their {ph} x {pw} (rows x columns) grid exactly once "
            f"({cells.size} distinct cells of {pw * ph}); pass every patch of the image once"
        )
    if pw % k or ph % k:
        raise InputError(
            f"the patch grid is {ph} x {pw} (rows x columns); both sides must be multiples of the pooling kernel "
            f"{k} (the image processor resizes to multiples of pooling_kernel_size * patch_size)"
        )
    return pixels, pos


def vision_tower(pixel_patches, positions, weights: VisionWeights, cfg: VisionConfig,
                 trace: Trace | None = None) -> np.ndarray:
    """Soft tokens [M, H] (text width) of one image, M = real patches / k^2, row-major over the pooled grid.

    ``pixel_patches`` [N, 3 p^2] and ``positions`` [N, 2] (x, y) as the image processor emits them for
    one image, padding rows (-1, -1) included or not. Computes in ``weights.dtype``. ``trace``, when
    given, receives "patch_embed" [N, D], "layers.{i}" [N, D], "pooled" [M, D] (after sqrt(D)),
    "standardized" [M, D] (if the config standardizes) and "soft_tokens" [M, H].
    """
    w, dt = weights, weights.dtype
    pixels, pos = real_patches(pixel_patches, positions, cfg)
    rope = tuple(a.astype(dt) for a in vision_rope_cos_sin(pos, vision_rope_inv_freq(cfg.head_dim, cfg.rope_theta)))

    h = patch_embed(pixels.astype(dt), w[TOWER + "patch_embedder.input_proj.weight"])
    h = h + position_embed(w.position_rows(0, pos[:, 0]), w.position_rows(1, pos[:, 1]))
    if trace is not None:
        trace.put("patch_embed", h)
    for i in range(cfg.num_hidden_layers):
        h = encoder_layer(i, h, w, cfg, rope)
        if trace is not None:
            trace.put(f"layers.{i}", h)

    s = scale_pooled(avg_pool_by_position(h, pos, cfg.pooling_kernel_size), cfg.hidden_size)
    if trace is not None:
        trace.put("pooled", s)
    if cfg.standardize:
        s = standardize(s, w[TOWER + "std_bias"], w[TOWER + "std_scale"])
        if trace is not None:
            trace.put("standardized", s)
    e = w.check_finite(embed_vision(s, w[EMBED + "embedding_projection.weight"], cfg.rms_norm_eps))
    if trace is not None:
        trace.put("soft_tokens", e)
    return e


def vision_tower_batch(pixel_values, image_position_ids, weights: VisionWeights,
                       cfg: VisionConfig) -> list[np.ndarray]:
    """The processor's batch ``pixel_values`` [B, N, 3 p^2], ``image_position_ids`` [B, N, 2] -> one
    [M_i, H] array per image. Concatenated in order they are the rows transformers scatters into the
    image-token positions."""
    pixel_values, image_position_ids = np.asarray(pixel_values), np.asarray(image_position_ids)
    if pixel_values.ndim != 3 or image_position_ids.ndim != 3 or pixel_values.shape[0] != image_position_ids.shape[0]:
        raise InputError(
            f"pixel_values must be [B, N, 3*p*p] and image_position_ids [B, N, 2], got {list(pixel_values.shape)} "
            f"and {list(image_position_ids.shape)}"
        )
    return [vision_tower(x, p, weights, cfg) for x, p in zip(pixel_values, image_position_ids, strict=True)]


def load_vision_tower(model_dir: str | Path, dtype: str | np.dtype = "float64") -> tuple[VisionWeights, VisionConfig]:
    """(weights, cfg) of a checkpoint directory's vision tower, for ``vision_tower(..., weights, cfg)``."""
    return VisionWeights.load(model_dir, dtype)


__all__: Sequence[str] = [
    "VisionConfig", "VisionWeights", "parse_vision_config", "load_vision_config", "load_vision_tower",
    "expected_vision_tensors", "vision_tower", "vision_tower_batch", "real_patches",
]
