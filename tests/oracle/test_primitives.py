"""Hand-computed values for each primitive of the oracle and each trap of gemma4-text-spec.md section 12.

Expected numbers are worked out by hand in the comments (or from closed forms), never by calling the
function under test on another input.
"""

import math

import numpy as np
import pytest

import refimpl.model
import refimpl.ops
import refimpl.schedule
from refimpl.config import RopeSpec
from refimpl.model import per_layer_inputs, rope_inv_freq, route, router_margin
from refimpl.ops import (
    apply_rope,
    apply_rope_2d,
    attention,
    attention_mask,
    bf16_round,
    clamp,
    clipped_linear,
    gelu_tanh,
    mlp,
    rms_norm,
    rope_cos_sin,
    sigmoid,
    silu,
    softcap,
    softmax,
    softplus,
)

# the primitives that code outside refimpl imports from refimpl.model (where they lived before ops.py)
MODEL_EXPORTS = ("rms_norm", "gelu_tanh", "linear", "softmax", "softcap", "rope_cos_sin", "apply_rope",
                 "attention_mask", "vision_block_mask", "attention", "mlp", "bf16_round")


def test_primitives_still_importable_from_refimpl_model():
    """Each is ops.py's definition, or where the oracle schedules it, schedule.py's (the same function run on
    blocks of rows)."""
    for name in MODEL_EXPORTS:
        assert getattr(refimpl.model, name) is getattr(refimpl.schedule, name, getattr(refimpl.ops, name)), name


def test_rms_norm_multiplies_by_w_not_one_plus_w():
    # x = [3, 4]: mean(x^2) = 12.5, so rms(x) = x / sqrt(12.5 + eps)
    x = np.array([3.0, 4.0])
    w = np.array([2.0, 0.5])
    eps = 1e-6
    r = math.sqrt(12.5 + eps)
    assert rms_norm(x, w, eps) == pytest.approx([3 * 2.0 / r, 4 * 0.5 / r], rel=1e-15)
    # a (1 + w) norm would give [3*3/r, 4*1.5/r]; make sure we are far from it
    assert abs(rms_norm(x, w, eps)[0] - 9 / r) > 0.5


def test_rms_norm_eps_inside_the_mean_and_scale_free_form():
    x = np.array([1e-4, -1e-4])  # mean(x^2) = 1e-8, comparable to eps
    assert rms_norm(x, None, 1e-6) == pytest.approx(x / math.sqrt(1e-8 + 1e-6), rel=1e-15)
    # normalises over the last axis only
    y = rms_norm(np.array([[1.0, 1.0], [2.0, 2.0]]), None, 0.0)
    assert np.allclose(y, 1.0, rtol=0, atol=1e-15)


def test_gelu_tanh_steps_round_as_the_formula():
    """The in-buffer evaluation is bit for bit the formula written out (x^3 = x * x * x), also at 0, -0,
    tiny and huge inputs; and it leaves its input alone."""
    x = np.random.default_rng(0).standard_normal(50_000) * 4
    x[:8] = [0.0, -0.0, 1e-300, -1e-300, 30.0, -30.0, 1e100, -1e100]
    before = x.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        want = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))
        got = gelu_tanh(x)
    assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want))
    assert np.array_equal(x, before)


def test_gelu_tanh_closed_form():
    # gelu_tanh(1) = 0.5 (1 + tanh(sqrt(2/pi) * 1.044715))
    expected = 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * 1.044715))
    assert gelu_tanh(np.array([1.0]))[0] == pytest.approx(expected, rel=1e-15)
    assert gelu_tanh(np.array([0.0]))[0] == 0.0
    # the tanh form differs from the erf form in the 4th digit at x = 1: make sure it is the tanh one
    erf_form = 0.5 * (1 + math.erf(1 / math.sqrt(2)))
    assert abs(gelu_tanh(np.array([1.0]))[0] - erf_form) > 1e-4


def test_softcap_and_its_absence():
    assert softcap(np.array([30.0]), 30.0)[0] == pytest.approx(30 * math.tanh(1.0), rel=1e-15)
    x = np.array([100.0, -3.0])
    assert softcap(x, None) is x


def test_default_rope_inv_freq():
    # D = 8, theta = 10000: inv_freq[i] = 10000^(-2i/8) = [1, 0.1, 0.01, 0.001]
    inv = rope_inv_freq(RopeSpec("default", 10_000.0), 8)
    assert inv == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-14)


def test_proportional_rope_denominator_is_the_full_head_dim():
    # D = 16, prf 0.25 -> n_rot = int(0.25 * 16 // 2) = 2 pairs; inv_freq[i] = 1e4^(-2i/16) for i < 2, else 0.
    # 1e4^(-2/16) = 10^(-1/2). "Ordinary partial RoPE" would use denominator 4 (2 rotated pairs * 2).
    inv = rope_inv_freq(RopeSpec("proportional", 10_000.0, 0.25), 16)
    assert inv == pytest.approx([1.0, 10**-0.5, 0, 0, 0, 0, 0, 0], rel=1e-14, abs=0)
    assert inv[1] != pytest.approx(1e4 ** (-2 / 4))
    # factor divides the rotated frequencies
    inv2 = rope_inv_freq(RopeSpec("proportional", 10_000.0, 0.25, factor=4.0), 16)
    assert inv2[:2] == pytest.approx([0.25, 0.25 * 10**-0.5], rel=1e-14)


def test_published_proportional_rope_shape():
    # spec 4.3: D = 512, prf 0.25 -> 64 rotated pairs; inv_freq falls from 1.0 to about 0.0334
    inv = rope_inv_freq(RopeSpec("proportional", 1e6, 0.25), 512)
    assert inv.shape == (256,)
    assert np.count_nonzero(inv) == 64
    assert inv[0] == 1.0
    assert inv[63] == pytest.approx(1e6 ** (-126 / 512), rel=1e-14)
    assert inv[63] == pytest.approx(0.0334, abs=5e-5)


def test_rope_pairs_dimension_i_with_i_plus_half():
    # D = 8 proportional with 1 rotated pair: only dims 0 and 4 rotate, by angle p * 1.0.
    inv = rope_inv_freq(RopeSpec("proportional", 10_000.0, 0.25), 8)  # n_rot = int(0.25*8//2) = 1
    assert inv == pytest.approx([1.0, 0, 0, 0])
    cos, sin = rope_cos_sin(np.array([3]), inv)
    x = np.arange(1.0, 9.0).reshape(1, 1, 8)  # [1, 2, ..., 8]
    y = apply_rope(x, cos, sin)[0, 0]
    c, s = math.cos(3.0), math.sin(3.0)
    # out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, with x1 = dim 0 (=1), x2 = dim 4 (=5)
    assert y[0] == pytest.approx(1 * c - 5 * s, rel=1e-14)
    assert y[4] == pytest.approx(5 * c + 1 * s, rel=1e-14)
    # dims 1-3 and 5-7 pass through unchanged
    assert list(y[[1, 2, 3, 5, 6, 7]]) == [2.0, 3.0, 4.0, 6.0, 7.0, 8.0]


def test_rope_at_position_zero_is_identity_and_preserves_norm():
    inv = rope_inv_freq(RopeSpec("default", 10_000.0), 8)
    x = np.random.default_rng(0).normal(size=(4, 2, 8))
    cos, sin = rope_cos_sin(np.arange(4), inv)
    y = apply_rope(x, cos, sin)
    assert np.array_equal(y[0], x[0])
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-14)


def test_sliding_window_sees_exactly_w_keys():
    W = 3
    q = np.arange(10)
    mask = attention_mask(q, q, W)
    # query 6 sees keys 4, 5, 6: itself plus W - 1 earlier ones
    assert list(np.nonzero(mask[6])[0]) == [4, 5, 6]
    assert mask.sum(axis=1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    # full layers: causal only
    full = attention_mask(q, q, None)
    assert full.sum(axis=1).tolist() == list(range(1, 11))
    # with a cache the key positions are absolute: query 10 against cached keys 7..9 and itself
    m = attention_mask(np.array([10]), np.array([7, 8, 9, 10]), W)
    assert m.tolist() == [[False, True, True, True]]


def test_attention_scale_is_one_and_gqa_maps_head_j_to_j_div_g():
    # two keys; query . key scores are [0, 2] with scale 1.0 -> softmax = [1, e^2] / (1 + e^2)
    q = np.zeros((1, 2, 2))
    q[0, :, 0] = 1.0  # both query heads [1, 0]
    k = np.array([[[0.0, 0.0]], [[2.0, 0.0]]])  # [S=2, K=1, D=2]
    v = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    out = attention(q, k, v, np.ones((1, 2), bool))
    p1 = math.exp(2) / (1 + math.exp(2))
    assert out[0, 0] == pytest.approx([1 - p1, p1], rel=1e-14)
    assert np.array_equal(out[0, 0], out[0, 1])  # MQA: both heads read the same KV head
    # a 1/sqrt(D) scale would give softmax([0, 2/sqrt(2)]); make sure we are not there
    assert out[0, 0, 1] != pytest.approx(math.exp(math.sqrt(2)) / (1 + math.exp(math.sqrt(2))))

    # GQA: 4 query heads over 2 KV heads -> heads 0,1 read KV head 0 and heads 2,3 read KV head 1
    k2 = np.zeros((1, 2, 2))
    v2 = np.array([[[5.0, 5.0], [7.0, 7.0]]])
    out2 = attention(np.zeros((1, 4, 2)), k2, v2, np.ones((1, 1), bool))
    assert out2[0, :, 0].tolist() == [5.0, 5.0, 7.0, 7.0]


def test_masked_keys_get_no_weight():
    q = np.ones((1, 1, 2))
    k = np.array([[[100.0, 100.0]], [[0.0, 0.0]]])
    v = np.array([[[1.0, 1.0]], [[3.0, 3.0]]])
    out = attention(q, k, v, np.array([[False, True]]))
    assert out[0, 0].tolist() == [3.0, 3.0]


def test_mlp_is_geglu_with_gate_first():
    x = np.array([[1.0, 2.0]])
    gate = np.array([[1.0, 0.0]])  # gate pre-activation = 1
    up = np.array([[0.0, 3.0]])  # up = 6
    down = np.array([[1.0], [2.0]])
    g = gelu_tanh(np.array([1.0]))[0]
    assert mlp(x, gate, up, down)[0] == pytest.approx([g * 6, 2 * g * 6], rel=1e-15)


def test_router_renormalises_top_k_then_applies_per_expert_scale():
    # r is chosen so that rms(r) * scale * H^-1/2 = [1, 0] exactly: r = [1, -1] has rms 1,
    # scale = [sqrt(2), 0] -> z = [sqrt(2), 0] * 2^-1/2 = [1, 0]
    r = np.array([[1.0, -1.0]])
    scale = np.array([math.sqrt(2.0), 0.0])
    proj = np.array([[3.0, 0.0], [2.0, 0.0], [0.0, 0.0]])  # expert logits [3, 2, 0]
    per_expert = np.array([10.0, 100.0, 1000.0])
    idx, weight, probs = route(r, scale, proj, per_expert, top_k=2, eps=0.0)
    z = math.exp(3) + math.exp(2) + 1
    assert probs[0] == pytest.approx([math.exp(3) / z, math.exp(2) / z, 1 / z], rel=1e-14)  # softmax over all
    assert idx.tolist() == [[0, 1]]
    # renormalised over the chosen two: e^3 / (e^3 + e^2) = 1 / (1 + e^-1), then x per_expert_scale
    w0 = 1 / (1 + math.exp(-1))
    assert weight[0] == pytest.approx([10 * w0, 100 * (1 - w0)], rel=1e-14)
    assert router_margin(probs, 2)[0] == pytest.approx((math.exp(2) - 1) / z, rel=1e-14)
    assert router_margin(probs, 3)[0] == math.inf


def test_router_ties_go_to_the_lower_expert():
    idx, _, _ = route(np.array([[1.0, 1.0]]), np.ones(2), np.zeros((4, 2)), np.ones(4), top_k=2, eps=1e-6)
    assert idx.tolist() == [[0, 1]]


def test_ple_combines_context_and_token_identity():
    # T = 1, H = 4, L = 1, P = 2. proj maps x0 -> [x0_0, x0_1]; H^-1/2 = 1/2.
    x0 = np.array([[2.0, 4.0, 0.0, 0.0]])
    proj = np.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    norm_w = np.array([1.0, 3.0])
    tok_rows = np.array([[0.5, -0.5]])
    # ctx before norm = [1, 2]; rms = sqrt(2.5 + eps) -> ctx = [1, 2] / sqrt(2.5) * [1, 3]
    eps = 1e-6
    ctx = np.array([1.0, 6.0]) / math.sqrt(2.5 + eps)
    tok = np.array([0.5, -0.5]) * math.sqrt(2)  # x sqrt(P)
    expected = (ctx + tok) / math.sqrt(2)
    got = per_layer_inputs(x0, tok_rows, proj, norm_w, L=1, P=2, eps=eps)
    assert got.shape == (1, 1, 2)
    assert got[0, 0] == pytest.approx(expected, rel=1e-14)


def test_bf16_rounding_of_the_embedding_scale():
    # the spec's table (section 4.1)
    table = {1536: 39.25, 2560: 50.5, 2816: 53.0, 3840: 62.0, 5376: 73.5}
    for h, expected in table.items():
        assert bf16_round(math.sqrt(h)) == expected
    assert bf16_round(1 + 2**-8) == 1.0  # tie to even
    assert bf16_round(1 + 3 * 2**-8) == 1 + 2**-6  # tie to even (upwards)


def test_clipped_linear_clamps_input_then_output():
    x = np.array([[2.0, -3.0]])
    w = np.array([[1.0, 1.0], [1.0, -1.0]])
    # plain: [2 - 3, 2 + 3] = [-1, 5]
    assert clipped_linear(x, w, None).tolist() == [[-1.0, 5.0]]
    # input clamped to [-1, 1]: [1, -1] -> [0, 2]; output clamped to [-0.5, 1.5]: [0, 1.5]
    assert clipped_linear(x, w, (-1.0, 1.0, -0.5, 1.5)).tolist() == [[0.0, 1.5]]


def test_audio_activations_and_clamp():
    x = np.array([0.0, math.log(3.0)])
    # sigmoid(ln 3) = 1 / (1 + 1/3) = 3/4; silu = x sigmoid(x); softplus(ln 3) = ln(1 + 3) = ln 4
    assert sigmoid(x) == pytest.approx([0.5, 0.75], rel=1e-15)
    assert silu(x) == pytest.approx([0.0, 0.75 * math.log(3.0)], rel=1e-15)
    assert softplus(x) == pytest.approx([math.log(2.0), math.log(4.0)], rel=1e-15)
    assert softplus(np.array([1000.0]))[0] == 1000.0  # no overflow
    assert clamp(np.array([-5.0, 0.5, 5.0]), 1.0).tolist() == [-1.0, 0.5, 1.0]
    # a limit past the dtype's range clamps to its largest finite value (inf -> max)
    assert clamp(np.array([np.inf], dtype=np.float32), 1e300)[0] == np.finfo(np.float32).max


def test_softmax_sums_to_one_and_ignores_shifts():
    p = softmax(np.array([[0.0, math.log(3.0)], [1000.0, 1000.0 + math.log(3.0)]]))
    assert p == pytest.approx(np.array([[0.25, 0.75], [0.25, 0.75]]), rel=1e-14)


def test_rope_2d_rotates_each_half_by_its_own_axis():
    # D = 4: channels [0, 2) rotate by the x angle, [2, 4) by the y angle, each as one rotate-half pair
    x = np.array([[[1.0, 0.0, 1.0, 0.0]]])  # [T=1, heads=1, D=4]
    cos_x, sin_x = np.array([[0.0]]), np.array([[1.0]])  # x angle 90 degrees
    cos_y, sin_y = np.array([[-1.0]]), np.array([[0.0]])  # y angle 180 degrees
    # pair (x1, x2) = (1, 0) -> (x1 cos - x2 sin, x2 cos + x1 sin): x half (0, 1), y half (-1, 0)
    assert apply_rope_2d(x, cos_x, sin_x, cos_y, sin_y)[0, 0].tolist() == [0.0, 1.0, -1.0, 0.0]
