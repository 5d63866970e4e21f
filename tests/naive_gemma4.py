"""Deliberately naive reference implementation of the Gemma 4 text decoder.

This file is a *cross-check* for the project's real NumPy oracle in ``refimpl/``.
It was written only from ``gemma4-text-spec.md`` (sections 2, 3, 4, 5, 10, 12),
and it must stay independent of ``refimpl/`` and ``conformance/``: do not import
from them, do not copy code from them, and do not "simplify" this file by
sharing helpers with them. If both implementations agree, that is evidence that
both read the spec correctly; if this one starts reusing the other, that
evidence is gone.

Style is intentionally naive: explicit Python loops over tokens, layers, heads
and keys, scalar math from ``math``, hand-written RMSNorm / softmax / RoPE /
GELU. numpy is used for storage and for 1-D dot products only. Everything is
float64. It is slow and meant only for micro configs.

Public API: ``naive_forward(config, weights, ids, embed_scale=None)``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["naive_forward"]

SLIDING = "sliding_attention"
FULL = "full_attention"


# ---------------------------------------------------------------------------
# small scalar-ish primitives (spec section 3)
# ---------------------------------------------------------------------------

def _gelu_tanh(x: float) -> float:
    """gelu_pytorch_tanh for one scalar."""
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + math.tanh(c * (x + 0.044715 * x * x * x)))


def _rmsnorm(vec, weight, eps: float) -> np.ndarray:
    """y_i = x_i * (mean(x^2) + eps)^(-1/2) * w_i  (w used directly, not 1+w).

    ``weight=None`` gives the scale-free variant (v_norm, router norm).
    """
    n = len(vec)
    sum_sq = 0.0
    for i in range(n):
        sum_sq += float(vec[i]) * float(vec[i])
    inv = 1.0 / math.sqrt(sum_sq / n + eps)
    out = np.zeros(n, dtype=np.float64)
    for i in range(n):
        out[i] = float(vec[i]) * inv
        if weight is not None:
            out[i] *= float(weight[i])
    return out


def _matvec(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = W @ x for a PyTorch-convention weight W [out, in], one row at a time."""
    out = np.zeros(w.shape[0], dtype=np.float64)
    for r in range(w.shape[0]):
        out[r] = float(np.dot(w[r], x))
    return out


def _softmax(values: list[float]) -> list[float]:
    m = max(values)
    exps = [math.exp(v - m) for v in values]
    s = sum(exps)
    return [e / s for e in exps]


def _rope(vec: np.ndarray, pos: int, inv_freq: list[float]) -> np.ndarray:
    """Rotate-half RoPE: dim i is paired with dim i + D/2."""
    d = len(vec)
    half = d // 2
    out = np.array(vec, dtype=np.float64)
    for i in range(half):
        angle = pos * inv_freq[i]
        c = math.cos(angle)
        s = math.sin(angle)
        x1 = float(vec[i])
        x2 = float(vec[i + half])
        out[i] = x1 * c - x2 * s
        out[i + half] = x2 * c + x1 * s
    return out


# ---------------------------------------------------------------------------
# config interpretation (spec section 2, 4.3, 4.6)
# ---------------------------------------------------------------------------

def _layer_types(config: dict) -> list[str]:
    n_layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n_layers)]
    types = list(types)
    if len(types) != n_layers:
        raise ValueError("layer_types length does not match num_hidden_layers")
    # Spec section 2.1: the last layer is forced to full attention.
    types[-1] = FULL
    return types


def _inv_freq(rope: dict, head_dim: int) -> list[float]:
    """inv_freq of length head_dim/2 for one layer type."""
    rope_type = rope.get("rope_type", "default")
    theta = float(rope.get("rope_theta", 10000.0))
    half = head_dim // 2
    inv = []
    if rope_type == "default":
        prf = rope.get("partial_rotary_factor", 1.0)
        if prf is not None and float(prf) != 1.0:
            raise NotImplementedError("partial default RoPE is not used by Gemma 4")
        for i in range(half):
            inv.append(theta ** (-(2.0 * i) / head_dim))
    elif rope_type == "proportional":
        prf = float(rope.get("partial_rotary_factor", 1.0))
        factor = float(rope.get("factor", 1.0) or 1.0)
        n_rot = int(prf * head_dim // 2)
        for i in range(half):
            if i < n_rot:
                # denominator is the FULL head dim, not the rotated part
                inv.append(theta ** (-(2.0 * i) / head_dim) / factor)
            else:
                inv.append(0.0)
    else:
        raise NotImplementedError(f"rope_type {rope_type!r}")
    return inv


def _rope_params(config: dict) -> dict:
    rp = config.get("rope_parameters")
    defaults = {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
               "rope_theta": 1000000.0},
    }
    if rp is None:
        return defaults
    return {SLIDING: rp.get(SLIDING, defaults[SLIDING]), FULL: rp.get(FULL, defaults[FULL])}


def _kv_source(types: list[str], n_shared: int) -> list[int | None]:
    """For each layer: None if it owns its K/V, else the index of its source layer."""
    n_layers = len(types)
    first = n_layers - n_shared
    src: list[int | None] = []
    for layer in range(n_layers):
        if n_shared <= 0 or layer < first:
            src.append(None)
            continue
        found = None
        for j in range(first - 1, -1, -1):  # last layer before `first` of the same type
            if types[j] == types[layer]:
                found = j
                break
        if found is None:
            raise ValueError(f"no KV producer of type {types[layer]} before layer {first}")
        src.append(found)
    return src


# ---------------------------------------------------------------------------
# the forward pass (spec section 4, pseudocode in section 10)
# ---------------------------------------------------------------------------

def _visible(qi: int, kj: int, is_full: bool, window: int, blocks, rule: str) -> bool:
    """Whether query qi sees key kj. Causal (and on sliding layers 0 <= q-k <= W-1); with vision
    ``blocks`` (a block id per token, -1 outside) rule "sliding-clamped" also opens same-block keys on
    sliding layers, still inside the past window, and rule "all-unclamped" opens them on every layer,
    whatever the window (unified spec A9)."""
    base = kj <= qi and (is_full or qi - kj <= window - 1)
    if blocks is None:
        return base
    same = blocks[qi] >= 0 and blocks[qi] == blocks[kj]
    if rule == "all-unclamped":
        return base or same
    if is_full:
        return base
    return qi - kj <= window - 1 and (kj <= qi or same)


def naive_forward(config: dict, weights: dict, ids: list[int],
                  embed_scale: float | None = None, inputs=None, blocks=None,
                  rule: str = "sliding-clamped", hidden: bool = False) -> np.ndarray:
    """Logits [T, V] (float64) for every position of the token list ``ids``; with ``hidden``, the
    final-normed hidden states [T, H] instead (the LM head's input).

    ``inputs`` (a [T, H] array): the input rows instead of the scaled token embeddings (image and audio
    soft tokens merged in); ``blocks`` / ``rule``: vision blocks and the mask rule (``_visible``). A
    Gemma 4 Unified text config (model_type gemma4_unified_text) has no PLE and no MoE, whatever its
    PLE / MoE fields say."""
    def w(name):
        return np.asarray(weights[name], dtype=np.float64)

    H = int(config["hidden_size"])
    L = int(config["num_hidden_layers"])
    N = int(config["num_attention_heads"])
    kv_heads = int(config["num_key_value_heads"])
    head_dim = int(config["head_dim"])
    global_head_dim = int(config.get("global_head_dim") or 512)
    global_kv = config.get("num_global_key_value_heads")
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    unified = str(config.get("model_type", "")).startswith("gemma4_unified")
    window = int(config.get("sliding_window") or (1024 if unified else 512))
    P = 0 if unified else int(config.get("hidden_size_per_layer_input") or 0)
    n_shared = int(config.get("num_kv_shared_layers") or 0)
    double_wide = bool(config.get("use_double_wide_mlp", False))
    moe = False if unified else bool(config.get("enable_moe_block", False))
    top_k = int(config["top_k_experts"]) if moe else 0
    cap = config.get("final_logit_softcapping")
    eps = float(config.get("rms_norm_eps", 1e-6))
    V = int(config["vocab_size"])

    types = _layer_types(config)
    rope_params = _rope_params(config)
    src_of = _kv_source(types, n_shared)
    inv_freq_by_type = {
        SLIDING: _inv_freq(rope_params[SLIDING], head_dim),
        FULL: _inv_freq(rope_params[FULL], global_head_dim),
    }
    if embed_scale is None:
        embed_scale = math.sqrt(H)
    T = len(ids)

    # 4.1 scaled token embedding
    emb = w("embed_tokens.weight")
    x = [emb[ids[t]] * embed_scale for t in range(T)] if inputs is None else [np.array(r, dtype=np.float64)
                                                                               for r in inputs]
    x0 = [row.copy() for row in x]

    # 4.2 per-layer embeddings: ple[t][layer] is a [P] vector
    ple = None
    if P > 0:
        ple_table = w("embed_tokens_per_layer.weight")
        ple_proj = w("per_layer_model_projection.weight")
        ple_norm_w = w("per_layer_projection_norm.weight")
        ple = []
        for t in range(T):
            ctx_all = _matvec(ple_proj, x0[t]) * (H ** -0.5)
            tok_all = ple_table[ids[t]] * math.sqrt(P)
            per_layer = []
            for layer in range(L):
                ctx = _rmsnorm(ctx_all[layer * P:(layer + 1) * P], ple_norm_w, eps)
                tok = tok_all[layer * P:(layer + 1) * P]
                per_layer.append((ctx + tok) * (2.0 ** -0.5))
            ple.append(per_layer)

    kv_store = {}  # layer index -> (k[t][kv_head], v[t][kv_head]) post-norm, post-RoPE
    for layer in range(L):
        pre = f"layers.{layer}."
        is_full = types[layer] == FULL
        D = global_head_dim if is_full else head_dim
        K = kv_heads
        if is_full and k_eq_v and global_kv is not None:
            K = int(global_kv)
        inv_freq = inv_freq_by_type[types[layer]]

        # ---- (a) attention ------------------------------------------------
        wq = w(pre + "self_attn.q_proj.weight")
        q_norm_w = w(pre + "self_attn.q_norm.weight")
        h = [_rmsnorm(x[t], w(pre + "input_layernorm.weight"), eps) for t in range(T)]
        q = []  # q[t][head] -> [D]
        for t in range(T):
            flat = _matvec(wq, h[t])
            heads = []
            for j in range(N):
                qj = _rmsnorm(flat[j * D:(j + 1) * D], q_norm_w, eps)
                heads.append(_rope(qj, t, inv_freq))
            q.append(heads)

        if src_of[layer] is None:
            wk = w(pre + "self_attn.k_proj.weight")
            k_norm_w = w(pre + "self_attn.k_norm.weight")
            use_k_as_v = is_full and k_eq_v
            wv = None if use_k_as_v else w(pre + "self_attn.v_proj.weight")
            k_all, v_all = [], []
            for t in range(T):
                k_raw = _matvec(wk, h[t])
                v_raw = k_raw if use_k_as_v else _matvec(wv, h[t])
                k_heads, v_heads = [], []
                for g in range(K):
                    kg = _rmsnorm(k_raw[g * D:(g + 1) * D], k_norm_w, eps)
                    k_heads.append(_rope(kg, t, inv_freq))
                    v_heads.append(_rmsnorm(v_raw[g * D:(g + 1) * D], None, eps))
                k_all.append(k_heads)
                v_all.append(v_heads)
            kv_store[layer] = (k_all, v_all)
        else:
            k_all, v_all = kv_store[src_of[layer]]
            K = len(k_all[0])
            if len(k_all[0][0]) != D:
                raise ValueError("shared KV head dim mismatch")

        group = N // K
        wo = w(pre + "self_attn.o_proj.weight")
        r = []
        for qi in range(T):
            attn_flat = np.zeros(N * D, dtype=np.float64)
            for j in range(N):
                g = j // group
                keys = [kj for kj in range(T) if _visible(qi, kj, is_full, window, blocks, rule)]
                scores = [float(np.dot(q[qi][j], k_all[kj][g])) * 1.0 for kj in keys]
                probs = _softmax(scores)
                for p, kj in zip(probs, keys, strict=True):
                    for d in range(D):
                        attn_flat[j * D + d] += p * v_all[kj][g][d]
            o = _matvec(wo, attn_flat)
            o = _rmsnorm(o, w(pre + "post_attention_layernorm.weight"), eps)
            r.append(x[qi] + o)

        # ---- (b) feed-forward ---------------------------------------------
        wg = w(pre + "mlp.gate_proj.weight")
        wu = w(pre + "mlp.up_proj.weight")
        wd = w(pre + "mlp.down_proj.weight")
        if double_wide and src_of[layer] is not None:
            assert wg.shape[0] == 2 * int(config["intermediate_size"])
        new_x = []
        for t in range(T):
            u = _rmsnorm(r[t], w(pre + "pre_feedforward_layernorm.weight"), eps)
            gate = _matvec(wg, u)
            up = _matvec(wu, u)
            act = np.array([_gelu_tanh(gate[i]) * up[i] for i in range(len(gate))])
            m = _matvec(wd, act)
            if not moe:
                m = _rmsnorm(m, w(pre + "post_feedforward_layernorm.weight"), eps)
            else:
                m1 = _rmsnorm(m, w(pre + "post_feedforward_layernorm_1.weight"), eps)
                # router reads the un-normalised residual r
                z = _rmsnorm(r[t], None, eps)
                scale = w(pre + "router.scale")
                for i in range(H):
                    z[i] = z[i] * scale[i] * (H ** -0.5)
                logits = _matvec(w(pre + "router.proj.weight"), z)
                probs = _softmax([float(v) for v in logits])
                order = sorted(range(len(probs)), key=lambda e: (-probs[e], e))
                chosen = order[:top_k]
                total = sum(probs[e] for e in chosen)
                per_expert = w(pre + "router.per_expert_scale")
                u2 = _rmsnorm(r[t], w(pre + "pre_feedforward_layernorm_2.weight"), eps)
                gate_up = w(pre + "experts.gate_up_proj")
                down = w(pre + "experts.down_proj")
                im = gate_up.shape[1] // 2
                m2 = np.zeros(H, dtype=np.float64)
                for e in chosen:
                    weight_e = probs[e] / total * float(per_expert[e])
                    gu = _matvec(gate_up[e], u2)
                    act_e = np.array([_gelu_tanh(gu[i]) * gu[im + i] for i in range(im)])
                    y_e = _matvec(down[e], act_e)
                    for i in range(H):
                        m2[i] += weight_e * y_e[i]
                m2 = _rmsnorm(m2, w(pre + "post_feedforward_layernorm_2.weight"), eps)
                m = _rmsnorm(m1 + m2, w(pre + "post_feedforward_layernorm.weight"), eps)
            xt = r[t] + m

            # ---- (c) PLE injection, after the FFN residual ------------------
            if P > 0:
                gp = _matvec(w(pre + "per_layer_input_gate.weight"), xt)
                gp = np.array([_gelu_tanh(gp[i]) * ple[t][layer][i] for i in range(P)])
                gp = _matvec(w(pre + "per_layer_projection.weight"), gp)
                gp = _rmsnorm(gp, w(pre + "post_per_layer_input_norm.weight"), eps)
                xt = xt + gp

            # ---- (d) layer scalar on the whole residual -----------------------
            xt = xt * float(w(pre + "layer_scalar").reshape(-1)[0])
            new_x.append(xt)
        x = new_x

    # 4.8 final norm, tied head (unscaled embedding), soft-cap
    norm_w = w("norm.weight")
    if hidden:
        return np.array([_rmsnorm(x[t], norm_w, eps) for t in range(T)])
    out = np.zeros((T, V), dtype=np.float64)
    for t in range(T):
        y = _rmsnorm(x[t], norm_w, eps)
        for v in range(V):
            val = float(np.dot(emb[v], y))
            if cap is not None:
                val = float(cap) * math.tanh(val / float(cap))
            out[t, v] = val
    return out


# ---------------------------------------------------------------------------
# Gemma 4 Unified's processor and embedders (unified spec A5-A7), loop by loop
# ---------------------------------------------------------------------------

def naive_unified_patches(pixels: np.ndarray, M: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """An already-resized uint8 image [H', W', 3] -> padded patches [rows, 3 M^2] and positions
    [rows, 2]: patch m is the M x M block at grid cell (X, Y) = (m mod PW, m div PW), its values read
    row by row, column by column, channel by channel, divided by 255."""
    Hp, Wp, _ = pixels.shape
    PW = Wp // M
    n = (Hp // M) * PW
    patches = np.zeros((rows, 3 * M * M))
    positions = np.full((rows, 2), -1, dtype=np.int64)
    for m in range(n):
        X, Y = m % PW, m // PW
        i = 0
        for r in range(M):
            for c in range(M):
                for ch in range(3):
                    patches[m, i] = float(pixels[Y * M + r, X * M + c, ch]) / 255.0
                    i += 1
        positions[m] = (X, Y)
    return patches, positions


def _layer_norm(vec, weight, bias, eps: float) -> np.ndarray:
    n = len(vec)
    mean = math.fsum(float(v) for v in vec) / n
    var = math.fsum((float(v) - mean) ** 2 for v in vec) / n
    inv = 1.0 / math.sqrt(var + eps)
    return np.array([(float(vec[i]) - mean) * inv * float(weight[i]) + float(bias[i]) for i in range(n)])


def naive_vision_embedder(weights: dict, pixel_values: np.ndarray, positions: np.ndarray,
                          eps: float = 1e-6) -> np.ndarray:
    """Soft tokens [N_real, H]: per real row (no -1 coordinate), LN(1e-5) -> dense + bias -> LN -> + the
    two position rows -> LN -> weightless RMSNorm -> projection. ``weights`` by published name."""
    def w(name):
        return np.asarray(weights[name], dtype=np.float64)
    pre = "model.vision_embedder."
    table = w(pre + "pos_embedding")  # [S, 2, E]
    out = []
    for row, (x, y) in zip(pixel_values, positions, strict=True):
        if x == -1 or y == -1:
            continue
        h = _layer_norm(row, w(pre + "patch_ln1.weight"), w(pre + "patch_ln1.bias"), 1e-5)
        h = _matvec(w(pre + "patch_dense.weight"), h) + w(pre + "patch_dense.bias")
        h = _layer_norm(h, w(pre + "patch_ln2.weight"), w(pre + "patch_ln2.bias"), 1e-5)
        h = np.array([h[i] + table[x, 0, i] + table[y, 1, i] for i in range(len(h))])
        h = _layer_norm(h, w(pre + "pos_norm.weight"), w(pre + "pos_norm.bias"), 1e-5)
        out.append(_matvec(w("model.embed_vision.embedding_projection.weight"), _rmsnorm(h, None, eps)))
    return np.array(out)


def naive_audio_embedder(weights: dict, waveform: np.ndarray, A: int, eps: float = 1e-6) -> np.ndarray:
    """Soft tokens [ceil(n / A), H]: frames of A samples (the last zero-padded, values rounded to float32
    as the feature extractor emits them) -> weightless RMSNorm -> projection."""
    proj = np.asarray(weights["model.embed_audio.embedding_projection.weight"], dtype=np.float64)
    out = []
    for start in range(0, len(waveform), A):
        frame = [float(np.float32(waveform[start + i])) if start + i < len(waveform) else 0.0 for i in range(A)]
        out.append(_matvec(proj, _rmsnorm(np.array(frame), None, eps)))
    return np.array(out)
