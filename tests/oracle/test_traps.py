"""Model-level traps of gemma4-text-spec.md section 12, computed by hand on one-layer models.

The second row of a two-token prompt is written out in plain NumPy (norms, RoPE pair by pair,
softmax over two keys) and compared with the oracle's traced attention output. Two tokens are
needed: with one, attention returns V itself and the post-attention RMSNorm erases any scalar
factor, so a missing v_norm would be invisible.
"""

import json
import math

import numpy as np

from refimpl.model import Gemma4, Trace
from refimpl.safetensors_io import write_safetensors
from refimpl.synth import make_weights

S, F = "sliding_attention", "full_attention"


def one_layer(tmp_path, layer_type, k_eq_v):
    config = {
        "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "global_head_dim": 4, "intermediate_size": 8,
        "layer_types": [layer_type], "attention_k_eq_v": k_eq_v, "num_global_key_value_heads": 1,
        "hidden_size_per_layer_input": 0, "sliding_window": 4, "final_logit_softcapping": None,
    }
    if layer_type == S:  # the forced-full last layer would override a lone sliding layer; add a full one
        config["num_hidden_layers"] = 2
        config["layer_types"] = [S, F]
    weights = make_weights(config, seed=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path / "model.safetensors", {"model." + k: v for k, v in weights.items()})
    return Gemma4(tmp_path), {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}


def rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def rope(x, p, inv_freq):
    """Rotate-half RoPE of one head vector at position p, written out pair by pair."""
    half = len(x) // 2
    y = x.copy()
    for i in range(half):
        c, s = math.cos(p * inv_freq[i]), math.sin(p * inv_freq[i])
        y[i], y[i + half] = x[i] * c - x[i + half] * s, x[i + half] * c + x[i] * s
    return y


def second_row_attn_out(w, tokens, inv_freq, v_of):
    """attn_out of token 1 (position 1) in a two-token prompt, by hand. v_of(h, kr) defines V."""
    L0 = "layers.0."
    h = [rms(w["embed_tokens.weight"][t] * math.sqrt(8), w[L0 + "input_layernorm.weight"]) for t in tokens]
    kr = [x @ w[L0 + "self_attn.k_proj.weight"].T for x in h]
    k = [rope(rms(kr[p], w[L0 + "self_attn.k_norm.weight"]), p, inv_freq) for p in (0, 1)]
    v = [v_of(h[p], kr[p]) for p in (0, 1)]
    heads = []
    for j in range(2):  # both query heads read the single KV head
        q = rope(rms((h[1] @ w[L0 + "self_attn.q_proj.weight"].T)[4 * j:4 * j + 4],
                     w[L0 + "self_attn.q_norm.weight"]), 1, inv_freq)
        scores = np.array([q @ k[0], q @ k[1]])  # scale 1.0
        probs = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        heads.append(probs[0] * v[0] + probs[1] * v[1])
    o = np.concatenate(heads) @ w[L0 + "self_attn.o_proj.weight"].T
    return rms(o, w[L0 + "post_attention_layernorm.weight"])


def test_k_eq_v_uses_the_scale_free_normed_raw_key(tmp_path):
    model, w = one_layer(tmp_path, F, k_eq_v=True)
    assert model.cfg.layers[0].k_eq_v
    trace = Trace()
    model.forward([3, 11], trace=trace)
    got = trace.tensors["layers.0.attn_out"][1]
    inv_freq = [0.0, 0.0]  # global head dim 4, prf 0.25: int(0.25 * 4 // 2) = 0 rotated pairs

    expected = second_row_attn_out(w, [3, 11], inv_freq, lambda h, kr: rms(kr))
    assert np.abs(got - expected).max() < 1e-13
    # the traps: V = K after k_norm (and RoPE), or V without its norm, are visibly different
    k_norm = w["layers.0.self_attn.k_norm.weight"]
    assert np.abs(got - second_row_attn_out(w, [3, 11], inv_freq, lambda h, kr: rms(kr, k_norm))).max() > 1e-3
    assert np.abs(got - second_row_attn_out(w, [3, 11], inv_freq, lambda h, kr: kr)).max() > 1e-3


def test_v_norm_is_scale_free_on_layers_with_v_proj(tmp_path):
    model, w = one_layer(tmp_path, S, k_eq_v=False)
    assert not model.cfg.layers[0].k_eq_v
    trace = Trace()
    model.forward([5, 9], trace=trace)
    got = trace.tensors["layers.0.attn_out"][1]
    inv_freq = [1.0, 0.01]  # head dim 4, theta 1e4: 1e4^(-0/4), 1e4^(-2/4)
    v_proj = w["layers.0.self_attn.v_proj.weight"]

    expected = second_row_attn_out(w, [5, 9], inv_freq, lambda h, kr: rms(h @ v_proj.T))
    assert np.abs(got - expected).max() < 1e-13
    assert np.abs(got - second_row_attn_out(w, [5, 9], inv_freq, lambda h, kr: h @ v_proj.T)).max() > 1e-3
