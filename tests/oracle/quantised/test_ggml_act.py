"""ggml's CPU activation quantisation, emulated (refimpl/ggml_act.py, issue 49), against libggml itself through
ctypes (tests/libggml.py, on the library ``make llama-cpp`` builds): the activation codes and scales bit for bit
(the x86 kernels and the reference quantisers, ties included), and each weight type's CPU dot product within
float32 accumulation of the float64 product of the exact weights and the emulated activations, where the float64
product with the unquantised activations is hundreds of times further off."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.errors import InputError
from refimpl.ggml_act import activation_values, min_term_error, quantize_q8_0, quantize_q8_1, quantize_q8_k
from refimpl.ggml_blocks import MIN_TYPES, TYPES, QuantError, block_mins, dequantize

libggml = pytest.importorskip("libggml", reason="helper module")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp)")

TYPE_IDS = {bt.name: t for t, bt in TYPES.items()}
Q8_0, Q8_1, Q8_K = 8, 9, 15


def _row(seed: int, blocks: int, size: int, ties: bool) -> np.ndarray:
    """float32 activations: normal values of mixed magnitudes, a zero block, and (``ties``) blocks of half-integer
    multiples of amax / 127 where the quantisers' tie rules part."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(0, 1, (blocks, size)) * 10.0 ** rng.integers(-3, 3, (blocks, 1))).astype(np.float32)
    x[0] = 0
    if ties and blocks > 1:
        x[1] = (rng.integers(-254, 255, size) / 2).astype(np.float32)
        x[1, 0] = 127.0  # amax 127: x * 127 / amax and x / (amax / 127) are the half-integers themselves
    return x.reshape(-1)


def _q8_0_fields(raw: bytes, with_s: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    width = 36 if with_s else 34
    b = np.frombuffer(raw, np.uint8).reshape(-1, width)
    d = b[:, :2].copy().view(np.float16).astype(np.float64)[:, 0]
    s = b[:, 2:4].copy().view(np.float16).astype(np.float64)[:, 0] if with_s else None
    return b[:, width - 32:].view(np.int8).astype(np.int64).reshape(-1), d, s


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), blocks=st.integers(2, 9), ties=st.booleans())
def test_q8_0_and_q8_1_codes_are_libggml_s_on_both_paths(seed, blocks, ties):
    """x86 (the CPU backend's from_float on this machine: 127 / amax, half to even) and ref (quantize_row_*_ref:
    1 / d, half away from zero): codes, fp16 d and Q8_1's fp16 s equal libggml's bit for bit."""
    x = _row(seed, blocks, 32, ties)
    for path, convert in (("x86", libggml.from_float_cpu), ("ref", libggml.from_float_ref)):
        codes, d, _ = quantize_q8_0(x, path)
        theirs = _q8_0_fields(convert(x, Q8_0), False)
        assert np.array_equal(codes, theirs[0]) and np.array_equal(d, theirs[1]), path
        codes, d, s = quantize_q8_1(x, path)
        theirs = _q8_0_fields(convert(x, Q8_1), True)
        assert np.array_equal(codes, theirs[0]) and np.array_equal(d, theirs[1]) and np.array_equal(s, theirs[2]), path


def test_the_paths_part_on_ties():
    """On exact half-way products the two Q8_0 paths round differently (half to even against half away)."""
    x = _row(7, 4, 32, True)
    assert not np.array_equal(quantize_q8_0(x, "x86")[0], quantize_q8_0(x, "ref")[0])


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), blocks=st.integers(2, 9))
def test_the_arm_path_is_ref_s_multiplier_with_x86_s_rounding(seed, blocks):
    """arm (NEON: id = 1 / d, vcvtnq rounds half to even; no ARM build here to compare with, so the rule is
    checked against the other two): off exact ties its codes are ref's (the same multiplier); on a block of
    exact half-integer products (amax 127: d = 1, both multipliers exactly 1) they are x86's, and its d and s
    are the same as every path's."""
    x = _row(seed, blocks, 32, False)
    arm, ref = quantize_q8_1(x, "arm"), quantize_q8_1(x, "ref")
    d = quantize_q8_0(x, "ref")[2]
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = (x.reshape(-1, 32) * inv[:, None]).astype(np.float32).reshape(-1)  # the product both round
    off_ties = np.abs(v) % 1 != 0.5
    assert np.array_equal(arm[0][off_ties], ref[0][off_ties])
    assert np.array_equal(arm[1], ref[1]) and (np.array_equal(arm[2], ref[2]) or not off_ties.all())
    ties = _row(seed, 2, 32, True)
    assert np.array_equal(quantize_q8_0(ties, "arm")[0], quantize_q8_0(ties, "x86")[0])
    assert not np.array_equal(quantize_q8_0(ties, "arm")[0], quantize_q8_0(ties, "ref")[0])


KERNELS = {  # the emulated rules, as the vendored ggml CPU sources spell them: file, function, what it must say
    "x86": ("arch/x86/quants.c", "void quantize_row_q8_0(", ("127.f / maxScalar", "_MM_ROUND_NEAREST")),
    "arm": ("arch/arm/quants.c", "void quantize_row_q8_0(", ("id = d ? 1.0f/d : 0.0f", "vcvtnq_s32_f32")),
    "arm q8_1": ("arch/arm/quants.c", "void quantize_row_q8_1(", ("id = d ? 1.0f/d : 0.0f", "vcvtnq_s32_f32",
                                                               "d * vaddvq_s32(accv)")),
    "arm q8_K": ("arch/arm/quants.c", "void quantize_row_q8_K(", ("quantize_row_q8_K_ref(x, y, k)",)),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_the_emulated_rules_are_the_vendored_kernels(kernel):
    """The quantisers ggml_act.py emulates still read so in the llama.cpp sources the build uses: a change of
    rounding or multiplier there fails here (the ARM rules can be checked no other way on this machine)."""
    from conformance.backends.llama_cpp import library
    from conformance.protocol import BackendError

    try:
        root = library.resolve_source() / "ggml" / "src" / "ggml-cpu"
    except BackendError as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"llama.cpp sources missing: {exc}")
    rel, head, needles = KERNELS[kernel]
    text = (root / rel).read_text()
    body = text[text.index(head):]
    body = body[:body.index("\n}\n")]
    for needle in needles:
        assert needle in body, (kernel, needle)


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), blocks=st.integers(2, 4), ties=st.booleans())
def test_q8_k_codes_and_scales_are_libggml_s(seed, blocks, ties):
    """Q8_K: codes and the float32 d (negative when the largest element is positive) equal libggml's."""
    x = _row(seed, blocks, 256, ties)
    codes, d = quantize_q8_k(x)
    b = np.frombuffer(libggml.from_float_cpu(x, Q8_K), np.uint8).reshape(-1, 292)
    assert np.array_equal(codes, b[:, 4:260].view(np.int8).astype(np.int64).reshape(-1))
    assert np.array_equal(d, b[:, :4].copy().view(np.float32).astype(np.float64)[:, 0])


EMULATED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")



def emulated_dot(raw: bytes, ggml_type: int, name: str, x: np.ndarray) -> float:
    """The float64 product of the exact weights and the emulated activations, plus for Q4_1 / Q5_1 what ggml's
    min term (the weight block's m times Q8_1's fp16 s) adds beyond the exact one."""
    n = x.size
    ours = float(dequantize(raw, ggml_type, n) @ activation_values(x, name, "x86"))
    return ours + (float(block_mins(raw, ggml_type, n) @ min_term_error(x)) if name in MIN_TYPES else 0.0)


@settings(max_examples=examples(40), deadline=None)
@given(name=st.sampled_from(EMULATED), seed=st.integers(0, 2 ** 32 - 1), superblocks=st.integers(1, 4))
def test_each_weight_type_s_dot_product_is_libggml_s(name, seed, superblocks):
    """A weight row quantised by libggml, activations drawn: libggml's CPU dot product (from_float, vec_dot)
    equals the float64 product of the exact weights and the emulated activations within float32 accumulation
    (a few roundings per block of the sum of |w| |x_hat|); with the activations as they are, ggml is off by the
    activation quantisation itself, far more. Q4_1 / Q5_1: with the min term's difference (Q8_1's fp16 s)."""
    rng = np.random.default_rng(seed)
    n = 256 * superblocks
    x = (rng.normal(0, 1, n) * rng.choice([0.1, 1.0, 30.0])).astype(np.float32)
    w = rng.normal(0, 0.05, (1, n)).astype(np.float32)
    ggml_type = TYPE_IDS[name]
    raw = w.astype(np.float16).tobytes() if name == "F16" else libggml.quantize(w, ggml_type)[0].tobytes()
    exact = dequantize(raw, ggml_type, n)
    x_hat = activation_values(x, name, "x86")
    theirs = libggml.vec_dot(raw, x, ggml_type)
    scale = float(np.abs(exact) @ np.abs(x_hat))
    assert abs(emulated_dot(raw, ggml_type, name, x) - theirs) <= 2.0 ** -23 * (n / 16 + 8) * scale


@pytest.mark.parametrize("name", EMULATED)
def test_the_emulation_is_what_closes_the_gap(name):
    """32 rows of 1024 (fixed draws): the median error of the float64 product with the emulated activations is
    at least a hundred times below that of the product with the activations as they are; for Q4_1 / Q5_1 also
    below that of the product with the emulated activations but the exact min term (fp16(d) sum(codes), not
    Q8_1's fp16 s)."""
    rng = np.random.default_rng(20261205)
    n, ggml_type = 1024, TYPE_IDS[name]
    emulated, plain, exact_min = [], [], []
    for _ in range(32):
        x = rng.normal(0, 1, n).astype(np.float32)
        w = rng.normal(0, 0.05, (1, n)).astype(np.float32)
        raw = w.astype(np.float16).tobytes() if name == "F16" else libggml.quantize(w, ggml_type)[0].tobytes()
        exact, theirs = dequantize(raw, ggml_type, n), libggml.vec_dot(raw, x, ggml_type)
        emulated.append(abs(emulated_dot(raw, ggml_type, name, x) - theirs))
        plain.append(abs(float(exact @ x.astype(np.float64)) - theirs))
        exact_min.append(abs(float(exact @ activation_values(x, name)) - theirs))
    assert np.median(plain) > 100 * np.median(emulated)
    if name in MIN_TYPES:
        assert np.median(exact_min) > 100 * np.median(emulated)


def test_bad_input_is_one_line():
    with pytest.raises(InputError, match="^an activation row of 33 values is not a whole number of 32-value blocks$"):
        quantize_q8_0(np.zeros(33, np.float32))
    with pytest.raises(InputError, match="^unknown ggml kernel path 'neon' \\(emulated: x86, ref, arm\\)$"):
        quantize_q8_0(np.zeros(32, np.float32), "neon")
    with pytest.raises(InputError, match="^no emulated activation quantisation for weight type 'IQ2_XS'$"):
        activation_values(np.zeros(32, np.float32), "IQ2_XS")
    with pytest.raises(QuantError, match="^a tensor: Q4_0 blocks hold no minimum \\(only Q4_1 and Q5_1 do\\)$"):
        block_mins(bytes(18), TYPE_IDS["Q4_0"], 32)
    with pytest.raises(QuantError, match="^a tensor: 19 bytes, where 32 Q4_1 elements take 20$"):
        block_mins(bytes(19), TYPE_IDS["Q4_1"], 32)
