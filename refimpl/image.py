"""Gemma 4 image preprocessing in pure NumPy, bit-exact with transformers' ``Gemma4ImageProcessorPil``
(gemma4-multimodal-spec.md section 3, trap 14).

Pipeline for one image (p = patch_size, k = pooling_kernel_size, T = max_soft_tokens):

    file --read_image--> RGB uint8 [h, w, 3]
        PNG (zlib + NumPy) and binary PPM/PGM natively, anything else through Pillow if installed;
        transparency is composited onto opaque white with Pillow's integer ``alpha_composite``, so the
        result equals ``np.array(transformers.image_transforms.convert_to_rgb(PIL.Image.open(path)))``;
        an image declaring more than ``max_image_pixels()`` pixels is refused from its header, before
        anything is decompressed (REFIMPL_MAX_IMAGE_PIXELS, default Pillow's MAX_IMAGE_PIXELS)
      --aspect_ratio_preserving_size--> (H', W'), multiples of k p, at most T k^2 patches
        (small images are upscaled; skipped when (H', W') == (h, w))
      --resize_bicubic--> uint8 [H', W', 3]
        Pillow's ``Image.resize((W', H'), BICUBIC)``: separable antialiased bicubic (a = -0.5) with
        22-bit fixed-point taps, horizontal pass then vertical pass, each rounded and clipped to uint8
      --rescale--> float64 [H', W', 3] = x / 255
      --patchify--> pixel_values [N, 3 p^2], N = (H'/p)(W'/p), row-major over the patch grid, each
        patch ordered (row in patch, column in patch, channel) with the channel fastest
      --patch_positions--> positions int64 [N, 2] = (x = column, y = row)
        num_soft_tokens = N / k^2

No padding: the processor pads to T k^2 patches with zero pixels and position (-1, -1); the vision tower
(``refimpl.vision``) drops such rows anyway. transformers casts the rescaled pixels to float32; here they
stay float64 (``float32(ours) == theirs`` exactly).

What Pillow does that is copied on purpose, so that the same file gives the same pixels:
* 16-bit RGB, RGBA and grey+alpha keep the high byte of each sample; 16-bit grey (Pillow mode "I;16")
  is *clipped* to 255 by ``convert("RGB")``, not scaled, so most of a real 16-bit grey photo turns white.
* A tRNS colour key is compared with the samples as Pillow stores them: the 8-bit high bytes for 16-bit
  RGB, the expanded 0..255 value for 2- and 4-bit grey (so only key 0 can ever match there).
* Palette indices past the end of PLTE are black; tRNS gives palette alphas, missing entries are opaque.
* No EXIF orientation is applied (``convert_to_rgb`` does not; ``transformers.image_utils.load_image``
  does).

Dependencies: NumPy and the standard library only; Pillow is imported lazily as the decoder of
formats other than PNG and PPM/PGM.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .config_fields import read_json, read_media_file
from .errors import ConfigError, InputError
from .resample import check_image_array, positive_int, resize_bicubic
from .vision import VisionConfig

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
DEFAULT_MAX_SOFT_TOKENS = 280

# ----------------------------------------------------------------------------------------------
# reading files

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
OTHER_FORMATS = (  # magic bytes -> name, for messages only
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF8", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"RIFF", "WebP"),
)
NATIVE_HINT = "PNG and binary PPM/PGM (P6/P5) are read natively; `pip install pillow` enables the other formats"
MAX_PIXELS_ENV = "REFIMPL_MAX_IMAGE_PIXELS"
DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS (its warning threshold)


def max_image_pixels() -> int:
    """The most pixels (width x height) an image may declare: REFIMPL_MAX_IMAGE_PIXELS, else Pillow's
    default limit. Checked from the file's header, before anything is decompressed."""
    value = os.environ.get(MAX_PIXELS_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_PIXELS
    if not value.isdigit() or int(value) < 1:
        raise InputError(f"{MAX_PIXELS_ENV}={value!r}: the image size limit must be a positive whole number of pixels")
    return int(value)


def check_image_size(width: int, height: int, where: str) -> None:
    """InputError when an image declares more pixels than ``max_image_pixels()`` (a decompression bomb
    decodes a small file to gigabytes)."""
    limit = max_image_pixels()
    if width * height > limit:
        raise InputError(f"image {where} is {height}x{width} (HxW), {width * height} pixels: more than the limit of "
                         f"{limit} pixels that guards against decompression bombs; set {MAX_PIXELS_ENV} to a larger "
                         "number of pixels to read it")


def read_image(path: str | Path) -> np.ndarray:
    """The image at ``path`` as RGB uint8 [h, w, 3], transparency composited onto white."""
    path = Path(path)
    data = read_media_file(path, "image", "an image file")
    if data.startswith(PNG_SIGNATURE):
        return rgba_to_rgb(decode_png(data, str(path)))
    if data[:2] in (b"P5", b"P6"):
        return decode_pnm(data, str(path))
    return _read_with_pillow(path, data)


def _read_with_pillow(path: Path, data: bytes) -> np.ndarray:
    """Formats other than PNG/PPM: Pillow's decoder, then ``convert_to_rgb``'s rule (composite via NumPy)."""
    kind = next((name for magic, name in OTHER_FORMATS if data.startswith(magic)), None)
    try:  # lazily: Pillow is optional (PNG and PPM/PGM are decoded natively), and only these formats need it
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        what = f"a {kind} file" if kind else f"not a recognised image (it starts with {data[:8]!r})"
        raise InputError(f"{path} is {what}; {NATIVE_HINT}") from None
    previous = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None  # check_image_size is the one limit (Pillow's would raise past twice its own)
    try:
        with Image.open(path) as im:  # reads the header only
            check_image_size(im.width, im.height, str(path))
            im.load()
            if "A" in im.getbands() or im.info.get("transparency") is not None:
                return rgba_to_rgb(np.asarray(im.convert("RGBA")))
            return np.asarray(im.convert("RGB")).copy()
    except UnidentifiedImageError:
        raise InputError(
            f"{path} is not a recognised image (it starts with {data[:8]!r}); "
            "pass a PNG, PPM/PGM, JPEG, WebP or another format Pillow can open"
        ) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise InputError(f"{path}: {kind or 'image'} file is truncated or corrupt ({e}); re-export the file") from None
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def _png_chunks(data: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """(type, payload) of every chunk up to IEND; CRCs checked."""
    chunks, pos = [], len(PNG_SIGNATURE)
    while True:
        if pos + 8 > len(data):
            raise InputError(f"PNG {where} is truncated (it ends before the IEND chunk); re-export the file")
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        payload, crc = data[pos + 8 : pos + 8 + length], data[pos + 8 + length : pos + 12 + length]
        if len(crc) < 4:
            raise InputError(f"PNG {where} is truncated inside a {kind!r} chunk; re-export the file")
        if zlib.crc32(kind + payload) != struct.unpack(">I", crc)[0]:
            raise InputError(f"PNG {where} is corrupt: bad CRC in the {kind!r} chunk; re-export the file")
        chunks.append((kind, payload))
        pos += 12 + length
        if kind == b"IEND":
            return chunks


def decode_png(data: bytes, where: str = "<bytes>") -> np.ndarray:
    """PNG bytes -> RGBA uint8 [h, w, 4] with Pillow's mode conversions (module docstring)."""
    chunks = _png_chunks(data, where)
    if chunks[0][0] != b"IHDR" or len(chunks[0][1]) != 13:
        raise InputError(f"PNG {where} is corrupt: it does not start with a 13-byte IHDR chunk")
    w, h, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if w == 0 or h == 0:
        raise InputError(f"PNG {where} has zero width or height ({w}x{h}); pass a non-empty image")
    if ctype not in PNG_DEPTHS or depth not in PNG_DEPTHS[ctype] or comp or filt or interlace > 1:
        raise InputError(
            f"PNG {where} has an invalid header (bit depth {depth}, colour type {ctype}, compression {comp}, "
            f"filter {filt}, interlace {interlace})"
        )
    check_image_size(w, h, where)  # before anything is decompressed
    palette = b"".join(p for k, p in chunks if k == b"PLTE")
    trns = next((p for k, p in chunks if k == b"tRNS"), None)
    raw = _inflate(b"".join(p for k, p in chunks if k == b"IDAT"), _png_raw_size(w, h, depth, ctype, interlace), where)
    samples = _png_samples(raw, w, h, depth, ctype, interlace)  # [h, w, c] uint16
    return _png_to_rgba(samples, depth, ctype, palette, trns, where)


def _png_row_bytes(w: int, depth: int, ctype: int) -> int:
    return (w * PNG_CHANNELS[ctype] * depth + 7) // 8


def _adam7_passes(w: int, h: int) -> list[tuple[int, int, int, int, int, int]]:
    """(x0, y0, dx, dy, pass width, pass height) of the non-empty Adam7 passes."""
    sizes = [(x0, y0, dx, dy, (w - x0 + dx - 1) // dx, (h - y0 + dy - 1) // dy) for x0, y0, dx, dy in ADAM7]
    return [s for s in sizes if s[4] > 0 and s[5] > 0]


def _png_raw_size(w: int, h: int, depth: int, ctype: int, interlace: int) -> int:
    passes = _adam7_passes(w, h) if interlace else [(0, 0, 1, 1, w, h)]
    return sum(ph * (1 + _png_row_bytes(pw, depth, ctype)) for *_, pw, ph in passes)


def _inflate(compressed: bytes, size: int, where: str) -> bytes:
    """zlib-decompress exactly ``size`` bytes (no more, so a decompression bomb stops early)."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(compressed, size)
    except zlib.error as e:
        raise InputError(f"PNG {where} is corrupt: its image data does not decompress ({e}); re-export the file") \
            from None
    if len(raw) < size:
        raise InputError(
            f"PNG {where} is truncated: its image data holds {len(raw)} of {size} bytes; re-export the file"
        )
    return raw


def _png_samples(raw: bytes, w: int, h: int, depth: int, ctype: int, interlace: int) -> np.ndarray:
    """Decompressed scanlines -> samples [h, w, c] uint16 (still in the file's bit depth)."""
    c = PNG_CHANNELS[ctype]
    bpp = max(1, c * depth // 8)  # bytes per complete pixel, the filters' left neighbour distance
    buf = np.frombuffer(raw, np.uint8)
    if not interlace:
        rows = unfilter_scanlines(buf.reshape(h, 1 + _png_row_bytes(w, depth, ctype)), bpp)
        return _unpack_samples(rows, w, c, depth)
    out, pos = np.zeros((h, w, c), np.uint16), 0
    for x0, y0, dx, dy, pw, ph in _adam7_passes(w, h):
        n = ph * (1 + _png_row_bytes(pw, depth, ctype))
        rows = unfilter_scanlines(buf[pos : pos + n].reshape(ph, -1), bpp)
        out[y0::dy, x0::dx] = _unpack_samples(rows, pw, c, depth)
        pos += n
    return out


def _paeth(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))


def unfilter_scanlines(lines: np.ndarray, bpp: int) -> np.ndarray:
    """Undo the PNG filters: [h, 1 + L] (filter byte, filtered bytes) -> [h, L] uint8.

    Each byte depends on its left (a), upper (b) and upper-left (c) neighbours, so all rows advance
    together along anti-diagonals of pixels: step t reconstructs pixel x = t - y of every row y.
    """
    kinds, filtered = lines[:, 0], lines[:, 1:]
    if kinds.max(initial=0) > 4:
        raise InputError(f"PNG is corrupt: scanline filter type {int(kinds.max())} is not one of 0-4")
    h, length = filtered.shape
    u = length // bpp  # pixels (bytes for bit depths < 8) per row
    f = filtered.reshape(h, u, bpp).astype(np.int16)  # [h, u, bpp]
    out = np.zeros((h + 1, u + 1, bpp), np.int16)  # a zero row above and a zero column on the left
    for t in range(u + h - 1):
        y = np.arange(max(0, t - u + 1), min(h - 1, t) + 1)  # rows that have pixel x = t - y
        x = t - y
        a, b, c = out[y + 1, x], out[y, x + 1], out[y, x]  # [n, bpp]
        kind = kinds[y][:, None]
        pred = np.select([kind == 1, kind == 2, kind == 3, kind == 4], [a, b, (a + b) >> 1, _paeth(a, b, c)], 0)
        out[y + 1, x + 1] = (f[y, x] + pred) & 255
    return out[1:, 1:].reshape(h, length).astype(np.uint8)


def _unpack_samples(rows: np.ndarray, w: int, c: int, depth: int) -> np.ndarray:
    """Unfiltered rows [h, L] -> samples [h, w, c] uint16, big-endian / MSB-first as PNG stores them."""
    h = rows.shape[0]
    if depth == 8:
        return rows[:, : w * c].reshape(h, w, c).astype(np.uint16)
    if depth == 16:
        pairs = rows.reshape(h, w * c, 2).astype(np.uint16)
        return (pairs[..., 0] << 8 | pairs[..., 1]).reshape(h, w, c)
    bits = np.unpackbits(rows, axis=1)[:, : w * depth].reshape(h, w, depth)  # c == 1 below 8 bits
    weights = (1 << np.arange(depth - 1, -1, -1)).astype(np.uint16)
    return (bits.astype(np.uint16) @ weights)[:, :, None]


def _png_to_rgba(
    samples: np.ndarray, depth: int, ctype: int, palette: bytes, trns: bytes | None, where: str
) -> np.ndarray:
    """Samples [h, w, c] -> RGBA uint8 [h, w, 4] as Pillow's PNG modes and ``convert("RGBA")`` make them."""
    h, w, _ = samples.shape
    if ctype == 3:  # palette: Pillow pads PLTE to 256 black entries; tRNS are the first alphas
        if not palette:
            raise InputError(f"PNG {where} is corrupt: a palette image without a PLTE chunk")
        table = np.zeros((256, 4), np.uint8)
        table[:, 3] = 255
        n = min(len(palette) // 3, 256)
        table[:n, :3] = np.frombuffer(palette[: 3 * n], np.uint8).reshape(n, 3)
        if trns is not None:
            alphas = np.frombuffer(trns[:256], np.uint8)
            table[: len(alphas), 3] = alphas
        return table[samples[..., 0]]
    if ctype in (4, 6):  # alpha channel; 16-bit keeps the high byte; tRNS is ignored
        px = (samples >> 8 if depth == 16 else samples).astype(np.uint8)
        colour = np.repeat(px[..., :1], 3, axis=-1) if ctype == 4 else px[..., :3]
        return np.concatenate([colour, px[..., -1:]], axis=-1)
    key_len = 2 if ctype == 0 else 6
    if trns is not None and len(trns) < key_len:
        raise InputError(f"PNG {where} is corrupt: its tRNS chunk is truncated ({len(trns)} bytes)")
    key = None if trns is None else np.array(struct.unpack(f">{key_len // 2}H", trns[:key_len]))
    if ctype == 0:
        raw = samples[..., 0].astype(np.int64)
        if depth == 16:
            grey, seen = np.minimum(raw, 255), raw  # mode "I;16": convert clips, tRNS sees 16-bit values
        else:
            grey = raw * (255 // ((1 << depth) - 1))  # modes "1" and "L": 0..255
            seen = grey
            if key is not None and depth == 1:
                key = np.array([255 if key[0] else 0])
        colour = np.repeat(grey[..., None], 3, axis=-1)
        transparent = np.zeros((h, w), bool) if key is None else seen == key[0]
    else:  # RGB; 16-bit keeps the high byte, and the tRNS key is compared with those bytes
        colour = (samples >> 8 if depth == 16 else samples).astype(np.int64)
        transparent = np.zeros((h, w), bool) if key is None else (colour == key).all(axis=-1)
    alpha = np.where(transparent, 0, 255)[..., None]
    return np.concatenate([colour, alpha], axis=-1).astype(np.uint8)


def rgba_to_rgb(rgba: np.ndarray) -> np.ndarray:
    """[h, w, 4] uint8 -> [h, w, 3]: ``Image.alpha_composite(white, im)`` (AlphaComposite.c, 7-bit)."""
    src = rgba.astype(np.int64)
    sa, src_rgb = src[..., 3:], src[..., :3]
    dst_a, dst_rgb = 255, 255  # opaque white background
    blend = dst_a * (255 - sa)
    outa255 = sa * 255 + blend
    coef1 = sa * 255 * 255 * (1 << 7) // outa255
    coef2 = 255 * (1 << 7) - coef1
    tmp = src_rgb * coef1 + dst_rgb * coef2 + (0x80 << 7)
    out = (((tmp >> 8) + tmp) >> 8) >> 7  # SHIFTFORDIV255, then drop the 7 precision bits
    return np.where(sa == 0, dst_rgb, out).astype(np.uint8)


def decode_pnm(data: bytes, where: str = "<bytes>") -> np.ndarray:
    """Binary PGM (P5) or PPM (P6) with maxval 255 -> RGB uint8 [h, w, 3] (grey replicated)."""
    fields, pos = [], 2
    while len(fields) < 3:  # width, height, maxval; '#' comments run to the end of the line
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            end = data.find(b"\n", pos)
            pos = len(data) if end < 0 else end + 1
            continue
        start = pos
        while pos < len(data) and data[pos : pos + 1].isdigit():
            pos += 1
        if start == pos:
            raise InputError(f"PPM/PGM {where} has a malformed header; expected width, height and maxval")
        fields.append(int(data[start:pos]))
    w, h, maxval = fields
    if maxval != 255:
        raise InputError(f"PPM/PGM {where} has maxval {maxval}; only 255 (8 bits per sample) is supported")
    if w == 0 or h == 0:
        raise InputError(f"PPM/PGM {where} has zero width or height ({w}x{h}); pass a non-empty image")
    check_image_size(w, h, where)
    c = 3 if data[:2] == b"P6" else 1
    body = data[pos + 1 : pos + 1 + h * w * c]  # exactly one whitespace byte after maxval
    if len(body) < h * w * c:
        raise InputError(f"PPM/PGM {where} is truncated: {len(body)} of {h * w * c} pixel bytes")
    px = np.frombuffer(body, np.uint8).reshape(h, w, c)
    return np.repeat(px, 3 // c, axis=-1).copy()


# ----------------------------------------------------------------------------------------------
# target size


def check_soft_token_budget(max_soft_tokens: int) -> int:
    if max_soft_tokens not in SUPPORTED_SOFT_TOKENS or isinstance(max_soft_tokens, bool):
        raise InputError(
            f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS} (the budgets Gemma 4 was trained with), "
            f"got {max_soft_tokens!r}"
        )
    return int(max_soft_tokens)


def aspect_ratio_preserving_size(
    height: int, width: int, patch_size: int, max_soft_tokens: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """Largest (H', W'), multiples of k p, keeping h/w, with at most max_soft_tokens k^2 patches of p^2.

    Same float arithmetic as transformers' ``get_aspect_ratio_preserving_size``; when one side rounds
    to 0 it becomes k p and the other floor(long / short) k p, capped at max_soft_tokens k p.
    """
    height, width = positive_int(height, "height"), positive_int(width, "width")
    p, k = positive_int(patch_size, "patch_size"), positive_int(pooling_kernel_size, "pooling_kernel_size")
    max_patches = check_soft_token_budget(max_soft_tokens) * k**2
    target_px = max_patches * p**2
    factor = math.sqrt(target_px / (height * width))
    side = k * p
    th = math.floor(factor * height / side) * side
    tw = math.floor(factor * width / side) * side
    if th == 0 and tw == 0:
        raise InputError(
            f"a {height}x{width} image would be resized to 0x0: sides must be multiples of "
            f"pooling_kernel_size * patch_size = {side}; use a larger max_soft_tokens or smaller patches"
        )
    max_side = (max_patches // k**2) * side
    if th == 0:
        th, tw = side, min(math.floor(width / height) * side, max_side)
    elif tw == 0:
        th, tw = min(math.floor(height / width) * side, max_side), side
    if th * tw > target_px:
        raise InputError(f"resizing {height}x{width} to {th}x{tw} exceeds {max_patches} patches of {p}x{p}")
    return th, tw


# ----------------------------------------------------------------------------------------------
# rescale, patches, positions


def rescale(image: np.ndarray) -> np.ndarray:
    """uint8 -> float64 in [0, 1]: x / 255."""
    return image.astype(np.float64) / 255.0


def patchify(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """[H, W, C] -> [N, p * p * C]; patches row-major, each (row in patch, column in patch, channel)."""
    p = patch_size
    h, w, c = pixels.shape
    if h % p or w % p:
        raise InputError(f"image size {h}x{w} is not a multiple of patch_size {p}")
    grid = pixels.reshape(h // p, p, w // p, p, c)  # [ph, p, pw, p, C]
    return grid.transpose(0, 2, 1, 3, 4).reshape((h // p) * (w // p), p * p * c)


def patch_positions(ph: int, pw: int) -> np.ndarray:
    """int64 [ph * pw, 2] = (x = column, y = row) of each patch, row-major."""
    y, x = np.meshgrid(np.arange(ph, dtype=np.int64), np.arange(pw, dtype=np.int64), indexing="ij")
    return np.stack([x, y], axis=-1).reshape(ph * pw, 2)


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # uint8 [H', W', 3], the resized image
    pixel_values: np.ndarray  # float64 [N, 3 p^2] in [0, 1]
    positions: np.ndarray  # int64 [N, 2] = (x, y)
    num_soft_tokens: int  # N / k^2


def preprocess_image(
    image: np.ndarray, patch_size: int, pooling_kernel_size: int, max_soft_tokens: int,
    resize: Callable[[np.ndarray, int, int], np.ndarray] = resize_bicubic,
) -> ProcessedImage:
    """RGB uint8 [h, w, 3] -> the vision tower's unpadded input (module docstring). ``resize``: Pillow's rule (the
    image processor's); a video frame takes ``refimpl.resample.resize_bicubic_torch`` (the video processor's)."""
    image = check_image_array(image)
    h, w = aspect_ratio_preserving_size(image.shape[0], image.shape[1], patch_size, max_soft_tokens,
                                        pooling_kernel_size)
    pixels = image if (h, w) == image.shape[:2] else resize(image, h, w)  # [H', W', 3]
    values = patchify(rescale(pixels), patch_size)  # [N, 3 p^2]
    positions = patch_positions(h // patch_size, w // patch_size)  # [N, 2]
    return ProcessedImage(pixels, values, positions, values.shape[0] // pooling_kernel_size**2)


# ----------------------------------------------------------------------------------------------
# processor settings of a checkpoint


@dataclass(frozen=True)
class ImageProcessorSettings:
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int


PROCESSOR_FILES = (("processor_config.json", "image_processor"), ("preprocessor_config.json", None))


def load_image_processor_settings(model_dir: str | Path, vision_cfg: VisionConfig) -> ImageProcessorSettings:
    """processor_config.json ("image_processor") or preprocessor_config.json, else the vision config + 280."""
    for name, key in PROCESSOR_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            return _settings_from_file(path, key, vision_cfg)
    return ImageProcessorSettings(vision_cfg.patch_size, vision_cfg.pooling_kernel_size, DEFAULT_MAX_SOFT_TOKENS)


def _settings_from_file(path: Path, key: str | None, vision_cfg: VisionConfig) -> ImageProcessorSettings:
    raw = read_json(path)
    if key is not None and isinstance(raw, dict):
        raw = raw.get(key, {})
    where = f"{path}" + (f" ['{key}']" if key else "")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    defaults = {
        "patch_size": vision_cfg.patch_size,
        "pooling_kernel_size": vision_cfg.pooling_kernel_size,
        "max_soft_tokens": DEFAULT_MAX_SOFT_TOKENS,
    }
    values = {}
    for field, default in defaults.items():
        value = raw.get(field, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{where}: '{field}' must be a positive integer, got {value!r}")
        values[field] = value
    for field in ("patch_size", "pooling_kernel_size"):
        if values[field] != defaults[field]:
            raise ConfigError(
                f"{where}: '{field}' is {values[field]} but config.json's vision_config has {defaults[field]}; "
                "the processor and the vision tower must agree, fix one of the files"
            )
    if values["max_soft_tokens"] not in SUPPORTED_SOFT_TOKENS:
        raise ConfigError(
            f"{where}: 'max_soft_tokens' must be one of {SUPPORTED_SOFT_TOKENS}, got {values['max_soft_tokens']}"
        )
    return ImageProcessorSettings(**values)
