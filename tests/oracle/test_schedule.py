"""refimpl.schedule runs ops.py's plain definitions on blocks of rows and threads: the scheduled result is the
plain one within the rounding schedule.py states.

- A row-wise step is the plain function itself (``.whole``) on blocks of rows: every element goes through the
  same NumPy calls, so the bound is two units of rounding of the dtype (relative), as test_threads.py uses.
- Attention on blocks of query rows, each over its span of keys, against ``ops.attention`` in one call: the
  products and sums run over other lengths. Each output is sum_j p_j v_j with p a softmax, so from an a-priori
  forward-error bound (gamma_n = n u, u the unit roundoff): a score q.k_j moves by at most 2 gamma_D |q| |k_j|
  between the two, which moves p_j by at most that much relative (twice, through the normalising sum); the
  sum of S probabilities and the sum of S products p_j v_j each move by at most 2 gamma_S. Together
  |scheduled - plain| <= max|v| (4 gamma_D max_j |q| |k_j| + 4 gamma_S). With ``half`` (fp16 K/V cache) a
  probability that lands on the other side of an fp16 rounding boundary moves by one fp16 unit, 2^-11
  relative: at most 2^-11 max|v| more.
- The whole forward with the model's steps made plain (monkeypatched to ops.py's) against the scheduled
  forward on four threads with small blocks: the bound other tests use for BLAS's blocking, 1e-12 on logits
  of about 10.
"""

from __future__ import annotations

import numpy as np
import pytest

import refimpl.model
from refimpl import ops, schedule, threads
from refimpl.model import KVCache, rope_cos_sin

ULPS = 2
ROWWISE = ("rms_norm", "layer_norm", "gelu_tanh", "softmax", "softcap", "geglu", "apply_rope", "norm_rope",
           "apply_rope_2d")
U64 = np.finfo(np.float64).eps / 2  # unit roundoff of float64


def _args(name: str, rng: np.random.Generator) -> tuple:
    T, N, D, H = 41, 4, 16, 24
    x = rng.standard_normal((T, H))
    q = rng.standard_normal((T, N, D))
    cos, sin = rope_cos_sin(np.arange(T), 1.0 / 10000 ** (np.arange(0, D, 2) / D))
    cx, sx = rope_cos_sin(np.arange(T) % 7, 1.0 / 100 ** (np.arange(0, D // 2, 2) / (D // 2)))
    cy, sy = rope_cos_sin(np.arange(T) // 7, 1.0 / 100 ** (np.arange(0, D // 2, 2) / (D // 2)))
    return {"rms_norm": (x, rng.standard_normal(H), 1e-6), "layer_norm": (x, rng.standard_normal(H),
                                                                          rng.standard_normal(H), 1e-5),
            "gelu_tanh": (4 * x,), "softmax": (rng.standard_normal((2, T, T)),), "softcap": (40 * x, 30.0),
            "geglu": (4 * x, x), "apply_rope": (q, cos, sin), "norm_rope": (q, cos, sin, rng.standard_normal(D), 1e-6),
            "apply_rope_2d": (q, cx, sx, cy, sy)}[name]


@pytest.mark.parametrize("name", ROWWISE)
def test_a_rowwise_step_is_the_plain_definition_on_blocks_of_rows(monkeypatch, name):
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 64)  # blocks of a few rows: these small inputs split
    scheduled, plain = getattr(schedule, name), getattr(ops, name)
    assert scheduled.whole is plain  # the very function of ops.py, not a copy
    args = _args(name, np.random.default_rng(len(name)))
    with threads.use_threads(3):
        got = scheduled(*args)
    want = plain(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.all(np.abs(got - want) <= ULPS * np.finfo(want.dtype).eps * np.abs(want)), name


def test_the_scheduled_mlp_is_the_plain_mlp(monkeypatch):
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 64)
    rng = np.random.default_rng(11)
    x, gate, up, down = (rng.standard_normal(s) for s in ((29, 16), (40, 16), (40, 16), (16, 40)))
    with threads.use_threads(3):
        got = schedule.mlp(x, gate, up, down)
    want = ops.mlp(x, gate, up, down)
    assert np.all(np.abs(got - want) <= ULPS * np.finfo(np.float64).eps * np.abs(want))


def _attention_bound(q, k, v, mask, half: bool) -> float:
    """The bound of the module docstring for ``q`` [T, N, D] against ``k``/``v`` [S, K, D]."""
    S, _, D = k.shape
    qk = np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()
    vmax = float(np.abs(v).max())
    bound = vmax * (4 * D * U64 * qk + 4 * S * U64)
    return bound + (2.0 ** -11 * vmax if half else 0.0)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("n", [1, 4])
def test_scheduled_attention_is_the_plain_one_within_its_rounding(monkeypatch, half, window, n):
    """Blocks of 2 query rows (ATTENTION_BLOCK 160 over [N, S] = [2, 40] scores), each over its span of keys:
    with a window of 6 the blocks see 7 of the 40 keys; causal ones 2 to 40."""
    monkeypatch.setattr(schedule, "ATTENTION_BLOCK", 160)
    rng = np.random.default_rng(5 if window else 6)
    T, S, N, D = 20, 40, 2, 8
    q, k, v = rng.standard_normal((T, N, D)), rng.standard_normal((S, 1, D)), rng.standard_normal((S, 1, D))
    if half:
        k, v = ops.fp16(k), ops.fp16(v)
    mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), window)
    with threads.use_threads(n):
        got = schedule.attention(q, k, v, mask, half=half)
    want = ops.attention(q, k, v, mask, half=half)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.max(np.abs(got - want)) <= _attention_bound(q, k, v, mask, half)


@pytest.mark.parametrize("preset", ["e2b-mini", "26b-a4b-mini"])
def test_the_scheduled_forward_is_the_plain_forward(preset_models, monkeypatch, preset):
    """Prefill (all rows), decode steps through the cache, and some rows: the model's scheduled steps on four
    threads with small blocks (every step splits) against the same forward with those steps made ops.py's
    plain definitions, on one thread."""
    model = preset_models[preset]
    ids = np.random.default_rng(7).integers(3, model.cfg.vocab_size, 23)

    def run() -> list[np.ndarray]:
        cache = KVCache()
        prefill = model.forward(ids[:20], rows="all", cache=cache)
        steps = [model.forward(ids[i:i + 1], rows="last", cache=cache) for i in range(20, 23)]
        return [prefill, *steps, model.forward(ids, rows=[3, -1])]

    with monkeypatch.context() as m:
        m.setattr(threads, "ROWWISE_BLOCK", 64)
        m.setattr(schedule, "ATTENTION_BLOCK", 64)
        with threads.use_threads(4):
            scheduled = run()
    for name in ("attention", "geglu", "norm_rope", "rms_norm", "softcap", "softmax"):
        assert getattr(refimpl.model, name) is getattr(schedule, name), name  # the model runs the scheduled steps
        monkeypatch.setattr(refimpl.model, name, getattr(ops, name))
    assert model.geglu is schedule.geglu  # the gated activation the model picked at construction
    monkeypatch.setattr(model, "geglu", ops.geglu)
    with threads.use_threads(1):
        plain = run()
    assert np.max(np.abs(plain[0])) > 1.0  # logits of a real size
    for s, p in zip(scheduled, plain, strict=True):
        assert np.max(np.abs(s - p)) < 1e-12
