"""refimpl.audio_features against transformers' Gemma4AudioFeatureExtractor / Gemma4Processor and against
WAV files written with the standard library's ``wave``.

Two comparisons with transformers:
* float64: transformers' own ``_extract_spectrogram`` run on a float64 waveform with a float64 window
  (the public ``__call__`` casts both to float32). The only difference left is how the Hann window is
  written (1/2 - 1/2 cos(2 pi i / f) here, ``np.hanning(f + 1)[:-1]`` there, <= 4e-16 apart): with
  transformers' window substituted the features are bit-identical; with ours, within twice the float64
  rounding bound (measured worst 1.3e-11 with the defaults, at bins where mel ~ mel_floor).
* float32: the public ``__call__``. The waveforms are float32-exact, so the only differences come from
  transformers' float32 window, frames, FFT and magnitude, and its final float32 cast. ``float32_bound``
  turns those roundings into a per-element bound (derivation in its docstring) that every element must
  meet; masks and soft-token counts must be equal exactly.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from refimpl.audio_features import (
    AudioFeatureSettings,
    audio_features,
    audio_soft_token_count,
    frame,
    load_audio_feature_settings,
    mel_filter_bank,
    periodic_hann,
    preemphasize,
    read_wav,
    semicausal_pad,
    truncate_and_pad,
)
from refimpl.errors import ConfigError, InputError

U32 = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64 unit roundoff
SR = 16_000

# ----------------------------------------------------------------------------------------------
# waveforms (float32-exact, so transformers' float64 -> float32 cast of the input loses nothing)


def noise(n: int, seed: int = 0, scale: float = 0.3) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n) * scale
    return np.clip(x, -1, 1).astype(np.float32).astype(np.float64)


def chirp(n: int, f0: float = 50.0, f1: float = 7900.0) -> np.ndarray:
    t = np.arange(n) / SR
    duration = max(n / SR, 1e-9)
    x = 0.8 * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * duration)))
    return x.astype(np.float32).astype(np.float64)


def silence(n: int) -> np.ndarray:
    return np.zeros(n)


# (name, waveform): 16000 and 12800 are multiples of 128 (12800 of the hop too), 16080 and 16160 are
# not multiples of 128 (16160 is one of the hop), 100 is shorter than one frame, 161 is the shortest
# audio with a valid frame, 80000 is 5 s.
WAVEFORMS = [
    ("noise-16000", noise(16_000)),
    ("noise-16001", noise(16_001, seed=1)),
    ("noise-12800", noise(12_800, seed=2, scale=0.05)),
    ("chirp-16160", chirp(16_160)),
    ("chirp-16080", chirp(16_080, 300.0, 3000.0)),
    ("silence-16000", silence(16_000)),
    ("silence-then-tone-3333", np.concatenate([silence(2000), chirp(1333, 1000, 1000)])),
    ("short-100", noise(100, seed=3)),
    ("short-161", noise(161, seed=4)),
    ("short-1", noise(1, seed=5)),
    ("noise-80000", noise(80_000, seed=6)),
]
NON_DEFAULT = [
    AudioFeatureSettings(fft_overdrive=True, preemphasis=0.97, mel_floor=1e-5,
                         per_bin_mean=tuple(np.linspace(-3, 1, 128)),
                         per_bin_stddev=tuple(np.linspace(0.5, 2, 128))),
    AudioFeatureSettings(feature_size=64, frame_length_ms=25.0, hop_length_ms=12.5, min_frequency=125.0,
                         max_frequency=7600.0, preemphasis=0.5, preemphasis_htk_flavor=False,
                         input_scale_factor=2.0),
]

# ----------------------------------------------------------------------------------------------
# transformers side


def hf_extractor(settings: AudioFeatureSettings):
    fe_module = pytest.importorskip("transformers.models.gemma4.feature_extraction_gemma4")
    kwargs = dataclasses.asdict(settings)
    for key in ("max_length", "pad_to_multiple_of", "audio_seq_length"):
        kwargs.pop(key)
    return fe_module.Gemma4AudioFeatureExtractor(**kwargs)


def hf_float32(settings: AudioFeatureSettings, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The public path, as Gemma4Processor calls it (a list of clips)."""
    out = hf_extractor(settings)([x], return_tensors="np")
    return out["input_features"][0], out["input_features_mask"][0]


def hf_float64(settings: AudioFeatureSettings, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' spectrogram code in float64: its padding (to 128, after truncation) redone here in
    float64, its window replaced by the same window in float64, then its own ``_extract_spectrogram``."""
    from transformers.audio_utils import window_function

    fe = hf_extractor(settings)
    fe.window = window_function(fe.frame_length)  # float64 instead of .astype(np.float32)
    x = x[: settings.max_length]
    n_padded = -(-len(x) // 128) * 128
    waveform = np.pad(x, (0, n_padded - len(x)))[None, :]  # [1, n'] float64
    mask = np.pad(np.ones(len(x), dtype=np.int32), (0, n_padded - len(x)))
    features, frame_mask = fe._extract_spectrogram(waveform, mask)
    return features * frame_mask[:, None], frame_mask


def rounding_bound(settings: AudioFeatureSettings, x: np.ndarray, u: float = U32) -> np.ndarray:
    """[T, M] bound on |exact features - features computed with unit roundoff u| for input x that is
    exact in that precision (u = 2^-24: transformers' float32 path; u = 2^-53: any float64 path).

    With y = frame * window (float64), transformers' spectrum bin X_k picks up
    * at most 2.01 u ||y||_1 from rounding the window and the product frame * window,
    * at most 2 u log2(N) sqrt(N) ||y||_2 from the FFT (normwise bound c u log2 N ||X||_2 with
      c = 2 and Parseval ||X||_2 <= sqrt(N) ||y||_2, applied to each bin),
    * u |X_k| from rounding |X_k|.
    The mel sum (float64) turns these into d_m = sum_k W_km dX_k; log is 1/(mel+floor)-Lipschitz above,
    so |d log| <= d_m / (mel_m + floor - d_m); per-bin stddev divides it. Finally the cast of the
    output (float32 in transformers) adds u |feature|. Preemphasis and input scaling happen on float32 values too: the
    frame
    entries' own rounding is covered by the 2.01 u ||y||_1 term with 3 u instead of 2.01 u.
    The float64 comparison allows twice the u = 2^-53 bound, one for each side.
    """
    s = settings
    xs, real = truncate_and_pad(x, s)
    xs, real = semicausal_pad(xs * s.input_scale_factor, real, s.frame_length)
    y = preemphasize(frame(xs, s.frame_length + 1, s.hop_length), s.preemphasis, s.preemphasis_htk_flavor)
    y = y * periodic_hann(s.frame_length)  # [T, f]
    n = s.fft_length
    spectrum = np.abs(np.fft.rfft(y, n=n, axis=-1))  # [T, K]
    per_bin = (3.01 * u * np.abs(y).sum(1) + 2 * u * np.log2(n) * np.sqrt(n) * np.sqrt((y**2).sum(1)))
    d_spec = per_bin[:, None] + u * spectrum  # [T, K]
    filters = mel_filter_bank(n // 2 + 1, s.feature_size, s.min_frequency, s.max_frequency, s.sampling_rate)
    mel = spectrum @ filters  # [T, M]
    d_mel = d_spec @ filters
    d_log = d_mel / np.maximum(mel + s.mel_floor - d_mel, 1e-300)
    if s.per_bin_stddev is not None:
        d_log = d_log / np.abs(np.asarray(s.per_bin_stddev))[None, :]
    ours = audio_features(x, s.sampling_rate, s).features
    return d_log + u * np.abs(ours) + 1e-300


# ----------------------------------------------------------------------------------------------
# agreement with transformers


@pytest.mark.parametrize("settings", [AudioFeatureSettings()] + NON_DEFAULT, ids=["default", "nd1", "nd2"])
def test_float64_agreement(settings):
    for name, x in WAVEFORMS:
        ours = audio_features(x, SR, settings)
        theirs, mask = hf_float64(settings, x)
        assert ours.features.shape == theirs.shape, name
        assert np.array_equal(ours.mask, mask), name
        assert (np.abs(ours.features - theirs) <= 2 * rounding_bound(settings, x, U64)).all(), name


def test_float64_bit_identical_with_transformers_window(monkeypatch):
    audio_utils = pytest.importorskip("transformers.audio_utils")
    import refimpl.audio_features as module

    monkeypatch.setattr(module, "periodic_hann", audio_utils.window_function)
    for settings in [AudioFeatureSettings()] + NON_DEFAULT:
        for name, x in WAVEFORMS:
            theirs, _ = hf_float64(settings, x)
            assert np.array_equal(module.audio_features(x, SR, settings).features, theirs), name


@pytest.mark.parametrize("settings", [AudioFeatureSettings()] + NON_DEFAULT, ids=["default", "nd1", "nd2"])
def test_float32_agreement_within_rounding_bound(settings):
    for name, x in WAVEFORMS:
        ours = audio_features(x, SR, settings)
        theirs, mask = hf_float32(settings, x)
        assert theirs.dtype == np.float32
        assert ours.features.shape == theirs.shape, name
        assert np.array_equal(ours.mask, mask), name
        assert np.array_equal(ours.features[~mask], theirs[~mask]), name  # zeroed frames: 0.0 both
        diff = np.abs(ours.features - theirs.astype(np.float64))
        bound = rounding_bound(settings, x)
        worst = np.unravel_index(np.argmax(diff / bound), diff.shape) if diff.size else None
        assert (diff <= bound).all(), (name, worst, diff[worst], bound[worst])


def test_truncation_at_30_seconds_and_token_cap():
    x = noise(500_000, seed=7)
    ours = audio_features(x, SR, AudioFeatureSettings())
    theirs, mask = hf_float32(AudioFeatureSettings(), x)
    assert ours.features.shape == theirs.shape == (2999, 128)
    assert np.array_equal(ours.mask, mask) and mask.all()
    assert (np.abs(ours.features - theirs) <= rounding_bound(AudioFeatureSettings(), x)).all()
    # the first 480 000 samples alone give the same features: the rest is dropped
    assert np.array_equal(audio_features(x[:480_000], SR).features, ours.features)
    assert audio_soft_token_count(ours.mask) == 750


def test_soft_token_count_matches_processor():
    processing = pytest.importorskip("transformers.models.gemma4.processing_gemma4")
    proc = processing.Gemma4Processor
    fe = hf_extractor(AudioFeatureSettings())
    fake = SimpleNamespace(boa_token="<", audio_token="A", eoa_token=">", feature_extractor=fe,
                           audio_seq_length=750)
    lengths = [1, 100, 160, 161, 320, 321, 481, 640, 1000, 15_999, 16_000, 16_001, 16_160, 33_333, 80_000]
    for n in lengths:
        mask = audio_features(noise(n, seed=n), SR).mask
        count = audio_soft_token_count(mask)
        text = proc.replace_audio_token(fake, {"input_features_mask": [mask]}, 0)
        assert count == text.count("A"), n
        assert count == proc._compute_audio_num_tokens(fake, np.zeros(n), SR), n
    assert audio_soft_token_count(audio_features(noise(16_000), SR).mask) == 25  # spec: 1 s -> 25 tokens
    # masks as the processor builds them for a shorter clip in a padded batch (trailing invalid frames)
    batch = hf_extractor(AudioFeatureSettings())([noise(20_000), noise(5_000)], return_tensors="np")
    short_mask = batch["input_features_mask"][1]
    assert audio_soft_token_count(short_mask) == proc.replace_audio_token(fake, batch, 1).count("A")
    assert audio_soft_token_count(short_mask) == audio_soft_token_count(audio_features(noise(5_000), SR).mask)
    assert audio_soft_token_count(np.ones(4000, bool)) == 750
    assert audio_soft_token_count(np.ones(4000, bool), max_tokens=None) == 1000


def test_mel_filters_and_window_match_transformers():
    audio_utils = pytest.importorskip("transformers.audio_utils")
    for s in [AudioFeatureSettings()] + NON_DEFAULT:
        fe = hf_extractor(s)
        ours = mel_filter_bank(s.fft_length // 2 + 1, s.feature_size, s.min_frequency, s.max_frequency,
                               s.sampling_rate)
        assert np.abs(ours - fe.mel_filters).max() <= 1e-15
        assert (s.frame_length, s.hop_length, s.fft_length) == (fe.frame_length, fe.hop_length, fe.fft_length)
        assert np.abs(periodic_hann(s.frame_length) - audio_utils.window_function(s.frame_length)).max() < 1e-15


# ----------------------------------------------------------------------------------------------
# read_wav


def write_wav(path: Path, ints: np.ndarray, width: int, rate: int = SR) -> None:
    """ints [n, channels] as PCM with ``wave`` (8-bit: unsigned 0..255, else signed)."""
    channels = ints.shape[1]
    if width == 1:
        raw = ints.astype(np.uint8).tobytes()
    elif width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints.reshape(-1))
    else:
        raw = ints.astype(f"<i{width}").tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


def stdlib_read(path: Path) -> tuple[np.ndarray, int]:
    """The same file through ``wave`` and NumPy: left-justify every sample in 32 bits, divide by 2^31."""
    with wave.open(str(path), "rb") as w:
        width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
        raw = np.frombuffer(w.readframes(w.getnframes()), dtype=np.uint8).reshape(-1, width)
    if width == 1:
        raw = raw ^ 0x80  # unsigned -> two's complement
    left = np.zeros((raw.shape[0], 4), dtype=np.uint8)
    left[:, 4 - width:] = raw
    values = left.view("<i4")[:, 0].astype(np.float64) / 2.0**31
    return values.reshape(-1, channels).mean(axis=1), rate


def float_wav_bytes(samples: np.ndarray, rate: int, channels: int = 1, tag: int = 3, bits: int = 32) -> bytes:
    body = samples.astype("<f4").tobytes()
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(body)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(body)) + body)


@pytest.mark.parametrize("width,channels", [(2, 1), (2, 2), (1, 1), (3, 1), (3, 2), (4, 1), (1, 3)])
def test_read_wav_matches_stdlib(tmp_path, width, channels):
    bits = 8 * width
    rng = np.random.default_rng(width * 10 + channels)
    lo, hi = (0, 256) if width == 1 else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    ints = rng.integers(lo, hi, size=(1000, channels), dtype=np.int64)
    ints[:3] = np.array([lo, hi - 1, (lo + hi) // 2])[:, None]  # the extremes and silence
    path = tmp_path / "a.wav"
    write_wav(path, ints, width, rate=22_050)
    samples, rate = read_wav(path)
    expected, expected_rate = stdlib_read(path)
    assert rate == expected_rate == 22_050
    assert samples.dtype == np.float64 and samples.shape == (1000,)
    assert np.abs(samples - expected).max() <= 1e-15
    assert samples.min() >= -1.0 and samples.max() < 1.0
    if channels == 1:  # exact scale: x / 2^(bits-1), 8-bit (x - 128) / 128
        offset = 128 if width == 1 else 0
        assert np.array_equal(samples, (ints[:, 0] - offset) / 2.0 ** (bits - 1))


def test_read_wav_float32_and_extensible(tmp_path):
    x = noise(777, seed=9)
    (tmp_path / "f.wav").write_bytes(float_wav_bytes(x, SR))
    samples, rate = read_wav(tmp_path / "f.wav")
    assert rate == SR and np.array_equal(samples, x)
    # WAVE_FORMAT_EXTENSIBLE with the PCM sub-format, 16-bit stereo
    ints = np.array([[1, -3], [32767, -32768], [0, 2]], dtype="<i2")
    body = ints.tobytes()
    fmt = struct.pack("<HHIIHHHHI", 0xFFFE, 2, SR, SR * 4, 4, 16, 22, 16, 3) + struct.pack("<H", 1) + bytes(14)
    data = (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(body)) + b"WAVE" + b"fmt "
            + struct.pack("<I", len(fmt)) + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\x00"
            + b"data" + struct.pack("<I", len(body)) + body)
    (tmp_path / "e.wav").write_bytes(data)
    samples, rate = read_wav(tmp_path / "e.wav")
    assert rate == SR and np.array_equal(samples, ints.mean(axis=1) / 32768.0)


def test_read_wav_then_features(tmp_path):
    x = noise(4000, seed=11)
    ints = np.round(x * 32767).astype(np.int64)[:, None]
    write_wav(tmp_path / "a.wav", ints, 2)
    samples, rate = read_wav(tmp_path / "a.wav")
    assert np.array_equal(audio_features(samples, rate).features, audio_features(ints[:, 0] / 32768.0, SR).features)


def test_read_wav_errors(tmp_path):
    missing = tmp_path / "nope.wav"
    with pytest.raises(InputError) as e:
        read_wav(missing)
    assert str(e.value) == f"audio file {missing} does not exist; check the path"

    text = tmp_path / "notes.wav"
    text.write_text("hello, this is not audio")
    with pytest.raises(InputError) as e:
        read_wav(text)
    assert str(e.value) == (
        f"{text} is not a WAV file (it does not start with 'RIFF....WAVE'); only RIFF/WAVE is read natively: "
        "convert it, e.g. `ffmpeg -i notes.wav -ar 16000 -ac 1 out.wav`"
    )

    empty = tmp_path / "empty.wav"
    write_wav(empty, np.zeros((0, 1), dtype=np.int64), 2)
    with pytest.raises(InputError) as e:
        read_wav(empty)
    assert str(e.value) == f"WAV {empty} contains no audio samples; pass a file with at least one sample"

    adpcm = tmp_path / "adpcm.wav"
    adpcm.write_bytes(float_wav_bytes(np.zeros(4), SR, tag=2, bits=32))
    with pytest.raises(InputError) as e:
        read_wav(adpcm)
    assert str(e.value) == (
        f"WAV {adpcm} uses an unsupported encoding (format tag 0x0002, 32 bits per sample); supported: "
        "PCM integer 8/16/24/32-bit or IEEE float 32/64-bit. Convert it, e.g. "
        "`ffmpeg -i adpcm.wav -ar 16000 -ac 1 -c:a pcm_s16le out.wav`"
    )

    truncated = tmp_path / "cut.wav"
    truncated.write_bytes(float_wav_bytes(np.zeros(10), SR)[:-8])
    with pytest.raises(InputError, match="truncated: its data chunk declares 40 bytes but only 32 follow"):
        read_wav(truncated)
    with pytest.raises(InputError, match="is a directory"):
        read_wav(tmp_path)


def test_feature_input_errors(tmp_path):
    write_wav(tmp_path / "a.wav", np.zeros((800, 1), dtype=np.int64), 2, rate=44_100)
    samples, rate = read_wav(tmp_path / "a.wav")
    with pytest.raises(InputError) as e:
        audio_features(samples, rate)
    assert str(e.value) == (
        "the audio is sampled at 44100 Hz but the feature extractor needs 16000 Hz (16 kHz); resample it to "
        "16 kHz mono first, e.g. `ffmpeg -i in.wav -ar 16000 -ac 1 out.wav`"
    )
    with pytest.raises(InputError) as e:
        audio_features(np.zeros(0), SR)
    assert str(e.value) == "the audio is empty (0 samples); pass at least one sample"
    with pytest.raises(InputError, match=r"one mono channel, shape \[n\], got shape \[10, 2\]"):
        audio_features(np.zeros((10, 2)), SR)
    with pytest.raises(InputError, match=r"must be floats in \[-1, 1\], got dtype int16; scale integer PCM"):
        audio_features(np.zeros(10, dtype=np.int16), SR)
    with pytest.raises(InputError, match="NaN or infinity"):
        audio_features(np.array([0.0, np.nan]), SR)


# ----------------------------------------------------------------------------------------------
# settings


def test_settings_defaults_and_files(tmp_path):
    assert load_audio_feature_settings(tmp_path) == AudioFeatureSettings()
    # the feature_extractor block as transformers saves it (sample counts included, and ignored)
    block = {"dither": 0.0, "feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 128,
             "fft_length": 512, "fft_overdrive": False, "frame_length": 320, "hop_length": 160,
             "input_scale_factor": 1.0, "max_frequency": 8000.0, "mel_floor": 0.001, "min_frequency": 0.0,
             "padding_side": "right", "padding_value": 0.0, "per_bin_mean": None, "per_bin_stddev": None,
             "preemphasis": 0.0, "preemphasis_htk_flavor": True, "return_attention_mask": True,
             "sampling_rate": 16000}
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": block,
                                                                "audio_seq_length": 750}))
    assert load_audio_feature_settings(tmp_path) == AudioFeatureSettings()
    # transformers reads the same file to the same numbers
    fe = hf_extractor(load_audio_feature_settings(tmp_path))
    assert (fe.frame_length, fe.hop_length, fe.fft_length) == (320, 160, 512)

    block.update(mel_floor=1e-5, fft_overdrive=True, fft_length=1024, per_bin_mean=[0.5] * 128)
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": block,
                                                                "audio_seq_length": 375}))
    s = load_audio_feature_settings(tmp_path)
    assert (s.mel_floor, s.fft_length, s.per_bin_mean, s.audio_seq_length) == (1e-5, 1024, (0.5,) * 128, 375)


@pytest.mark.parametrize("change,message", [
    ({"dither": 1e-4}, "'dither' is 0.0001 but only 0.0 is supported; dither adds unseeded random noise"),
    ({"frame_length": 400}, ("'frame_length' is 400 but frame_length_ms/hop_length_ms/fft_overdrive give 320; "
                             "transformers ignores 'frame_length'")),
    ({"per_bin_mean": [0.0] * 3}, "'per_bin_mean' has 3 values but feature_size is 128"),
    ({"feature_size": 0}, "'feature_size' must be a positive integer, got 0"),
    ({"max_frequency": 9000.0}, "need 0 <= min_frequency < max_frequency <= sampling_rate / 2"),
    ({"padding_side": "left"}, "'padding_side' is 'left' but only 'right' is supported"),
])
def test_settings_errors(tmp_path, change, message):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(change))
    with pytest.raises(ConfigError) as e:
        load_audio_feature_settings(tmp_path)
    assert message in str(e.value)
    assert str(tmp_path / "preprocessor_config.json") in str(e.value)
