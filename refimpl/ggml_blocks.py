"""ggml's block formats, decoded exactly into float64 (docs/quantised.md; the layouts of ggml-common.h).

A GGUF tensor's data is a run of blocks along its first dimension ``ne[0]`` (NumPy's last axis): QK elements
per block, ``bytes`` bytes each. Every value of these types is exact in float64 (an f16 scale times small
integers, plus an f16 minimum for Q4_1/Q5_1, minus an f16 dmin times a 6-bit min for Q2_K/Q4_K/Q5_K):
decoding in float64 rounds nothing, where ggml's float32 ``dequantize_row_*`` rounds Q4_1, Q5_1, Q2_K, Q4_K
and Q5_K once.

    dequantize(raw, ggml_type, n)   raw: uint8 [n / QK * bytes] -> float64 [n]

Decoded here: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(super-blocks of 256). Any other type raises QuantError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import RefimplError


class QuantError(RefimplError):
    """A tensor of a type this oracle does not decode, or whose bytes do not fit its type and size."""


@dataclass(frozen=True)
class BlockType:
    name: str
    qk: int  # elements per block
    nbytes: int  # bytes per block


# ggml_type values (ggml.h, enum ggml_type) of the types decoded here
TYPES = {
    0: BlockType("F32", 1, 4),
    1: BlockType("F16", 1, 2),
    2: BlockType("Q4_0", 32, 18),
    3: BlockType("Q4_1", 32, 20),
    6: BlockType("Q5_0", 32, 22),
    7: BlockType("Q5_1", 32, 24),
    8: BlockType("Q8_0", 32, 34),
    10: BlockType("Q2_K", 256, 84),
    11: BlockType("Q3_K", 256, 110),
    12: BlockType("Q4_K", 256, 144),
    13: BlockType("Q5_K", 256, 176),
    14: BlockType("Q6_K", 256, 210),
    30: BlockType("BF16", 1, 2),
}

# the names of the other ggml types, for the refusal (ggml.h)
OTHER_NAMES = {9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS",
               17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
               24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0",
               39: "MXFP4"}


# (elements, bytes) per block of the types not decoded here, so that a file holding them can still be read and
# checked (ggml-common.h; gguf-py's GGML_QUANT_SIZES)
OTHER_SIZES = {15: (256, 292), 20: (32, 18), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),
               28: (1, 8), 34: (256, 54), 35: (256, 66), 39: (32, 17)}


def type_name(ggml_type: int) -> str:
    if ggml_type in TYPES:
        return TYPES[ggml_type].name
    return OTHER_NAMES.get(ggml_type, f"type {ggml_type}")


def block_type(ggml_type: int, what: str = "a tensor") -> BlockType:
    """The layout of a decoded type, or QuantError naming ``what`` and the type."""
    if ggml_type not in TYPES:
        known = ", ".join(t.name for t in TYPES.values())
        raise QuantError(f"{what} is of ggml type {type_name(ggml_type)}, which the oracle does not decode "
                         f"(it decodes {known})")
    return TYPES[ggml_type]


def tensor_nbytes(ggml_type: int, n: int, what: str = "a tensor") -> int:
    """Bytes of ``n`` elements of a type (decoded here or not); QuantError for a type of unknown block size or
    when ``n`` is not a whole number of blocks."""
    if ggml_type in TYPES:
        qk, nbytes = TYPES[ggml_type].qk, TYPES[ggml_type].nbytes
    elif ggml_type in OTHER_SIZES:
        qk, nbytes = OTHER_SIZES[ggml_type]
    else:
        raise QuantError(f"{what} is of ggml type {type_name(ggml_type)}, whose block size the oracle does not know")
    if n % qk:
        raise QuantError(f"{what}: {n} elements are not a whole number of {type_name(ggml_type)} blocks of {qk}")
    return n // qk * nbytes


# ----------------------------------------------------------------------------------------------
# fields of a block array: blocks uint8 [B, bytes]


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """[B, bytes] -> float64 [B, 1]: the little-endian IEEE half at ``offset`` (subnormals kept)."""
    return blocks[:, offset:offset + 2].copy().view("<f2").astype(np.float64)


def u32_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """[B, bytes] -> uint32 [B, 1]: the little-endian uint32 at ``offset``."""
    return blocks[:, offset:offset + 4].copy().view("<u4")


def nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 16] uint8 -> int64 [B, 32]: element j is the low nibble of byte j, element j + 16 its high nibble
    (not interleaved)."""
    return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int64)


def high_bits(qh: np.ndarray) -> np.ndarray:
    """[B, 1] uint32 -> int64 [B, 32]: bit k of the little-endian uint32 is the fifth bit of element k."""
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# one function per type: blocks uint8 [B, bytes] -> float64 [B, QK]


def q8_0(blocks: np.ndarray) -> np.ndarray:
    d = f16_field(blocks, 0)  # [B, 1]
    q = blocks[:, 2:34].view(np.int8).astype(np.float64)  # [B, 32]
    return d * q


def q4_0(blocks: np.ndarray) -> np.ndarray:
    d = f16_field(blocks, 0)
    return d * (nibbles(blocks[:, 2:18]) - 8)


def q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    return d * nibbles(blocks[:, 4:20]) + m


def q5_0(blocks: np.ndarray) -> np.ndarray:
    d = f16_field(blocks, 0)
    q = nibbles(blocks[:, 6:22]) + 16 * high_bits(u32_field(blocks, 2))
    return d * (q - 16)


def q5_1(blocks: np.ndarray) -> np.ndarray:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    q = nibbles(blocks[:, 8:24]) + 16 * high_bits(u32_field(blocks, 4))
    return d * q + m


# ----------------------------------------------------------------------------------------------
# the K-quants: super-blocks of 256 elements, k = 0..255. Shapes [B, h, p, l] name k = 128 h + 32 p + l.


def planes(qs: np.ndarray, count: int, bits: int) -> np.ndarray:
    """[B, n] uint8 -> int64 [B, count, n]: plane p is (qs >> bits·p) & (2^bits - 1)."""
    shifts = (bits * np.arange(count, dtype=np.uint8))[None, :, None]
    return ((qs[:, None, :] >> shifts) & ((1 << bits) - 1)).astype(np.int64)


def per_16(values: np.ndarray) -> np.ndarray:
    """[B, 16] -> [B, 256]: the value of sub-block j for its 16 elements 16 j .. 16 j + 15."""
    return np.repeat(values, 16, axis=1)


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, 12] uint8 -> (scale, min) int64 [B, 8], ggml's get_scale_min_k4: 6 bits each, sub-blocks 0-3 in the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins), sub-blocks 4-7 low 4 bits from bytes 8-11, high 2 bits from
    the top of bytes 0-3 (scales) and 4-7 (mins)."""
    s = scales.astype(np.int64)
    low = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mins = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return low, mins


def q2_k(blocks: np.ndarray) -> np.ndarray:
    """scales[16] 0, qs[64] 16, d 80, dmin 82: d·lo(s)·q − dmin·hi(s), q the 2-bit plane p of qs[32 h + l]."""
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    q = planes(blocks[:, 16:80].reshape(-1, 32), 4, 2).reshape(-1, 256)  # [B·2, 4, 32] -> [B, 256]
    s = blocks[:, 0:16].astype(np.int64)
    return d * per_16(s & 15) * q - dmin * per_16(s >> 4)


def q3_k(blocks: np.ndarray) -> np.ndarray:
    """hmask[32] 0, qs[64] 32, scales[12] 96, d 108: d·sc·q, q = 2-bit code − 4 where the hmask bit is clear,
    sc a signed 6-bit scale per 16 elements."""
    d = f16_field(blocks, 108)
    low2 = planes(blocks[:, 32:96].reshape(-1, 32), 4, 2).reshape(-1, 256)
    hb = planes(blocks[:, 0:32], 8, 1).reshape(-1, 256)  # bit j of hmask[l] belongs to k = 32 j + l
    sc = blocks[:, 96:108].astype(np.int64)
    low4 = np.concatenate([sc[:, 0:8] & 15, sc[:, 0:8] >> 4], axis=1)  # [B, 16]
    high2 = planes(blocks[:, 104:108], 4, 2).reshape(-1, 16)  # (scales[8 + j mod 4] >> 2 (j div 4)) & 3
    return d * per_16((low4 | (high2 << 4)) - 32) * (low2 - 4 * (1 - hb))


def q4_k(blocks: np.ndarray) -> np.ndarray:
    """d 0, dmin 2, scales[12] 4, qs[128] 16: d·sc_j·q − dmin·m_j over sub-blocks j of 32."""
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, m = scale_min_k4(blocks[:, 4:16])
    q = planes(blocks[:, 16:144].reshape(-1, 32), 2, 4).reshape(-1, 256)  # k = 64 c + 32 half + l
    return d * np.repeat(sc, 32, axis=1) * q - dmin * np.repeat(m, 32, axis=1)


def q5_k(blocks: np.ndarray) -> np.ndarray:
    """d 0, dmin 2, scales[12] 4, qh[32] 16, qs[128] 48: as Q4_K, plus 16 × bit (k div 32) of qh[l]."""
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, m = scale_min_k4(blocks[:, 4:16])
    q = planes(blocks[:, 48:176].reshape(-1, 32), 2, 4).reshape(-1, 256)
    q += 16 * planes(blocks[:, 16:48], 8, 1).reshape(-1, 256)
    return d * np.repeat(sc, 32, axis=1) * q - dmin * np.repeat(m, 32, axis=1)


def q6_k(blocks: np.ndarray) -> np.ndarray:
    """ql[128] 0, qh[64] 128, scales int8[16] 192, d 208: d·sc·q, q = (low 4 bits | high 2 bits << 4) − 32."""
    d = f16_field(blocks, 208)
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # [B, h, g mod 2, l]: ql[64 h + 32 (g mod 2) + l]
    low = planes(ql.reshape(-1, 32), 2, 4).reshape(-1, 2, 2, 2, 32)  # [B, h, g mod 2, g div 2, l]
    low = low.transpose(0, 1, 3, 2, 4).reshape(-1, 256)  # g = 2 (g div 2) + (g mod 2)
    high = planes(blocks[:, 128:192].reshape(-1, 32), 4, 2).reshape(-1, 256)  # (qh[32 h + l] >> 2 g) & 3
    sc = blocks[:, 192:208].view(np.int8).astype(np.int64)
    return d * per_16(sc) * ((low | (high << 4)) - 32)


BLOCK_DECODERS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q2_K": q2_k,
                  "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


def dequantize(raw, ggml_type: int, n: int, what: str = "a tensor") -> np.ndarray:
    """``n`` elements of ``ggml_type`` from their bytes ``raw`` (bytes, memoryview or uint8 array) -> float64
    [n]. QuantError for a type not decoded here or bytes that do not fit."""
    block_type(ggml_type, what)
    need = tensor_nbytes(ggml_type, n, what)
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    if data.size != need:
        raise QuantError(f"{what}: {data.size} bytes, where {n} {type_name(ggml_type)} elements take {need}")
    name = TYPES[ggml_type].name
    with np.errstate(invalid="ignore"):  # a signalling NaN stays a NaN
        if name == "F32":
            return data.view("<f4").astype(np.float64)
        if name == "F16":
            return data.view("<f2").astype(np.float64)
        if name == "BF16":  # the upper half of a float32
            return (data.view("<u2").astype("<u4") << 16).view("<f4").astype(np.float64)
    blocks = data.reshape(-1, TYPES[ggml_type].nbytes)  # [B, bytes]
    return BLOCK_DECODERS[name](blocks).reshape(-1)


MIN_TYPES = ("Q4_1", "Q5_1")  # the types whose blocks hold an f16 minimum m: w = d q + m


def block_mins(raw, ggml_type: int, n: int, what: str = "a tensor") -> np.ndarray:
    """The f16 minimum m of each block of ``n`` elements of a Q4_1 or Q5_1 tensor -> float64 [n / 32] (ggml's
    Q4_1 / Q5_1 dot product multiplies it by the activations' Q8_1 sum term: refimpl/ggml_act.py)."""
    name = block_type(ggml_type, what).name
    if name not in MIN_TYPES:
        raise QuantError(f"{what}: {name} blocks hold no minimum (only {' and '.join(MIN_TYPES)} do)")
    need = tensor_nbytes(ggml_type, n, what)
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    if data.size != need:
        raise QuantError(f"{what}: {data.size} bytes, where {n} {name} elements take {need}")
    return f16_field(data.reshape(-1, TYPES[ggml_type].nbytes), 2)[:, 0]
