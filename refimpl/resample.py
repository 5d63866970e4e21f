"""Bicubic resampling of uint8 images, two engines' rules (a = -0.5, antialiased when shrinking; separable passes
in fixed point): Pillow's ``Image.resize(..., BICUBIC)`` (``resize_bicubic``; transformers' PIL image processors,
refimpl.image) and PyTorch's ``interpolate(uint8, mode="bicubic", antialias=True)`` (``resize_bicubic_torch``;
torchvision's ``resize`` of a uint8 tensor on the CPU, which transformers' video processors use).

Both take the same double-precision taps (``resample_weights``: the filter widened by the scale when shrinking, the
taps past the edge dropped, the rest renormalised). Pillow rounds them to 22-bit int32 fixed point and runs the
vertical pass first when the height shrinks by more than twice as many pixels as the width does; PyTorch (its
Pillow-SIMD port) rounds each pass's taps to int16 at the largest precision that keeps the largest tap below 2^15,
and runs the horizontal pass first. Each pass: an integer sum from half a unit, shifted down and clipped to 0..255.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import InputError

__all__ = ["bicubic_filter", "check_image_array", "positive_int", "resample_coefficients", "resample_rows",
           "resample_weights", "resize_bicubic", "resize_bicubic_torch", "torch_coefficients"]


def check_image_array(image) -> np.ndarray:
    """The image as given when it is RGB uint8 [h, w, 3] with at least one pixel (InputError otherwise)."""
    if not isinstance(image, np.ndarray):
        raise InputError(f"the image must be a NumPy array [height, width, 3] of uint8, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise InputError(
            f"the image must have dtype uint8 (values 0..255), got {image.dtype}; "
            "convert it with np.clip(x, 0, 255).astype(np.uint8) or read it with read_image"
        )
    if image.ndim != 3 or image.shape[2] != 3:
        raise InputError(f"the image must have shape [height, width, 3] (RGB), got {list(image.shape)}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise InputError(f"the image is empty (shape {list(image.shape)}); pass at least one pixel")
    return image


def positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


PRECISION_BITS = 32 - 8 - 2
BICUBIC_SUPPORT = 2.0


def bicubic_filter(x: np.ndarray) -> np.ndarray:
    """Keys' cubic with a = -0.5, evaluated with Pillow's operation order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def resample_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``precompute_coeffs``: first source index [out] and the normalised double taps [out, ksize].

    Downscaling widens the filter by the scale (antialias); taps past the image edge are dropped and the
    rest renormalised.
    """
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = BICUBIC_SUPPORT * filterscale
    ksize = math.ceil(support) * 2 + 1
    center = (np.arange(out_size) + 0.5) * scale  # [out]
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    taps = np.arange(ksize)  # [ksize]
    w = bicubic_filter(((taps + xmin[:, None]) - center[:, None] + 0.5) * (1.0 / filterscale))
    w = np.where(taps < count[:, None], w, 0.0)  # [out, ksize]
    total = np.zeros(out_size)
    for j in range(ksize):  # Pillow sums left to right; keep that order for bit-exact sums
        total = total + w[:, j]
    return xmin, np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)


def _fixed(w: np.ndarray, bits: int) -> np.ndarray:
    """Taps rounded half away from zero to ``bits`` fractional bits."""
    fixed = w * (1 << bits)
    return np.where(w < 0, np.trunc(-0.5 + fixed), np.trunc(0.5 + fixed)).astype(np.int64)


def resample_coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's taps (``normalize_coeffs_8bpc``): first source index [out] and int taps [out, ksize] at
    PRECISION_BITS."""
    xmin, w = resample_weights(in_size, out_size)
    return xmin, _fixed(w, PRECISION_BITS)


def torch_coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """PyTorch's int16 taps (``_compute_index_ranges_int16_weights``): first source index [out], int taps
    [out, ksize] and their precision: the largest (at most 22) at which the largest tap stays below 2^15."""
    xmin, w = resample_weights(in_size, out_size)
    w_max, bits = float(w.max()), 0
    while bits < 22 and int(0.5 + w_max * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    return xmin, _fixed(w, bits), bits


def resample_rows(image: np.ndarray, out_width: int, torch_rule: bool = False) -> np.ndarray:
    """One pass along axis 1: uint8 [h, w, c] -> uint8 [h, out_width, c] (``ImagingResampleHorizontal_8bpc``;
    ``torch_rule``: PyTorch's int16 taps).

    Sums are exact integers in int32, as Pillow's ``int`` accumulators (at most about 2^31 / 1.5).
    """
    w = image.shape[1]
    if torch_rule:
        xmin, taps, bits = torch_coefficients(w, out_width)
    else:
        (xmin, taps), bits = resample_coefficients(w, out_width), PRECISION_BITS  # [W'], [W', ksize]
    taps = taps.astype(np.int32)
    acc = np.full((image.shape[0], out_width, image.shape[2]), 1 << (bits - 1), np.int32)
    for j in range(taps.shape[1]):  # gather tap j of every output pixel; taps past the edge are 0
        column = np.take(image, np.minimum(xmin + j, w - 1), axis=1)  # [h, W', c] uint8
        acc += column * taps[None, :, j, None]
    return np.clip(acc >> bits, 0, 255).astype(np.uint8)


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [height, width, 3], bit-exact with Pillow ``resize((width, height), BICUBIC)``.

    Two rounded passes. Pillow (``ImagingResampleInner``) runs the vertical pass first when the height
    shrinks by more than twice as many pixels as the width does, else the horizontal pass first; the
    order changes the rounding, so it is copied.
    """
    image = check_image_array(image)
    height, width = positive_int(height, "height"), positive_int(width, "width")
    h, w, _ = image.shape
    if (h, w) == (height, width):
        return image.copy()
    if h - height > 0 and h - height > 2 * (w - width):  # vertical pass first
        return _resize_width(_resize_height(image, height), width)
    return _resize_height(_resize_width(image, width), height)


def resize_bicubic_torch(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [height, width, 3] as ``torch.nn.functional.interpolate(x, (height, width),
    mode="bicubic", antialias=True)`` on a uint8 CPU tensor: PyTorch's int16 taps, the horizontal pass first."""
    image = check_image_array(image)
    height, width = positive_int(height, "height"), positive_int(width, "width")
    return _resize_height(_resize_width(image, width, True), height, True)


def _resize_width(image: np.ndarray, width: int, torch_rule: bool = False) -> np.ndarray:
    return image if image.shape[1] == width else resample_rows(image, width, torch_rule)  # [h, width, 3]


def _resize_height(image: np.ndarray, height: int, torch_rule: bool = False) -> np.ndarray:
    if image.shape[0] == height:
        return image
    return np.ascontiguousarray(resample_rows(image.transpose(1, 0, 2), height, torch_rule).transpose(1, 0, 2))
