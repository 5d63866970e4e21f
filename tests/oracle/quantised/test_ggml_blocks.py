"""ggml's block formats decoded into float64 (refimpl/ggml_blocks.py; issue 45, part 1), against two independent
paths: a scalar decoder written here element by element from the layout table of the quantised-weights spec
(every value of these types is exact in float64, so the two must agree exactly), and gguf-py's float32
``dequantize`` (bit-identical to ggml's ``dequantize_row_*``): equal where float32 holds the value exactly
(F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q3_K, Q6_K), its single rounding otherwise (Q4_1, Q5_1: d·q + m; Q2_K,
Q4_K, Q5_K: d·sc·q − dmin·m; issue 46 for the K-quants).

Blocks are drawn by hypothesis: every byte pattern of the codes and of the packed 4- and 6-bit scales and mins
(so every packing position), scales and dmins of both signs, zero, f16 subnormals and the extremes of the f16
range."""

from __future__ import annotations

import struct

import gguf
import gguf.quants as gguf_quants
import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.ggml_blocks import QuantError, dequantize, tensor_nbytes

QUANT = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14}
ROUNDED = {"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"}  # d·q + m, d·sc·q − dmin·m: float32 rounds them once
PLAIN = {"F32": 0, "F16": 1, "BF16": 30}
SIZES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144,
         "Q5_K": 176, "Q6_K": 210}
QK = {name: 256 if name.endswith("_K") else 32 for name in QUANT}
HALVES = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}  # the offsets of each type's f16 fields (d, and m or dmin); the others: (0,)

# finite halves: zero, subnormals (down to 2^-24), normals up to 65504, both signs
HALF = st.one_of(st.sampled_from([0.0, -0.0, 2.0**-24, -(2.0**-24), 6.097555e-05, 65504.0, -65504.0, 1.0, -1.0]),
                 st.floats(min_value=-65504, max_value=65504, width=16, allow_nan=False, allow_infinity=False))


def half_bytes(x: float) -> bytes:
    return np.float16(x).tobytes()


def scalar_decode(name: str, block: bytes) -> list[float]:
    """One block, element by element, as the spec's table says (Python floats are float64)."""
    def f16(off):
        return float(np.frombuffer(block[off:off + 2], "<f2")[0])

    def nibble(qs, k):  # element k < 16: low nibble of byte k; k >= 16: high nibble of byte k - 16
        return qs[k] & 15 if k < 16 else qs[k - 16] >> 4

    if name == "Q8_0":
        d = f16(0)
        return [d * struct.unpack("b", block[2 + k:3 + k])[0] for k in range(32)]
    if name == "Q4_0":
        d, qs = f16(0), block[2:18]
        return [d * (nibble(qs, k) - 8) for k in range(32)]
    if name == "Q4_1":
        d, m, qs = f16(0), f16(2), block[4:20]
        return [d * nibble(qs, k) + m for k in range(32)]
    if name == "Q5_0":
        d, (qh,), qs = f16(0), struct.unpack("<I", block[2:6]), block[6:22]
        return [d * (nibble(qs, k) + 16 * ((qh >> k) & 1) - 16) for k in range(32)]
    if name == "Q5_1":
        d, m, (qh,), qs = f16(0), f16(2), struct.unpack("<I", block[4:8]), block[8:24]
        return [d * (nibble(qs, k) + 16 * ((qh >> k) & 1)) + m for k in range(32)]
    return [k_quant(name, block, k, f16) for k in range(256)]


def k_quant(name: str, b: bytes, k: int, f16) -> float:
    """Element k of a K-quant super-block, from the spec's element indexing (§4), one element at a time."""
    h, r, l = k // 128, k % 128, k % 32  # noqa: E741 - l: the spec's name for k mod 32
    p = r // 32
    if name == "Q2_K":
        q, s = (b[16 + 32 * h + l] >> 2 * p) & 3, b[k // 16]
        return f16(80) * (s & 15) * q - f16(82) * (s >> 4)
    if name == "Q3_K":
        hb = (b[l] >> (k // 32)) & 1
        q = ((b[32 + 32 * h + l] >> 2 * p) & 3) - 4 * (1 - hb)
        j, sc = k // 16, b[96:108]
        low = sc[j] & 15 if j < 8 else sc[j - 8] >> 4
        high = (sc[8 + j % 4] >> 2 * (j // 4)) & 3
        return f16(108) * ((low | high << 4) - 32) * q
    if name in ("Q4_K", "Q5_K"):
        c, half, j, sc = k // 64, (k % 64) // 32, k // 32, b[4:16]
        qs = b[16:144] if name == "Q4_K" else b[48:176]
        q = (qs[32 * c + l] >> 4 * half) & 15
        if name == "Q5_K":
            q += 16 * ((b[16 + l] >> (k // 32)) & 1)
        if j < 4:
            scale, mn = sc[j] & 63, sc[j + 4] & 63
        else:
            scale, mn = (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4, (sc[j + 4] >> 4) | (sc[j] >> 6) << 4
        return f16(0) * scale * q - f16(2) * mn
    g = r // 32  # Q6_K
    low = (b[64 * h + l + 32 * (g % 2)] >> 4 * (g // 2)) & 15
    high = (b[128 + 32 * h + l] >> 2 * g) & 3
    sc = struct.unpack("b", b[192 + k // 16:193 + k // 16])[0]
    return f16(208) * sc * ((low | high << 4) - 32)


@st.composite
def blocks(draw, name: str):
    """(raw bytes, number of blocks): scales drawn as halves, every other byte uniform."""
    n = draw(st.integers(1, 6))
    out = bytearray()
    for _ in range(n):
        body = bytearray(draw(st.binary(min_size=SIZES[name], max_size=SIZES[name])))
        for at in HALVES.get(name, (0,)):
            body[at:at + 2] = half_bytes(draw(HALF))
        out += body
    return bytes(out), n


@pytest.mark.parametrize("name", sorted(QUANT))
@settings(max_examples=examples(150), deadline=None)
@given(data=st.data())
def test_blocks_equal_the_scalar_decoder_and_gguf_py(name, data):
    raw, n = data.draw(blocks(name))
    got = dequantize(raw, QUANT[name], QK[name] * n)
    assert got.dtype == np.float64 and got.shape == (QK[name] * n,)
    want = [v for b in range(n) for v in scalar_decode(name, raw[b * SIZES[name]:(b + 1) * SIZES[name]])]
    assert got.tolist() == want  # both exact in float64
    ref32 = gguf_quants.dequantize(np.frombuffer(raw, np.uint8), gguf.GGMLQuantizationType(QUANT[name]))
    ref32 = np.asarray(ref32).reshape(-1)
    if name in ROUNDED:  # gguf-py (and ggml) round the exact value once to float32
        assert np.array_equal(got.astype(np.float32), ref32)
        assert np.all(np.abs(got - ref32) <= np.abs(got) * 2.0**-24 + 2.0**-149)
    else:
        assert np.array_equal(got, ref32.astype(np.float64))


@pytest.mark.parametrize("name", sorted(PLAIN))
@settings(max_examples=examples(100), deadline=None)
@given(data=st.data())
def test_plain_types_equal_gguf_py(name, data):
    width = 4 if name == "F32" else 2
    raw = data.draw(st.binary(min_size=width, max_size=64 * width).filter(lambda b: len(b) % width == 0))
    got = dequantize(raw, PLAIN[name], len(raw) // width)
    ref = np.asarray(gguf_quants.dequantize(np.frombuffer(raw, np.uint8),
                                            gguf.GGMLQuantizationType(PLAIN[name]))).reshape(-1)
    with np.errstate(invalid="ignore"):  # a signalling NaN widened
        assert np.array_equal(got, ref.astype(np.float64), equal_nan=True)


def test_the_traps_of_the_layout():
    """Nibble halves (not interleaved), the little-endian fifth bits, the offsets subtracted before the scale,
    a negative scale, an f16 subnormal scale kept."""
    qs = bytes([0x21] + [0] * 15)  # element 0: low nibble 1; element 16: high nibble 2
    q4 = half_bytes(2.0) + qs
    got = dequantize(q4, QUANT["Q4_0"], 32)
    assert got[0] == 2.0 * (1 - 8) and got[16] == 2.0 * (2 - 8) and got[1] == 2.0 * -8
    q5 = half_bytes(-0.5) + struct.pack("<I", 1 << 17) + bytes(16)  # element 17 has its fifth bit
    got = dequantize(q5, QUANT["Q5_0"], 32)
    assert got[17] == -0.5 * (16 - 16) and got[0] == -0.5 * -16
    q8 = half_bytes(2.0**-24) + bytes([0x81]) + bytes(31)  # int8 -127 times the smallest subnormal
    assert dequantize(q8, QUANT["Q8_0"], 32)[0] == -127 * 2.0**-24
    q41 = half_bytes(0.25) + half_bytes(-3.0) + bytes([0xF0]) + bytes(15)
    got = dequantize(q41, QUANT["Q4_1"], 32)
    assert got[0] == -3.0 and got[16] == 0.25 * 15 - 3.0  # the min is added


def test_other_types_and_bad_sizes_are_refused_in_one_line():
    with pytest.raises(QuantError, match=r"^blk\.0\.attn_q\.weight is of ggml type IQ4_NL, which the oracle does "
                                         r"not decode \(it decodes F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, "
                                         r"Q3_K, Q4_K, Q5_K, Q6_K, BF16\)$"):
        dequantize(bytes(18), 20, 32, "blk.0.attn_q.weight")
    with pytest.raises(QuantError, match=r"^x: 31 bytes, where 32 Q4_0 elements take 18$"):
        dequantize(bytes(31), 2, 32, "x")
    with pytest.raises(QuantError, match=r"^x: 40 elements are not a whole number of Q8_0 blocks of 32$"):
        tensor_nbytes(8, 40, "x")
    with pytest.raises(QuantError, match="ggml type type 99"):
        dequantize(b"", 99, 0)
    assert tensor_nbytes(30, 6) == 12 and tensor_nbytes(7, 64) == 48
