"""The oracle on CuPy arrays (issue 53): refimpl.ops and the text decoder.

refimpl.ops on CuPy arrays: every plain definition, given CuPy inputs, computes on the GPU and returns
CuPy arrays equal to the NumPy result within float64 rounding (the kernels differ: GEMM blocking and reduction
order, libm against CUDA's math library, so the bound is a few units of rounding of the values involved, not
equal bits). Skipped, with the reason, where CuPy or a CUDA device is missing."""

from __future__ import annotations

import numpy as np
import pytest
from strict_device import assert_device_is_host

from refimpl import ops
from refimpl.model import Gemma4
from refimpl.synth import PRESETS

cp = pytest.importorskip("cupy", reason="CuPy is not installed (a CUDA machine with the cuda extra)")
try:
    if cp.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device is visible", allow_module_level=True)
except cp.cuda.runtime.CUDARuntimeError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"no CUDA device: {exc}", allow_module_level=True)

EPS = np.finfo(np.float64).eps
T, S, N, K, D, H = 7, 11, 4, 2, 16, 24


def _inputs() -> dict[str, tuple]:
    rng = np.random.default_rng(53)
    x = rng.standard_normal((T, H))
    w = rng.standard_normal((3 * H, H)) / np.sqrt(H)
    q, k, v = rng.standard_normal((T, N, D)), rng.standard_normal((S, K, D)), rng.standard_normal((S, K, D))
    cos, sin = ops.rope_cos_sin(np.arange(S - T, S), 1.0 / 10000 ** (np.arange(0, D, 2) / D))
    cx, sx = ops.rope_cos_sin(np.arange(T), 1.0 / 100 ** (np.arange(0, D // 2, 2) / (D // 2)))
    mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), 5)
    return {
        "linear": (x, w), "clipped_linear": (x, w, (-1.0, 1.0, -0.5, 0.5)),
        "rms_norm": (x, rng.standard_normal(H), 1e-6),
        "layer_norm": (x, rng.standard_normal(H), rng.standard_normal(H), 1e-5), "gelu_tanh": (3 * x,),
        "sigmoid": (3 * x,), "silu": (3 * x,), "softplus": (3 * x,), "softmax": (3 * x,), "softcap": (40 * x, 30.0),
        "clamp": (1e3 * x, 500.0), "geglu": (x, x[::-1].copy()), "mlp": (x, w[:H], w[H:2 * H], w[2 * H:].T.copy()),
        "rope_cos_sin": (np.arange(S, dtype=np.int64), 1.0 / 10000 ** (np.arange(0, D, 2) / D)),
        "apply_rope": (q, cos[-T:], sin[-T:]), "norm_rope": (q, cos[-T:], sin[-T:], rng.standard_normal(D), 1e-6),
        "apply_rope_2d": (q, cx, sx, cx[::-1].copy(), sx[::-1].copy()),
        "attention_mask": (np.arange(S - T, S), np.arange(S), 5), "fp16": (x,),
        "attention": (q, k, v, mask), "attention half": (q, ops.fp16(k), ops.fp16(v), mask, True),
    }


def _on_gpu(a):
    if isinstance(a, np.ndarray):
        return cp.asarray(a)
    if isinstance(a, tuple):
        return a  # (bounds) stay Python numbers
    return a


@pytest.mark.parametrize("name", sorted(_inputs()))
def test_each_op_on_cupy_is_the_numpy_op(name):
    args = _inputs()[name]
    fn = getattr(ops, name.split()[0])
    wants, gots = fn(*args), fn(*(_on_gpu(a) for a in args))
    if not isinstance(wants, tuple):  # (rope_cos_sin returns cos and sin)
        wants, gots = (wants,), (gots,)
    for want, got in zip(wants, gots, strict=True):
        assert isinstance(got, cp.ndarray), f"{name} returned {type(got).__name__}, not a CuPy array"
        got = cp.asnumpy(got)
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if want.dtype == bool:
            assert np.array_equal(got, want), name
            continue
        scale = max(1.0, float(np.max(np.abs(want))))
        # a few roundings per element of a product or reduction of length at most 3 H (fp16: one fp16 unit)
        bound = (2.0 ** -10 * scale) if name in ("fp16", "attention half") else 8 * 3 * H * EPS * scale
        assert float(np.max(np.abs(got - want))) <= bound, name


# ----------------------------------------------------------------------------------------------
# the fused kernels (refimpl.device_kernels, run by refimpl.schedule on CuPy arrays)


def _fused_inputs() -> dict[str, tuple]:
    rng = np.random.default_rng(530)
    x, q = 3 * rng.standard_normal((T, 4, H)), rng.standard_normal((T, N, D))
    cos, sin = ops.rope_cos_sin(np.arange(40, 40 + T), 1.0 / 10000 ** (np.arange(0, D, 2) / D))
    return {"rms_norm": (x, rng.standard_normal(H), 1e-6), "rms_norm scale-free": (x, None, 1e-6),
            "gelu_tanh": (x,), "geglu": (x, x[::-1].copy()),
            "norm_rope": (q, cos, sin, rng.standard_normal(D), 1e-6),
            "norm_rope strided": (q[:, ::2], cos, sin, rng.standard_normal(D), 1e-6),
            # attention's scores [K, T, G, S] under a sliding mask (every row sees a key), as ops.attention passes it
            "masked_softmax": (8 * rng.standard_normal((K, T, N // K, S)),
                               ops.attention_mask(np.arange(S - T, S), np.arange(S), 5)[None, :, None, :]),
            # keys past a block of threads (256)
            "masked_softmax long": (8 * rng.standard_normal((1, 3, 2, 700)),
                                    ops.attention_mask(np.arange(697, 700), np.arange(700), None)[None, :, None, :]),
            # rows wider than a block of threads (256), not a multiple of it
            "rms_norm wide": (rng.standard_normal((3, 2, 600)), rng.standard_normal(600), 1e-6),
            "norm_rope wide": (rng.standard_normal((T, 2, 520)), *ops.rope_cos_sin(
                np.arange(T), 1.0 / 10000 ** (np.arange(0, 520, 2) / 520)), rng.standard_normal(520), 1e-6)}


@pytest.mark.parametrize("name", sorted(_fused_inputs()))
def test_each_fused_kernel_is_the_op(name):
    """The fused kernel against ``ops`` on NumPy (float64 rounding apart: CUDA's tanh and the order of the sum of
    squares) and against ``ops`` on CuPy, the same CUDA operations unfused: the elementwise steps round the same,
    so only the sum of squares' order may move the norms' last bits; and ``refimpl.schedule`` runs it."""
    from refimpl import device_kernels, schedule

    args = _fused_inputs()[name]
    step = name.split()[0]

    def on_gpu():  # (fresh copies for each call: masked_softmax works in its input's buffer)
        return tuple(_on_gpu(a) for a in args)

    got = getattr(device_kernels, step)(*on_gpu())
    assert isinstance(got, cp.ndarray) and got.dtype == np.float64, f"{step} did not run fused"
    host = getattr(ops, step)(*(a.copy() if isinstance(a, np.ndarray) else a for a in args))
    unfused = cp.asnumpy(getattr(ops, step)(*on_gpu()))
    got = cp.asnumpy(got)
    scale, width = max(1.0, float(np.max(np.abs(host)))), args[0].shape[-1]
    assert got.shape == host.shape
    assert float(np.max(np.abs(got - host))) <= 8 * width * EPS * scale, name
    apart = 0.0 if step in ("gelu_tanh", "geglu") else width * EPS * scale  # (elementwise: the same roundings)
    assert float(np.max(np.abs(got - unfused))) <= apart, name
    assert cp.asnumpy(getattr(schedule, step)(*on_gpu())).tobytes() == got.tobytes(), f"schedule.{step} not fused"


def test_the_fused_kernels_switch_off_for_a_block():
    """``device_kernels.switched(False)`` (benchmarks/fused_kernels.py's unfused side): None inside, on again after."""
    from refimpl import device_kernels

    x = cp.ones((T, H))
    with device_kernels.switched(False):
        assert device_kernels.rms_norm(x, None, 1e-6) is None
    assert isinstance(device_kernels.rms_norm(x, None, 1e-6), cp.ndarray)


def test_the_fused_kernels_leave_other_inputs_to_ops():
    """float32 CuPy arrays, host arrays and shapes the kernels do not take: None (the schedule runs ``ops``)."""
    from refimpl import device_kernels

    x32 = cp.ones((T, H), dtype=cp.float32)
    assert device_kernels.rms_norm(x32, None, 1e-6) is None and device_kernels.gelu_tanh(np.ones(3)) is None
    assert device_kernels.geglu(cp.ones((T, H)), cp.ones((T, 1))) is None
    q = cp.ones((T, N, D))
    assert device_kernels.norm_rope(q, cp.ones((T, D)), cp.ones((T, D)), cp.ones(D), 1e-6) is None
    assert device_kernels.masked_softmax(cp.ones((K, T, N // K, S)), cp.ones((T, S), dtype=bool)) is None


# ----------------------------------------------------------------------------------------------
# the model


@pytest.mark.parametrize("kv_cache", ["exact", "f16"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_model_on_cupy_is_the_numpy_model(preset_dirs, preset, kv_cache):
    """Every text preset, ``Gemma4(dir, device="cuda")`` against the NumPy model: a prefill of every row, decode
    steps through the KV cache, and some rows of a pruned forward, within the rounding two float64 evaluations of
    the same logits may differ by (conformance.sets.bounds.logit_bound); NumPy arrays come back."""
    cpu = Gemma4(preset_dirs[preset], kv_cache=kv_cache, device="cpu")
    gpu = Gemma4(preset_dirs[preset], kv_cache=kv_cache, device="cuda")
    assert_device_is_host(cpu, gpu)


# ----------------------------------------------------------------------------------------------
# the harness


REFIMPL = "conformance.backends.refimpl_backend:RefimplBackend"  # (by its path: the GPU machine may not install us)


@pytest.mark.parametrize("preset", ["e2b-vision-mini", "e2b-audio-mini", "e2b-assistant-mini", "12b-mini",
                                    "12b-assistant-mini"])
def test_a_set_written_on_the_gpu_passes_the_host_oracle(preset, tmp_path):
    """``conformance generate --device cuda``: the decoder on the GPU (the towers and the MTP drafter on the host
    beside it), images, audio, Gemma 4 Unified and MTP; the set it writes passes the CPU oracle at exact-f64."""
    from conformance.cli import main

    out = tmp_path / preset
    assert main(["generate", "--preset", preset, "--device", "cuda", "--out", str(out), "-q"]) == 0
    assert main(["check", "--backend", REFIMPL, "--device", "cpu", "--fixtures", str(out), "-q",
                 "--profile", "exact-f64"]) == 0


def test_the_bundled_sets_graded_by_the_gpu_oracle():
    """``conformance check --device cuda`` with the refimpl backend on the GPU too: every claimed bundled case
    passes."""
    from conformance.cli import main

    assert main(["check", "--backend", REFIMPL, "--device", "cuda", "--backend-option", "device=cuda", "-q"]) == 0
