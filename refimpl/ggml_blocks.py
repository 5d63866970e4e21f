"""ggml's block formats, decoded exactly into float64 (docs/quantised.md; the layouts of ggml-common.h).

A GGUF tensor's data is a run of blocks along its first dimension ``ne[0]`` (NumPy's last axis): QK elements
per block, ``bytes`` bytes each. Every value of these types is exact in float64 (an f16 scale times small
integers, plus an f16 minimum for Q4_1/Q5_1): decoding in float64 rounds nothing, where ggml's float32
``dequantize_row_*`` rounds Q4_1 and Q5_1 once.

    dequantize(raw, ggml_type, n)   raw: uint8 [n / QK * bytes] -> float64 [n]

Decoded here: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1. Any other type raises QuantError naming it.
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
    30: BlockType("BF16", 1, 2),
}

# the names of the other ggml types, for the refusal (ggml.h)
OTHER_NAMES = {9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
               17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
               24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0",
               39: "MXFP4"}


# (elements, bytes) per block of the types not decoded here, so that a file holding them can still be read and
# checked (ggml-common.h; gguf-py's GGML_QUANT_SIZES)
OTHER_SIZES = {10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
               15: (256, 292), 20: (32, 18), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),
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


BLOCK_DECODERS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1}


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
