"""The oracle's toolbox: every math primitive of the text decoder and the vision and audio towers,
defined once, each a small pure function of NumPy arrays (picoGPT style).

``model.py``, ``vision.py`` and ``audio.py`` are the model math written over these; the steps that
belong to one architecture (RoPE frequencies from a config, MoE routing, per-layer inputs, patch
pooling, the conformer's subsampling, blocked local attention and relative positions) stay there.
Nothing here reads a config, a weight name or a checkpoint.

Every function computes in the dtype of its inputs (float64 for the exact oracle, float32 on request)
and evaluates its formula in the order written: the oracle's results are bit-for-bit those of these
definitions, so an edit here is an edit to every golden.

Nothing here is scheduled: every function is the step in one call, on the whole input. How the oracle
runs them on a large input (in blocks of rows, over the threads) is ``schedule.py``'s, which wraps these
definitions without changing them; the model modules take the scheduled steps from there.

Shapes: T queries, S keys, N query heads, K KV heads (G = N / K), D head dim, in/out feature widths.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .safetensors_io import bf16_to_f32, f32_to_bf16

# ----------------------------------------------------------------------------------------------
# linear maps


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [T, in] @ weight[out, in]^T -> [T, out] (no biases anywhere in Gemma 4)."""
    return x @ weight.T


def clipped_linear(x: np.ndarray, weight: np.ndarray, bounds: tuple[float, float, float, float] | None) -> np.ndarray:
    """clamp(clamp(x, in_min, in_max) W^T, out_min, out_max); a plain linear when bounds is None."""
    if bounds is None:
        return linear(x, weight)
    in_min, in_max, out_min, out_max = bounds
    return np.clip(linear(np.clip(x, in_min, in_max), weight), out_min, out_max)


# ----------------------------------------------------------------------------------------------
# norms, activations, caps


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x [..., D] -> x / sqrt(mean(x^2) + eps) * weight. Gemma 4 uses w, not 1 + w; None = scale-free.

    The mean is NumPy's pairwise sum (einsum's running sum loses 3x more in float32)."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y *= weight
    return y


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D] -> (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, population variance over the
    last axis (torch's nn.LayerNorm; Gemma 4 Unified's vision embedder, eps 1e-5)."""
    c = x - np.mean(x, axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps) * weight + bias


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    Evaluated step by step in one buffer (the [T, I] MLP activations are the largest the layer makes);
    every step is the rounding of the formula read left to right, with x^3 = (x x) x as torch's
    pow(x, 3) computes it (NumPy's x**3 calls pow(), 20x slower) and 0.5 (x y) = (0.5 x) y exactly."""
    t = x * x
    t *= x  # x^3
    t *= 0.044715
    t += x
    t *= math.sqrt(2.0 / math.pi)
    np.tanh(t, out=t)
    t += 1.0
    t *= x
    t *= 0.5
    return t


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x)."""
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), computed as x / (1 + e^-x)."""
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), overflow-free."""
    return np.logaddexp(0.0, x)  # (a Python 0: the result keeps x's dtype and array module)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum(exp(x - max)) along ``axis``, in one new buffer."""
    e = x - np.max(x, axis=axis, keepdims=True)
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def softcap(logits: np.ndarray, cap: float | None, out: np.ndarray | None = None) -> np.ndarray:
    """cap * tanh(logits / cap); identity when the config has no cap. ``out``: an array of logits' shape
    to write the result into (the LM head's columns of the full logits), else a new one (or logits
    itself, uncapped)."""
    if cap is None:
        if out is None:
            return logits
        np.copyto(out, logits)
        return out
    if out is not None and out.dtype != logits.dtype:  # computed in logits' dtype, then stored
        np.copyto(out, softcap(logits, cap))
        return out
    y = np.divide(logits, cap, out=out)
    np.tanh(y, out=y)
    y *= cap  # (= cap * tanh(...): the one product, rounded once)
    return y


def clamp(x: np.ndarray, limit: float) -> np.ndarray:
    """clamp(x, -g, g) with g = min(limit, largest finite value of x's dtype)."""
    g = min(limit, float(np.finfo(x.dtype).max))
    return np.clip(x, -g, g)


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The gated activation of a GeGLU MLP: gelu_tanh(gate) * up, both [T, I]."""
    y = gelu_tanh(gate)
    return np.multiply(y, up, out=y) if y.dtype == np.result_type(y, up) else y * up  # (in place: one array fewer)


def geglu_table(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``geglu`` as ggml's CPU computes it with GGML_GELU_FP16 (the stock library): gate rounded to fp16 (through
    float32), its GELU looked up in a table of fp16 values (here the float64 GELU of the fp16 input, rounded to
    fp16; ggml tabulates float32's), 0 at or below -10 and the gate itself at or above 10, times up."""
    x16 = fp16(gate)
    y = fp16(gelu_tanh(x16))
    y = np.where(gate <= -10.0, 0.0, np.where(gate >= 10.0, gate, y))
    return y * up


def mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """GeGLU: (gelu_tanh(x gate^T) * (x up^T)) down^T; x [T, H] -> [T, H]."""
    return linear(geglu(linear(x, gate), linear(x, up)), down)


def bf16_round(x: float) -> float:
    """Round a float to the nearest bfloat16 value (ties to even), via float32 as the checkpoint codec does."""
    return float(bf16_to_f32(f32_to_bf16(np.array([x], dtype=np.float32)))[0])


# ----------------------------------------------------------------------------------------------
# rotary position embedding (rotate-half / NeoX pairs (i, i + D/2)); the frequencies come from each model


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """positions [T], inv_freq [D/2] -> cos, sin [T, D/2] of the angles p * inv_freq."""
    angles = positions[:, None].astype(inv_freq.dtype) * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, D]; rotate-half (NeoX): out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def norm_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """apply_rope(rms_norm(x, weight, eps), cos, sin) for x [T, heads, D] (the q and k norms; one step, so
    that a schedule can take each block of rows through both while it is in the core's cache)."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def apply_rope_2d(x: np.ndarray, cos_x: np.ndarray, sin_x: np.ndarray, cos_y: np.ndarray,
                  sin_y: np.ndarray) -> np.ndarray:
    """x [T, heads, D]: rotate-half RoPE of channels [0, D/2) by the x angles and [D/2, D) by the y angles."""
    s = x.shape[-1] // 2
    return np.concatenate([apply_rope(x[..., :s], cos_x, sin_x), apply_rope(x[..., s:], cos_y, sin_y)], axis=-1)


# ----------------------------------------------------------------------------------------------
# attention


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """bool [T, S]: key k is visible to query q iff k <= q and, on sliding layers, q - k <= W - 1.
    Compared as k <= q and k > q - W, so that no [T, S] array of position differences (int64, as large as
    float64 scores: 27 GiB at 60k tokens) is made: only the bool masks themselves."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > (q_pos - window)[:, None]
    return allowed


def vision_block_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int, q_blocks: np.ndarray,
                      k_blocks: np.ndarray) -> np.ndarray:
    """bool [T, S] of a sliding layer with vision blocks (multimodal spec 7.2):
    (q - k <= W - 1) and (k <= q or b(q) = b(k) >= 0). The window bounds only the past side: a token of
    an image block sees every later token of its own block. Blocks are ids >= 0; -1 is outside. Bool arrays
    only, as ``attention_mask``."""
    return (k_pos[None, :] > (q_pos - window)[:, None]) & ((k_pos[None, :] <= q_pos[:, None])
                                                            | same_block(q_blocks, k_blocks))


def same_block(q_blocks: np.ndarray, k_blocks: np.ndarray) -> np.ndarray:
    """bool [T, S]: query and key lie in the same vision block (ids >= 0; -1 is outside every block)."""
    return (q_blocks[:, None] == k_blocks[None, :]) & (q_blocks[:, None] >= 0)


def vision_overlay_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None, q_blocks: np.ndarray,
                        k_blocks: np.ndarray) -> np.ndarray:
    """bool [T, S] of the Gemma 3 style rule (Unified spec A9, rule A; transformers 5.24's default
    ``Gemma4UnifiedModel.forward``): the causal or sliding mask, then every same-block pair opened on
    top of it, on full and sliding layers alike: ``attention_mask(q, k, W) or same block`` (unclamped:
    a block longer than the window sees all of itself)."""
    return attention_mask(q_pos, k_pos, window) | same_block(q_blocks, k_blocks)


def fp16(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16 through float32 (ggml's conversion of a float32 tensor to F16), in x's dtype."""
    return x.astype(np.float32).astype(np.float16).astype(x.dtype)


def masked_softmax(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``softmax`` over the last axis of scores [..., S] with the entries where ``mask`` (broadcast to scores' shape)
    is False at probability 0: their scores set to -inf first. In scores' buffer."""
    np.copyto(scores, -np.inf, where=~mask)
    return softmax(scores, axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, half: bool = False,
              masked_softmax: Callable[[np.ndarray, np.ndarray], np.ndarray] = masked_softmax) -> np.ndarray:
    """q [T, N, D], k/v [S, K, D], mask [T, S] -> [T, N, D]: softmax(q k^T + mask) v per head. Scale 1.0, no
    softcap, GQA head j -> KV head j // G. ``half``: the products with an fp16 K/V cache as ggml's CPU matmul
    takes them (the queries and the probabilities rounded to fp16 for their products; K and V are the
    caller's, already in fp16). ``masked_softmax``: the step that turns the scores into probabilities (this
    module's; a schedule may give the same step run otherwise).

    The G query heads of a KV head are rows of one product: q as [K, T G, D] (t major, a view when K = 1),
    so the scores [K, T G, S] and the output [K, T G, D] come from one matrix product per KV head, the
    output already in [T, N, D] order when K = 1."""
    T, N, D = q.shape
    S, K = k.shape[:2]
    G = N // K
    qk = q.reshape(T, K, G, D).transpose(1, 0, 2, 3).reshape(K, T * G, D)  # [K, T G, D]
    if half:
        qk = fp16(qk)
    scores = (qk @ k.transpose(1, 2, 0)).reshape(K, T, G, S)  # [K, T G, D] @ [K, D, S] -> [K, T, G, S]
    probs = masked_softmax(scores, mask[None, :, None, :])  # masked keys get probability 0
    if half:
        probs = fp16(probs)
    out = probs.reshape(K, T * G, S) @ v.transpose(1, 0, 2)  # [K, T G, S] @ [K, S, D] -> [K, T G, D]
    return out.reshape(K, T, G, D).transpose(1, 0, 2, 3).reshape(T, N, D)
