"""MLX's quantisation (``mlx.core.quantize``; ``mlx_lm.convert -q``), decoded into float64: the affine mode, and the
floating-point modes mxfp4, nvfp4 and mxfp8.

A quantised module's weight W [out, in] (experts: [E, out, in]) is stored as three tensors:

    <path>.weight   uint32 [..., out, in * b / 32]   the b-bit codes q, each row one little-endian bit stream:
                                                     code k in bits [k b, (k + 1) b), bit 0 the LSB of byte 0
    <path>.scales   float  [..., out, in / g]        s, one per group of g consecutive inputs
    <path>.biases   float  [..., out, in / g]        beta

and W[o, i] = s[o, i // g] * q[o, i] + beta[o, i // g]. ``dequantize`` computes exactly that in float64 from the
stored s and beta (float32, float16 or bfloat16, each exact in float64). The product s * q is exact (at most
24 + 8 significant bits), and so is the sum unless beta and s * q lie more than 2^21 apart in magnitude
(2^34 for half-precision scales), where it is within one float64 rounding: the value a correct engine
dequantises to, before its own rounding (``mlx.core.dequantize`` rounds s * q and then the sum to float32, or
to the half type when the scales are halves).

The floating-point modes store no biases: each code is a float (E2M1 for the 4-bit modes: sign, 2 exponent bits,
1 mantissa bit, values 0, 0.5, 1, 1.5, 2, 3, 4, 6; E4M3 for mxfp8: sign, 4 exponent bits of bias 7, 3 mantissa
bits, subnormals, no infinities, 0x7f / 0xff NaN) and each group's scale one uint8: E8M0 (2^(e - 127), 255
NaN) for mxfp4 and mxfp8 at group size 32, E4M3 for nvfp4 at group size 16. W = scale * value, exact in float64
(and in float32 inside its range, which is what ``mlx.core.dequantize`` computes). An nvfp4 module with a
tensor-wide ``global_scale`` (mlx-lm's option for MoE experts) is refused: not read yet.

``config.json`` says how each module was quantised (``quantization``, copied as ``quantization_config``): the
defaults ``{"group_size", "bits", "mode"}`` and per-module entries keyed by the module's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import WeightsError

BITS = (2, 3, 4, 5, 6, 8)  # the widths mlx's affine mode packs that the oracle decodes
GROUP_SIZES = (32, 64, 128)  # mlx's affine group sizes
MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
KNOWN_MODES = MODES
# the floating-point modes: (bits, group size, scale format); mlx takes no other widths or groups for them
FLOAT_MODES = {"mxfp4": (4, 32, "e8m0"), "nvfp4": (4, 16, "e4m3"), "mxfp8": (8, 32, "e8m0")}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def e2m1(codes: np.ndarray) -> np.ndarray:
    """The float64 value of 4-bit E2M1 codes (bit 3 the sign)."""
    return np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]


def e4m3(codes: np.ndarray) -> np.ndarray:
    """The float64 value of 8-bit E4M3 (fn) codes: bias 7, subnormals, 0x7f / 0xff NaN."""
    codes = np.asarray(codes, dtype=np.int64)
    exp, man = (codes >> 3) & 15, codes & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    mag = np.where((codes & 127) == 127, np.nan, mag)
    return np.where(codes & 128, -mag, mag)


def e8m0(codes: np.ndarray) -> np.ndarray:
    """The float64 value of 8-bit E8M0 scales: 2^(e - 127), 255 NaN."""
    codes = np.asarray(codes, dtype=np.int64)
    return np.where(codes == 255, np.nan, np.exp2(codes - 127.0))
DEFAULT_KEYS = ("group_size", "bits", "mode")


@dataclass(frozen=True)
class QuantSpec:
    """How one module is quantised."""

    bits: int
    group_size: int
    mode: str = "affine"

    @property
    def label(self) -> str:
        """The stored type as inspect counts it, e.g. ``affine q4 g64``."""
        return f"{self.mode} q{self.bits} g{self.group_size}"


def _spec(entry: Any, where: str, default: QuantSpec | None = None) -> QuantSpec:
    """A QuantSpec of one config entry (missing keys from ``default``); WeightsError naming ``where``."""
    if not isinstance(entry, dict):
        raise WeightsError(f"{where}: expected an object with group_size and bits, got {entry!r}")
    bits = entry.get("bits", None if default is None else default.bits)
    group = entry.get("group_size", None if default is None else default.group_size)
    mode = entry.get("mode", "affine")  # mlx-lm writes no mode for the router's 8-bit entry: affine
    if mode not in KNOWN_MODES:
        raise WeightsError(f"{where}: unknown quantisation mode {mode!r} (mlx's are {', '.join(KNOWN_MODES)})")
    if entry.get("global_scale"):
        raise WeightsError(f"{where}: global_scale (a tensor-wide nvfp4 scale) is not read yet by the oracle")
    if mode in FLOAT_MODES:
        want_bits, want_group, _ = FLOAT_MODES[mode]
        bits = want_bits if bits is None else bits
        group = want_group if group is None else group
        if (bits, group) != (want_bits, want_group):
            raise WeightsError(f"{where}: mode {mode!r} takes bits {want_bits} and group_size {want_group} only, "
                               f"got bits {bits!r} and group_size {group!r}")
        return QuantSpec(int(bits), int(group), mode)
    if isinstance(bits, bool) or bits not in BITS:
        raise WeightsError(f"{where}: bits {bits!r} is not one of MLX's affine widths the oracle decodes "
                           f"({', '.join(map(str, BITS))})")
    if isinstance(group, bool) or group not in GROUP_SIZES:
        raise WeightsError(f"{where}: group_size {group!r} is not one of MLX's affine group sizes "
                           f"({', '.join(map(str, GROUP_SIZES))})")
    return QuantSpec(int(bits), int(group), mode)


def parse_quantization(block: Any, where: str) -> tuple[QuantSpec, dict[str, QuantSpec | None]]:
    """(the default spec, module path -> its own spec, or None for a module left unquantised) of a config's
    ``quantization`` block; WeightsError, one line naming the key, for a malformed one."""
    if not isinstance(block, dict):
        raise WeightsError(f"{where}: 'quantization' must be an object, got {type(block).__name__}")
    default = _spec({k: block[k] for k in DEFAULT_KEYS if k in block}, f"{where}: quantization")
    per_module: dict[str, QuantSpec | None] = {}
    for key, entry in block.items():
        if key in DEFAULT_KEYS:
            continue
        if entry is False:
            per_module[key] = None
        elif entry is True:
            per_module[key] = default
        else:
            per_module[key] = _spec(entry, f"{where}: quantization[{key!r}]", default)
    return default, per_module


def unpack_codes(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` b-bit codes of each row of ``words`` (uint32 [..., W], little-endian bit streams) as
    int64 [..., count]."""
    data = np.ascontiguousarray(words, dtype="<u4").view(np.uint8)  # [..., 4 W], byte 0 first
    if bits == 8:
        return data[..., :count].astype(np.int64)
    if 8 % bits == 0:  # 2 and 4: whole codes per byte, the low bits first
        per = 8 // bits
        shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
        codes = (data[..., None] >> shifts) & np.uint8((1 << bits) - 1)
        return codes.reshape(*data.shape[:-1], -1)[..., :count].astype(np.int64)
    stream = np.unpackbits(data, axis=-1, bitorder="little")[..., :count * bits]  # 3, 5, 6: codes cross bytes
    weights = (1 << np.arange(bits, dtype=np.int64))
    return stream.reshape(*data.shape[:-1], count, bits).astype(np.int64) @ weights


def dequantize(words: np.ndarray, scales: np.ndarray, biases: np.ndarray | None, spec: QuantSpec) -> np.ndarray:
    """W [..., out, in] = s * q + beta in float64 (``scales``, ``biases``: [..., out, in / g], any float dtype);
    for a floating-point mode, scale * value (``scales``: the uint8 codes, as stored or as their float64 values;
    ``biases`` None)."""
    groups = scales.shape[-1]
    n_in = groups * spec.group_size
    q = unpack_codes(words, spec.bits, n_in).reshape(*scales.shape, spec.group_size)
    if spec.mode in FLOAT_MODES:
        values = e2m1(q) if spec.bits == 4 else e4m3(q)
        codes = np.asarray(scales).astype(np.int64)
        s = (e8m0(codes) if FLOAT_MODES[spec.mode][2] == "e8m0" else e4m3(codes))[..., None]
        return (s * values).reshape(*scales.shape[:-1], n_in)
    s = np.asarray(scales, dtype=np.float64)[..., None]
    beta = np.asarray(biases, dtype=np.float64)[..., None]
    return (s * q + beta).reshape(*scales.shape[:-1], n_in)


def check_shapes(path: str, spec: QuantSpec, weight: tuple[int, ...], scales: tuple[int, ...],
                 biases: tuple[int, ...] | None) -> tuple[int, ...]:
    """The logical shape [..., out, in] of a quantised module, after checking that its packed weight, scales and
    biases fit ``spec``; WeightsError, one line naming the module, when they do not."""
    words = weight[-1] if weight else 0
    if not weight or words * 32 % spec.bits:
        raise WeightsError(f"{path}: the packed weight {list(weight)} holds {words} uint32 words a row, which do "
                           f"not divide into {spec.bits}-bit codes")
    n_in = words * 32 // spec.bits
    if n_in % spec.group_size:
        raise WeightsError(f"{path}: {n_in} inputs a row ({words} words of {spec.bits}-bit codes) do not divide into "
                           f"groups of {spec.group_size}")
    want = (*weight[:-1], n_in // spec.group_size)
    if tuple(scales) != want:
        raise WeightsError(f"{path}: scales {list(scales)} do not match the packed weight {list(weight)} at "
                           f"{spec.bits} bits and group size {spec.group_size} (expected {list(want)})")
    if spec.mode in FLOAT_MODES:
        if biases is not None:
            raise WeightsError(f"{path}: biases beside {spec.mode} scales; MLX's floating-point modes store none")
        return (*weight[:-1], n_in)
    if biases is None:
        raise WeightsError(f"{path}: no biases; MLX's affine mode stores '{path}.biases' beside the scales")
    if tuple(biases) != want:
        raise WeightsError(f"{path}: biases {list(biases)} do not match the scales {list(scales)}")
    return (*weight[:-1], n_in)
