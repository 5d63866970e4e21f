"""refimpl.image against Pillow and transformers' Gemma4ImageProcessorPil (bit-exact where stated).

PNGs that Pillow cannot write (2/4-bit grey, 16-bit RGB/RGBA/LA, Adam7, every filter type, colour keys)
come from the small encoder below; Pillow decodes them independently, so the comparison is still
between two decoders.
"""

from __future__ import annotations

import json
import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.errors import ConfigError, InputError
from refimpl.image import (
    SUPPORTED_SOFT_TOKENS,
    ImageProcessorSettings,
    aspect_ratio_preserving_size,
    load_image_processor_settings,
    patch_positions,
    patchify,
    preprocess_image,
    read_image,
    rescale,
    resize_bicubic,
)

# ----------------------------------------------------------------------------------------------
# a minimal PNG encoder (every filter type, Adam7, any colour type / depth)

ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _pack_rows(samples: np.ndarray, depth: int) -> np.ndarray:
    h = samples.shape[0]
    flat = samples.reshape(h, -1).astype(np.uint32)
    if depth == 16:
        return flat.astype(">u2").view(np.uint8).reshape(h, -1)
    if depth == 8:
        return flat.astype(np.uint8)
    bits = ((flat[:, :, None] >> np.arange(depth - 1, -1, -1)) & 1).astype(np.uint8).reshape(h, -1)
    return np.packbits(bits, axis=1)


def _filter_rows(rows: np.ndarray, bpp: int, filters) -> bytes:
    out, prev = [], np.zeros(rows.shape[1], np.int64)
    for y, row in enumerate(rows.astype(np.int64)):
        f = filters[y % len(filters)]
        a = np.concatenate([np.zeros(bpp, np.int64), row])[: len(row)]
        c = np.concatenate([np.zeros(bpp, np.int64), prev])[: len(row)]
        p = a + prev - c
        pa, pb, pc = abs(p - a), abs(p - prev), abs(p - c)
        paeth = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, prev, c))
        pred = [0 * row, a, prev, (a + prev) // 2, paeth][f]
        out.append(bytes([f]) + ((row - pred) % 256).astype(np.uint8).tobytes())
        prev = row
    return b"".join(out)


def encode_png(samples, ctype, depth, palette=None, trns=None, interlace=False, filters=(0, 1, 2, 3, 4)):
    samples = np.asarray(samples)
    samples = samples[:, :, None] if samples.ndim == 2 else samples
    h, w, c = samples.shape
    bpp = max(1, c * depth // 8)
    if interlace:
        subs = [samples[y0::dy, x0::dx] for x0, y0, dx, dy in ADAM7]
        raw = b"".join(_filter_rows(_pack_rows(s, depth), bpp, filters) for s in subs if s.size)
    else:
        raw = _filter_rows(_pack_rows(samples, depth), bpp, filters)
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, ctype, 0, 0, int(interlace)))
    if palette is not None:
        out += _chunk(b"PLTE", np.asarray(palette, np.uint8).tobytes())
    if trns is not None:
        out += _chunk(b"tRNS", trns)
    z = zlib.compress(raw)
    return out + _chunk(b"IDAT", z[: len(z) // 2]) + _chunk(b"IDAT", z[len(z) // 2 :]) + _chunk(b"IEND", b"")


def pil_reference(path) -> np.ndarray:
    """What Gemma4ImageProcessorPil sees: convert_to_rgb(PIL.Image.open(path))."""
    Image = pytest.importorskip("PIL.Image")
    pytest.importorskip("transformers")
    from transformers.image_transforms import convert_to_rgb

    with Image.open(path) as im:
        return convert_to_rgb(im, return_numpy=True)


# ----------------------------------------------------------------------------------------------
# read_image


def _random_png_cases(rng):
    """(name, png bytes) for every colour type / depth / tRNS variant the reader supports."""
    size = (13, 17)
    cases = []
    for depth in (1, 2, 4, 8, 16):
        g = rng.integers(0, 2**depth, size)
        cases.append((f"grey{depth}", encode_png(g, 0, depth)))
        key = 0 if depth < 8 else int(g[3, 4])  # only key 0 can match an expanded low-depth grey
        cases.append((f"grey{depth}-trns", encode_png(g, 0, depth, trns=struct.pack(">H", key))))
        cases.append((f"grey{depth}-trns-nomatch", encode_png(g, 0, depth, trns=struct.pack(">H", 1))))
        cases.append((f"grey{depth}-adam7", encode_png(g, 0, depth, interlace=True)))
    for depth in (8, 16):
        for ctype in (2, 4, 6):
            s = rng.integers(0, 2**depth, (*size, CHANNELS[ctype]))
            if ctype in (4, 6):  # alpha incl. fully transparent and fully opaque pixels
                s[0, :, -1], s[1, :, -1] = 0, 2**depth - 1
            cases.append((f"ct{ctype}-{depth}", encode_png(s, ctype, depth)))
            cases.append((f"ct{ctype}-{depth}-adam7", encode_png(s, ctype, depth, interlace=True)))
        s = rng.integers(0, 2**depth, (*size, 3))
        key = s[2, 5] if depth == 8 else s[2, 5] >> 8  # Pillow compares a 16-bit key with the high bytes
        cases.append((f"rgb{depth}-trns", encode_png(s, 2, depth, trns=struct.pack(">HHH", *map(int, key)))))
    for depth in (1, 2, 4, 8):
        n = min(2**depth, 200)
        pal = rng.integers(0, 256, (n, 3))
        idx = rng.integers(0, 2**depth, size)
        cases.append((f"pal{depth}", encode_png(idx, 3, depth, palette=pal)))
        alphas = rng.integers(0, 256, n // 2 + 1).astype(np.uint8)
        alphas[0] = 0
        cases.append((f"pal{depth}-alpha", encode_png(idx, 3, depth, palette=pal, trns=alphas.tobytes())))
        cases.append((f"pal{depth}-key", encode_png(idx, 3, depth, palette=pal, trns=b"\xff\x00")))
        cases.append((f"pal{depth}-adam7", encode_png(idx, 3, depth, palette=pal, interlace=True)))
    one = rng.integers(0, 256, (1, 1, 3))
    cases.append(("rgb-1x1-adam7", encode_png(one, 2, 8, interlace=True)))
    return cases


def test_read_png_matches_pillow_convert_to_rgb(tmp_path):
    rng = np.random.default_rng(0)
    for name, data in _random_png_cases(rng):
        path = tmp_path / f"{name}.png"
        path.write_bytes(data)
        ours, ref = read_image(path), pil_reference(path)
        assert ours.dtype == np.uint8 and ours.shape == ref.shape, name
        np.testing.assert_array_equal(ours, ref, err_msg=name)


def test_read_png_written_by_pillow(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (21, 34, 4), dtype=np.uint8)
    rgba[0, :, 3], rgba[1, :, 3] = 0, 255
    images = {
        "RGB": Image.fromarray(rgba[..., :3]),
        "RGBA": Image.fromarray(rgba, "RGBA"),
        "L": Image.fromarray(rgba[..., 0]),
        "LA": Image.fromarray(rgba[..., ::3].copy(), "LA"),
        "1": Image.fromarray(rgba[..., 0] > 127),
        "I;16": Image.fromarray(rng.integers(0, 400, (21, 34)).astype(np.uint16)),
        "P": Image.fromarray(rgba[..., :3]).quantize(37),
    }
    for mode, im in images.items():
        path = tmp_path / f"{mode.replace(';', '')}.png"
        im.save(path)
        np.testing.assert_array_equal(read_image(path), pil_reference(path), err_msg=mode)
    p = images["P"]
    p.save(tmp_path / "ptrans.png", transparency=5)
    p.save(tmp_path / "ptrans-bytes.png", transparency=bytes(range(0, 256, 7)))
    images["L"].save(tmp_path / "ltrans.png", transparency=int(rgba[0, 0, 0]))
    images["RGB"].save(tmp_path / "rgbtrans.png", transparency=tuple(int(v) for v in rgba[3, 3, :3]))
    for name in ("ptrans", "ptrans-bytes", "ltrans", "rgbtrans"):
        path = tmp_path / f"{name}.png"
        np.testing.assert_array_equal(read_image(path), pil_reference(path), err_msg=name)


def test_read_ppm_pgm(tmp_path):
    rng = np.random.default_rng(2)
    rgb = rng.integers(0, 256, (7, 9, 3), dtype=np.uint8)
    (tmp_path / "a.ppm").write_bytes(b"P6\n# a comment\n9 7\n255\n" + rgb.tobytes())
    (tmp_path / "a.pgm").write_bytes(b"P5 9 7 255 " + rgb[..., 0].tobytes())
    np.testing.assert_array_equal(read_image(tmp_path / "a.ppm"), rgb)
    np.testing.assert_array_equal(read_image(tmp_path / "a.pgm"), np.repeat(rgb[..., :1], 3, axis=-1))
    pytest.importorskip("PIL")
    for name in ("a.ppm", "a.pgm"):
        np.testing.assert_array_equal(read_image(tmp_path / name), pil_reference(tmp_path / name))


def test_read_jpeg_through_pillow(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    rgb = np.random.default_rng(3).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.jpg", quality=90)
    np.testing.assert_array_equal(read_image(tmp_path / "a.jpg"), pil_reference(tmp_path / "a.jpg"))


def test_read_errors(tmp_path):
    with pytest.raises(InputError, match=r"image file .*nope\.png does not exist; check the path"):
        read_image(tmp_path / "nope.png")
    (tmp_path / "text.png").write_bytes(b"hello, this is not an image at all")
    with pytest.raises(InputError, match=r"text\.png is not a recognised image \(it starts with b'hello, t'\)"):
        read_image(tmp_path / "text.png")
    good = encode_png(np.zeros((40, 40, 3), np.uint8) + 7, 2, 8)
    idat = good.index(b"IDAT")
    (tmp_path / "cut.png").write_bytes(good[: idat + 10])
    with pytest.raises(InputError, match=r"PNG .*cut\.png is truncated"):
        read_image(tmp_path / "cut.png")
    # a well-formed file whose zlib stream stops early
    raw = zlib.compress(b"\x00" + b"\x07" * 120)[:-8]
    short = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", 40, 40, 8, 2, 0, 0, 0))
        + _chunk(b"IDAT", raw)
        + _chunk(b"IEND", b"")
    )
    (tmp_path / "short.png").write_bytes(short)
    with pytest.raises(InputError, match=r"PNG .*short\.png is truncated: its image data holds \d+ of 4840 bytes"):
        read_image(tmp_path / "short.png")
    empty = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0))
    (tmp_path / "empty.png").write_bytes(empty + _chunk(b"IEND", b""))
    with pytest.raises(InputError, match=r"has zero width or height \(0x5\)"):
        read_image(tmp_path / "empty.png")
    bad_crc = bytearray(good)
    bad_crc[idat + 6] ^= 0xFF
    (tmp_path / "crc.png").write_bytes(bytes(bad_crc))
    with pytest.raises(InputError, match=r"bad CRC in the b'IDAT' chunk"):
        read_image(tmp_path / "crc.png")


# ----------------------------------------------------------------------------------------------
# sizes, resize, patches


@settings(max_examples=examples(300), deadline=None)
@given(
    h=st.integers(1, 5000),
    w=st.integers(1, 5000),
    budget=st.sampled_from(SUPPORTED_SOFT_TOKENS),
    p=st.sampled_from([4, 14, 16]),
    k=st.sampled_from([1, 2, 3]),
)
def test_aspect_ratio_rule_matches_transformers(h, w, budget, p, k):
    g4 = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
    try:
        ref = g4.get_aspect_ratio_preserving_size(h, w, p, budget * k * k, k)
    except ValueError:
        with pytest.raises(InputError):
            aspect_ratio_preserving_size(h, w, p, budget, k)
        return
    assert aspect_ratio_preserving_size(h, w, p, budget, k) == ref


def test_aspect_ratio_rule_worked_examples():
    # gemma4-multimodal-spec.md section 3
    for (h, w), out in {(224, 224): (768, 768), (768, 768): (768, 768), (480, 640): (672, 912),
                        (1080, 1920): (576, 1056)}.items():
        assert aspect_ratio_preserving_size(h, w, 16, 280, 3) == out
    for budget, side in {70: 384, 140: 528, 560: 1104, 1120: 1584}.items():
        assert aspect_ratio_preserving_size(1024, 1024, 16, budget, 3) == (side, side)
    assert aspect_ratio_preserving_size(1, 5000, 16, 280, 3) == (48, 280 * 48)  # one side rounds to 0
    assert aspect_ratio_preserving_size(300, 2, 16, 70, 3) == (70 * 48, 48)


def test_aspect_ratio_rule_errors():
    with pytest.raises(InputError, match=r"max_soft_tokens must be one of \(70, 140, 280, 560, 1120\).*got 100"):
        aspect_ratio_preserving_size(100, 100, 16, 100, 3)
    with pytest.raises(InputError, match=r"height must be a positive integer, got 0"):
        aspect_ratio_preserving_size(0, 100, 16, 280, 3)


@settings(max_examples=examples(150), deadline=None)
@given(
    h=st.integers(1, 70), w=st.integers(1, 70), oh=st.integers(1, 70), ow=st.integers(1, 70),
    seed=st.integers(0, 2**32 - 1)
)
def test_resize_bicubic_bit_exact_with_pillow(h, w, oh, ow, seed):
    Image = pytest.importorskip("PIL.Image")
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ref = np.asarray(Image.fromarray(img).resize((ow, oh), Image.BICUBIC))
    np.testing.assert_array_equal(resize_bicubic(img, oh, ow), ref)


def test_resize_bicubic_large_factors_and_pass_order():
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(4)
    # big downscale (wide kernels), big upscale, and both pass orders of ImagingResampleInner
    for (h, w), (oh, ow) in [((600, 450), (48, 96)), ((9, 5), (400, 300)), ((300, 40), (20, 35)),
                             ((40, 300), (35, 20)), ((1, 1), (7, 3)), ((5, 1), (1, 9))]:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ref = np.asarray(Image.fromarray(img).resize((ow, oh), Image.BICUBIC))
        np.testing.assert_array_equal(resize_bicubic(img, oh, ow), ref, err_msg=f"{h}x{w}->{oh}x{ow}")
    img = rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)
    np.testing.assert_array_equal(resize_bicubic(img, 5, 6), img)


def test_patchify_and_positions_layout():
    p = 2
    pixels = np.arange(4 * 6 * 3).reshape(4, 6, 3)
    patches = patchify(pixels, p)
    assert patches.shape == (6, 12)
    # patch (row 1, col 2): rows 2-3, columns 4-5, (row, col, channel) with channel fastest
    np.testing.assert_array_equal(patches[1 * 3 + 2], pixels[2:4, 4:6].reshape(-1))
    np.testing.assert_array_equal(patch_positions(2, 3), [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]])
    assert patch_positions(2, 3).dtype == np.int64


def test_rescale_is_exact_and_rounds_like_transformers():
    x = np.arange(256, dtype=np.uint8)
    ours = rescale(x)
    assert ours.dtype == np.float64 and np.array_equal(ours, x.astype(np.float64) / 255.0)
    # transformers multiplies by 1/255 in float64 and casts to float32: identical float32 values
    np.testing.assert_array_equal(ours.astype(np.float32), (x.astype(np.float64) * (1 / 255)).astype(np.float32))


# ----------------------------------------------------------------------------------------------
# the whole preprocessing against Gemma4ImageProcessorPil

PROCESSOR_CASES = [
    # (h, w, patch, kernel, budget)
    (36, 48, 4, 3, 70),  # fixed point: 9 x 12 patches = 108 <= 630, sides multiples of 12 -> no resize
    (5, 7, 4, 3, 70),  # small image, upscaled
    (400, 300, 4, 3, 70),  # large image, downscaled
    (2, 300, 4, 3, 70),  # height rounds to 0
    (500, 3, 4, 3, 70),  # width rounds to 0
    (61, 113, 4, 3, 70),  # non-square
    (37, 23, 4, 2, 140),
    (480, 640, 16, 3, 280),  # the shipped default
    (768, 768, 16, 3, 280),  # its fixed point
]


@pytest.mark.parametrize("h,w,p,k,budget", PROCESSOR_CASES)
def test_preprocess_matches_gemma4_image_processor_pil(h, w, p, k, budget):
    Image = pytest.importorskip("PIL.Image")
    g4 = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
    img = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    proc = g4.Gemma4ImageProcessorPil(patch_size=p, pooling_kernel_size=k, max_soft_tokens=budget)
    ref = proc(images=Image.fromarray(img), return_tensors="np")
    ours = preprocess_image(img, patch_size=p, pooling_kernel_size=k, max_soft_tokens=budget)

    n = ours.pixel_values.shape[0]
    assert ours.num_soft_tokens == int(np.asarray(ref["num_soft_tokens_per_image"])[0]) == n // k**2
    assert ours.pixels.shape[:2] == aspect_ratio_preserving_size(h, w, p, budget, k)
    np.testing.assert_array_equal(ours.positions, ref["image_position_ids"][0, :n])
    assert (ref["image_position_ids"][0, n:] == -1).all()
    # the processor rescales in float64 and casts to float32: our float64 values cast to float32 are equal
    theirs = ref["pixel_values"][0]
    assert theirs.dtype == np.float32 and ours.pixel_values.dtype == np.float64
    np.testing.assert_array_equal(ours.pixel_values.astype(np.float32), theirs[:n])
    assert (theirs[n:] == 0).all()


def test_preprocess_input_validation():
    with pytest.raises(InputError, match=r"the image must have dtype uint8 \(values 0\.\.255\), got float64"):
        preprocess_image(np.zeros((4, 4, 3)), 4, 3, 70)
    with pytest.raises(InputError, match=r"the image must have shape \[height, width, 3\] \(RGB\), got \[4, 4\]"):
        preprocess_image(np.zeros((4, 4), np.uint8), 4, 3, 70)
    with pytest.raises(InputError, match=r"max_soft_tokens must be one of \(70, 140, 280, 560, 1120\)"):
        preprocess_image(np.zeros((4, 4, 3), np.uint8), 4, 3, 71)


# ----------------------------------------------------------------------------------------------
# settings


def test_load_image_processor_settings(tmp_path):
    vision = SimpleNamespace(patch_size=16, pooling_kernel_size=3)
    assert load_image_processor_settings(tmp_path, vision) == ImageProcessorSettings(16, 3, 280)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 560, "patch_size": 16}))
    assert load_image_processor_settings(tmp_path, vision) == ImageProcessorSettings(16, 3, 560)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 1120}}))
    assert load_image_processor_settings(tmp_path, vision) == ImageProcessorSettings(16, 3, 1120)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"patch_size": 14}}))
    with pytest.raises(ConfigError, match=r"'patch_size' is 14 but config\.json's vision_config has 16"):
        load_image_processor_settings(tmp_path, vision)
    (tmp_path / "processor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"processor_config\.json: not valid JSON"):
        load_image_processor_settings(tmp_path, vision)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 100}}))
    with pytest.raises(ConfigError, match=r"'max_soft_tokens' must be one of"):
        load_image_processor_settings(tmp_path, vision)


def test_other_formats_without_pillow(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import ...` now raises ImportError
    (tmp_path / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(20))
    with pytest.raises(InputError, match=r"a\.jpg is a JPEG file; PNG and binary PPM/PGM .* `pip install pillow`"):
        read_image(tmp_path / "a.jpg")
    (tmp_path / "b.bin").write_bytes(b"garbage!" * 3)
    with pytest.raises(InputError, match=r"b\.bin is not a recognised image \(it starts with b'garbage!'\)"):
        read_image(tmp_path / "b.bin")
