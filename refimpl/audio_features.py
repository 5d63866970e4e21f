"""Gemma 4 audio front end in pure NumPy: WAV reading, log-mel features and the soft-token count,
matching transformers' ``Gemma4AudioFeatureExtractor`` (gemma4-multimodal-spec.md section 9.1) and the
audio arithmetic of ``Gemma4Processor``.

Shapes: n samples, n' = n rounded up to a multiple of 128 (after truncation to 480 000), f = frame
length (320 = 20 ms at 16 kHz), h = hop (160 = 10 ms), N = FFT length (512), K = N/2 + 1 frequency
bins, M = 128 mel bins, T mel frames.

    file --read_wav--> float64 [n] in [-1, 1], channels averaged (mono), and the sample rate
      --check_sample_rate--> the rate must equal settings.sampling_rate (16 kHz); no resampling here
      --truncate_and_pad--> float64 [n'], real [n'] bool
        at most max_length = 480 000 samples (30 s) are kept; then right-padded with
        padding_value (0.0) to a multiple of pad_to_multiple_of = 128
      --(times input_scale_factor, 1.0)--
      --semicausal_pad--> float64 [f/2 + n'], real [f/2 + n']
        f/2 = 160 zeros in front, which count as *not* real
      --frame--> float64 [T, f + 1], T = (f/2 + n' - (f + 1)) // h + 1 (0 when negative)
        frame t holds padded samples t h .. t h + f (one more sample than the window)
      --preemphasis--> float64 [T, f]
        coefficient 0 (the default): the last sample of each frame is dropped;
        HTK flavour: [x0 (1 - p), x1 - p x0, ..., x(f-1) - p x(f-2)]; else x[1:] - p x[:-1]
      --times periodic Hann w[i] = 1/2 - 1/2 cos(2 pi i / f)--> float64 [T, f]
      --|rfft(., N)|--> magnitude (not power) [T, K], frames zero-padded on the right to N
      --@ mel_filters [K, M]--> [T, M]
        HTK mel scale 2595 log10(1 + hz/700), M + 2 points evenly spaced in mel from 0 to 8000 Hz,
        triangles over the bin frequencies linspace(0, sr // 2, K), peak 1, no area normalisation
      --log(mel + mel_floor)--> [T, M], mel_floor = 1e-3
      --(minus per_bin_mean, divided by per_bin_stddev, when the config gives them)--
      --frame_mask--> mask [T]: frame t is valid when padded sample t h + f is real audio, i.e. the
        frame's whole f + 1 sample span lies in the real audio (the leading zeros count as real
        for this test: only the last sample is looked at); invalid frames are set to 0.0

    audio_soft_token_count(mask): two stride-2 convolutions (kernel 3, padding 1) simulated on the
    mask, t -> (t - 1) // 2 + 1 keeping mask[::2], then the number of valid entries, capped at
    audio_seq_length = 750 (1 s of audio -> 99 valid frames -> 25 tokens).

Where transformers computes in float32 (here everything stays float64): ``SequenceFeatureExtractor.pad``
casts a float64 waveform to float32; the Hann window is stored as float32; so the frames, the FFT
(NumPy 2 keeps float32 -> complex64) and the magnitude are float32; the mel matmul (float64 filters)
and the log are float64 again; the output is cast to float32. Fed float32-exact audio, the results
agree to a bound set by float32 FFT rounding divided by (mel + mel_floor) (tests/oracle/towers/test_audio_features.py).

Choices this module makes on purpose:
* Multi-channel WAV is averaged to mono, as every transformers audio loader does
  (``audio_utils.load_audio``: soundfile, torchaudio and torchcodec backends all downmix to one channel).
* The sample rate is never converted: a rate other than ``settings.sampling_rate`` is an InputError.
  transformers' extractor itself does not check the rate; its loader resamples with soxr.
* ``dither`` must be 0 (the published value): dither adds unseeded random noise, which no oracle can
  reproduce. ``padding_side`` must be "right" (the published value).
* The checkpoint keys "frame_length", "hop_length" and "fft_length" (sample counts) are ignored by
  transformers, which derives them from ``frame_length_ms`` / ``hop_length_ms``; here a value that
  disagrees with the derived one is a ConfigError rather than being silently ignored.
* An all-empty waveform is an InputError (transformers fails on it with an unrelated error). Audio too
  short for one valid frame (fewer than f/2 + 1 = 161 samples) gives features with no valid frame and
  0 soft tokens, as in transformers.

Dependencies: NumPy and the standard library only.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .config_fields import read_json, read_media_file
from .errors import ConfigError, InputError

SAMPLE_RATE = 16_000  # Hz, what Gemma 4's audio tower was trained on
MAX_LENGTH = 480_000  # samples (30 s), Gemma4AudioFeatureExtractor.__call__(max_length=...)
PAD_TO_MULTIPLE_OF = 128  # samples, Gemma4AudioFeatureExtractor.__call__(pad_to_multiple_of=...)
AUDIO_SEQ_LENGTH = 750  # Gemma4Processor(audio_seq_length=...), the cap on soft tokens per clip
SUBSAMPLING_LAYERS = 2  # Gemma4AudioSubSampleConvProjection: two Conv2d(kernel 3, stride 2, padding 1)
RESAMPLE_HINT = "resample it to 16 kHz mono first, e.g. `ffmpeg -i in.wav -ar 16000 -ac 1 out.wav`"

# ----------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class AudioFeatureSettings:
    """Gemma4AudioFeatureExtractor's parameters; the defaults are transformers 5.24's."""

    feature_size: int = 128  # M mel bins
    sampling_rate: int = SAMPLE_RATE
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False  # doubles the FFT length
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None  # [M] or None
    per_bin_stddev: tuple[float, ...] | None = None  # [M] or None
    padding_value: float = 0.0
    max_length: int = MAX_LENGTH  # __call__ argument, not stored in the checkpoint
    pad_to_multiple_of: int = PAD_TO_MULTIPLE_OF  # __call__ argument, not stored in the checkpoint
    audio_seq_length: int = AUDIO_SEQ_LENGTH  # a processor setting (top level of processor_config.json)

    @property
    def frame_length(self) -> int:  # f, samples
        return round(self.sampling_rate * self.frame_length_ms / 1000.0)

    @property
    def hop_length(self) -> int:  # h, samples
        return round(self.sampling_rate * self.hop_length_ms / 1000.0)

    @property
    def fft_length(self) -> int:  # N, the next power of two >= f (doubled with fft_overdrive)
        return 2 ** math.ceil(math.log2(self.frame_length)) * (2 if self.fft_overdrive else 1)


PROCESSOR_FILES = (("processor_config.json", "feature_extractor"), ("preprocessor_config.json", None))
DERIVED_KEYS = ("frame_length", "hop_length", "fft_length")  # sample counts transformers recomputes
FIXED_KEYS = {"dither": 0.0, "padding_side": "right"}  # values other than these are refused


def load_audio_feature_settings(model_dir: str | Path) -> AudioFeatureSettings:
    """processor_config.json ("feature_extractor", plus the top-level "audio_seq_length") or
    preprocessor_config.json (the same keys at the top level, or under "feature_extractor"); with
    neither file, or no audio keys in it, transformers' defaults (AudioFeatureSettings())."""
    for name, key in PROCESSOR_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            return _settings_from_file(path, key)
    return AudioFeatureSettings()


def _settings_from_file(path: Path, key: str | None) -> AudioFeatureSettings:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    top = raw
    if key is None and isinstance(raw.get("feature_extractor"), dict):
        key = "feature_extractor"
    if key is not None:
        raw = raw.get(key, {})
    where = f"{path}" + (f" ['{key}']" if key else "")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    values = {}
    for field in fields(AudioFeatureSettings):
        source = top if field.name == "audio_seq_length" else raw
        if field.name in ("max_length", "pad_to_multiple_of"):
            continue  # call-time arguments, never read from the checkpoint by transformers
        if source.get(field.name) is not None:
            values[field.name] = _check_value(where, field.name, source[field.name], field.default)
    for name, allowed in FIXED_KEYS.items():
        if raw.get(name) is not None and raw[name] != allowed:
            raise ConfigError(
                f"{where}: '{name}' is {raw[name]!r} but only {allowed!r} is supported"
                + ("; dither adds unseeded random noise that cannot be reproduced" if name == "dither" else "")
            )
    settings = AudioFeatureSettings(**values)
    check_settings(settings, where)
    for name in DERIVED_KEYS:
        if raw.get(name) is not None and raw[name] != getattr(settings, name):
            raise ConfigError(
                f"{where}: '{name}' is {raw[name]!r} but frame_length_ms/hop_length_ms/fft_overdrive give "
                f"{getattr(settings, name)}; transformers ignores '{name}' and uses the derived value, "
                "so fix or remove the key"
            )
    return settings


def _check_value(where: str, name: str, value, default):
    if name in ("per_bin_mean", "per_bin_stddev"):
        if not isinstance(value, list) or not all(_is_number(v) for v in value):
            raise ConfigError(f"{where}: '{name}' must be a list of numbers or null, got {value!r}")
        return tuple(float(v) for v in value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: '{name}' must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{where}: '{name}' must be a positive integer, got {value!r}")
        return value
    if not _is_number(value):
        raise ConfigError(f"{where}: '{name}' must be a number, got {value!r}")
    return float(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_settings(s: AudioFeatureSettings, where: str = "audio feature settings") -> AudioFeatureSettings:
    """ConfigError for settings transformers would reject or that cannot make features."""
    if s.frame_length < 2 or s.hop_length < 1:
        raise ConfigError(
            f"{where}: frame_length_ms {s.frame_length_ms} / hop_length_ms {s.hop_length_ms} give "
            f"{s.frame_length} / {s.hop_length} samples at {s.sampling_rate} Hz; both must be at least 2 / 1"
        )
    if not 0.0 <= s.min_frequency < s.max_frequency <= s.sampling_rate / 2:
        raise ConfigError(
            f"{where}: need 0 <= min_frequency < max_frequency <= sampling_rate / 2, got "
            f"{s.min_frequency}, {s.max_frequency}, {s.sampling_rate}"
        )
    if s.mel_floor <= 0.0:
        raise ConfigError(f"{where}: mel_floor must be positive (it keeps log() finite), got {s.mel_floor}")
    for name in ("per_bin_mean", "per_bin_stddev"):
        vec = getattr(s, name)
        if vec is not None and len(vec) != s.feature_size:
            raise ConfigError(f"{where}: '{name}' has {len(vec)} values but feature_size is {s.feature_size}")
    if s.per_bin_stddev is not None and any(v == 0.0 for v in s.per_bin_stddev):
        raise ConfigError(f"{where}: 'per_bin_stddev' contains 0; every entry must be non-zero")
    return s


# ----------------------------------------------------------------------------------------------
# reading WAV files

WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT, WAVE_FORMAT_EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
SUPPORTED_ENCODINGS = "PCM integer 8/16/24/32-bit or IEEE float 32/64-bit"


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """A RIFF/WAVE file as (float64 [n] mono samples in [-1, 1], sample rate in Hz).

    Integers are scaled as soundfile/libsndfile do: signed b-bit x -> x / 2^(b-1), unsigned 8-bit
    x -> (x - 128) / 128; floats are taken as they are. Several channels are averaged. A trailing
    partial frame (fewer bytes than one sample of every channel) is ignored, as libsndfile does.
    """
    path = Path(path)
    data = read_media_file(path, "audio", "a .wav file")
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise InputError(
            f"{path} is not a WAV file (it does not start with 'RIFF....WAVE'); only RIFF/WAVE is read "
            f"natively: convert it, e.g. `ffmpeg -i {path.name} -ar 16000 -ac 1 out.wav`"
        )
    chunks = _riff_chunks(data, path)
    if b"fmt " not in chunks:
        raise InputError(f"WAV {path} is corrupt: it has no 'fmt ' chunk; re-export the file")
    if b"data" not in chunks:
        raise InputError(f"WAV {path} is corrupt: it has no 'data' chunk; re-export the file")
    encoding, channels, rate, bits = _wav_format(chunks[b"fmt "], path)
    frame_bytes = channels * bits // 8
    body = chunks[b"data"]
    n = len(body) // frame_bytes
    if n == 0:
        raise InputError(f"WAV {path} contains no audio samples; pass a file with at least one sample")
    samples = decode_samples(body[: n * frame_bytes], encoding, bits).reshape(n, channels)  # [n, channels]
    if not np.isfinite(samples).all():
        raise InputError(f"WAV {path} contains NaN or infinite float samples; re-export the file")
    return downmix(samples), rate


def _riff_chunks(data: bytes, path: Path) -> dict[bytes, bytes]:
    """The first chunk of each id after 'RIFF....WAVE'; each chunk body is padded to an even size."""
    chunks: dict[bytes, bytes] = {}
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if len(body) < size and kind != b"data":
            raise InputError(f"WAV {path} is truncated inside its {kind!r} chunk; re-export the file")
        if len(body) < size:
            raise InputError(
                f"WAV {path} is truncated: its data chunk declares {size} bytes but only {len(body)} follow; "
                "re-export the file"
            )
        chunks.setdefault(kind, body)
        pos += 8 + size + (size & 1)
    return chunks


def _wav_format(fmt: bytes, path: Path) -> tuple[int, int, int, int]:
    """(encoding PCM or IEEE float, channels, sample rate, bits per sample) from a 'fmt ' chunk."""
    if len(fmt) < 16:
        raise InputError(f"WAV {path} is corrupt: its 'fmt ' chunk has {len(fmt)} bytes, fewer than 16")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == WAVE_FORMAT_EXTENSIBLE:
        if len(fmt) < 40:
            raise InputError(f"WAV {path} is corrupt: WAVE_FORMAT_EXTENSIBLE needs a 40-byte 'fmt ' chunk")
        tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the format tag
    supported = {WAVE_FORMAT_PCM: (8, 16, 24, 32), WAVE_FORMAT_IEEE_FLOAT: (32, 64)}
    if tag not in supported or bits not in supported[tag]:
        name = {WAVE_FORMAT_PCM: "PCM", WAVE_FORMAT_IEEE_FLOAT: "IEEE float"}.get(tag, f"format tag 0x{tag:04x}")
        raise InputError(
            f"WAV {path} uses an unsupported encoding ({name}, {bits} bits per sample); supported: "
            f"{SUPPORTED_ENCODINGS}. Convert it, e.g. `ffmpeg -i {path.name} -ar 16000 -ac 1 -c:a pcm_s16le out.wav`"
        )
    if channels == 0 or rate == 0:
        raise InputError(f"WAV {path} is corrupt: it declares {channels} channels at {rate} Hz")
    if block_align != channels * bits // 8:
        raise InputError(
            f"WAV {path} is corrupt: block align {block_align} is not channels x bytes per sample "
            f"= {channels * bits // 8}"
        )
    return tag, channels, rate, bits


def decode_samples(body: bytes, encoding: int, bits: int) -> np.ndarray:
    """Little-endian interleaved samples -> float64 [n * channels], integers scaled into [-1, 1)."""
    if encoding == WAVE_FORMAT_IEEE_FLOAT:
        return np.frombuffer(body, dtype="<f4" if bits == 32 else "<f8").astype(np.float64)
    if bits == 8:  # unsigned, 128 is silence
        return (np.frombuffer(body, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    if bits == 24:  # three bytes, little-endian two's complement
        b = np.frombuffer(body, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
    else:
        ints = np.frombuffer(body, dtype="<i2" if bits == 16 else "<i4")
    return ints.astype(np.float64) / float(1 << (bits - 1))


def downmix(samples: np.ndarray) -> np.ndarray:
    """[n, channels] -> mono [n], the mean over channels."""
    return samples.mean(axis=1)


# ----------------------------------------------------------------------------------------------
# the feature pipeline, one step per function


@dataclass(frozen=True)
class AudioFeatures:
    features: np.ndarray  # float64 [T, M], invalid frames 0.0
    mask: np.ndarray  # bool [T], True for frames wholly inside the real audio


def check_samples(samples, sample_rate, settings: AudioFeatureSettings) -> np.ndarray:
    """The waveform as float64 [n]; InputError for a wrong rate, shape, or an empty/non-finite waveform."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise InputError(f"the sample rate must be an integer number of Hz, got {sample_rate!r}")
    if sample_rate != settings.sampling_rate:
        raise InputError(
            f"the audio is sampled at {sample_rate} Hz but the feature extractor needs {settings.sampling_rate} Hz "
            f"({settings.sampling_rate / 1000:g} kHz); {RESAMPLE_HINT}"
        )
    x = np.asarray(samples)
    if x.dtype.kind != "f":
        raise InputError(
            f"the samples must be floats in [-1, 1], got dtype {x.dtype}; scale integer PCM first "
            "(int16: x / 32768) or read the file with read_wav"
        )
    if x.ndim != 1:
        raise InputError(
            f"the samples must be one mono channel, shape [n], got shape {list(x.shape)}; "
            "average the channels first (read_wav does)"
        )
    if x.size == 0:
        raise InputError("the audio is empty (0 samples); pass at least one sample")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise InputError("the samples contain NaN or infinity; pass finite values in [-1, 1]")
    return x


def truncate_and_pad(x: np.ndarray, settings: AudioFeatureSettings) -> tuple[np.ndarray, np.ndarray]:
    """[n] -> (waveform [n'], real [n']): keep at most max_length samples (max_length rounded up to a
    multiple of pad_to_multiple_of, as transformers does), then right-pad with padding_value to a
    multiple of pad_to_multiple_of."""
    p = settings.pad_to_multiple_of
    x = x[: -(-settings.max_length // p) * p]
    n_padded = -(-len(x) // p) * p
    waveform = np.concatenate([x, np.full(n_padded - len(x), settings.padding_value)])  # [n']
    real = np.arange(n_padded) < len(x)  # [n']
    return waveform, real


def semicausal_pad(waveform: np.ndarray, real: np.ndarray, frame_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Prepend frame_length // 2 zeros (marked not real), so frame 0 is centred on sample 0."""
    left = frame_length // 2
    return np.concatenate([np.zeros(left), waveform]), np.concatenate([np.zeros(left, dtype=bool), real])


def frame(waveform: np.ndarray, size: int, hop: int) -> np.ndarray:
    """[L] -> [T, size], frame t = waveform[t hop : t hop + size], T = (L - size) // hop + 1 (or 0)."""
    count = max((len(waveform) - size) // hop + 1, 0)
    index = np.arange(count)[:, None] * hop + np.arange(size)[None, :]  # [T, size]
    return waveform[index]


def preemphasize(frames: np.ndarray, coefficient: float, htk_flavor: bool) -> np.ndarray:
    """[T, f + 1] -> [T, f]."""
    if coefficient <= 0.0:
        return frames[:, :-1]
    if htk_flavor:
        first = frames[:, :1] * (1.0 - coefficient)
        return np.concatenate([first, frames[:, 1:-1] - coefficient * frames[:, :-2]], axis=1)
    return frames[:, 1:] - coefficient * frames[:, :-1]


def periodic_hann(length: int) -> np.ndarray:
    """[f], w[i] = 1/2 - 1/2 cos(2 pi i / f)."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(length) / length)


def magnitude_spectrum(frames: np.ndarray, fft_length: int) -> np.ndarray:
    """[T, f] -> |DFT| [T, N/2 + 1] of each frame zero-padded on the right to N."""
    return np.abs(np.fft.rfft(frames, n=fft_length, axis=-1))


def hz_to_mel(hz):
    """HTK mel scale."""
    return 2595.0 * np.log10(1.0 + hz / 700.0)


def mel_to_hz(mel):
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filter_bank(n_bins: int, n_mels: int, min_hz: float, max_hz: float, sample_rate: int) -> np.ndarray:
    """[K, M] triangular filters, peak 1, no normalisation (transformers' ``mel_filter_bank(norm=None,
    mel_scale="htk")``). Filter m rises from corner m to m + 1 and falls to m + 2, corners evenly spaced
    in mel. Bin frequencies are linspace(0, sample_rate // 2, K) as in transformers (integer halving)."""
    corners = mel_to_hz(np.linspace(hz_to_mel(min_hz), hz_to_mel(max_hz), n_mels + 2))  # [M + 2]
    bins = np.linspace(0, sample_rate // 2, n_bins)[:, None]  # [K, 1]
    lower, centre, upper = corners[None, :-2], corners[None, 1:-1], corners[None, 2:]  # [1, M] each
    rising = (bins - lower) / (centre - lower)  # [K, M]
    falling = (upper - bins) / (upper - centre)  # [K, M]
    return np.maximum(0.0, np.minimum(rising, falling))


def log_mel(magnitude: np.ndarray, filters: np.ndarray, floor: float) -> np.ndarray:
    """[T, K] @ [K, M] -> log(mel + floor) [T, M]."""
    return np.log(magnitude @ filters + floor)


def normalize_bins(features: np.ndarray, settings: AudioFeatureSettings) -> np.ndarray:
    """(features - per_bin_mean) / per_bin_stddev, each step only when the settings give it."""
    if settings.per_bin_mean is not None:
        features = features - np.asarray(settings.per_bin_mean)[None, :]
    if settings.per_bin_stddev is not None:
        features = features / np.asarray(settings.per_bin_stddev)[None, :]
    return features


def frame_mask(real: np.ndarray, count: int, frame_length: int, hop: int) -> np.ndarray:
    """[T] bool: frame t is valid when padded sample t hop + frame_length (its last one) is real."""
    return real[np.arange(count) * hop + frame_length]


def audio_features(samples, sample_rate: int, settings: AudioFeatureSettings | None = None) -> AudioFeatures:
    """float samples [n] at ``sample_rate`` Hz -> AudioFeatures(features [T, M], mask [T]) (module docstring)."""
    s = check_settings(settings if settings is not None else AudioFeatureSettings())
    x = check_samples(samples, sample_rate, s)  # [n]
    waveform, real = truncate_and_pad(x, s)  # [n'], [n']
    waveform = waveform * s.input_scale_factor
    waveform, real = semicausal_pad(waveform, real, s.frame_length)  # [f/2 + n']
    frames = frame(waveform, s.frame_length + 1, s.hop_length)  # [T, f + 1]
    frames = preemphasize(frames, s.preemphasis, s.preemphasis_htk_flavor)  # [T, f]
    magnitude = magnitude_spectrum(frames * periodic_hann(s.frame_length)[None, :], s.fft_length)  # [T, K]
    filters = mel_filter_bank(s.fft_length // 2 + 1, s.feature_size, s.min_frequency, s.max_frequency,
                              s.sampling_rate)  # [K, M]
    features = normalize_bins(log_mel(magnitude, filters, s.mel_floor), s)  # [T, M]
    mask = frame_mask(real, frames.shape[0], s.frame_length, s.hop_length)  # [T]
    return AudioFeatures(np.where(mask[:, None], features, 0.0), mask)


# ----------------------------------------------------------------------------------------------
# soft tokens


def audio_soft_token_count(mask, max_tokens: int | None = AUDIO_SEQ_LENGTH) -> int:
    """Soft tokens for one clip: the mel-frame mask [T] through two simulated stride-2 convolutions
    (kernel 3, padding 1: t -> (t + 2 - 3) // 2 + 1, keeping mask[::2]), valid entries counted, capped
    at ``max_tokens`` (audio_seq_length, 750).

    ``Gemma4Processor.replace_audio_token`` counts the same way without the cap, and
    ``_compute_audio_num_tokens`` computes the same number from the sample count with the cap; the two
    agree whenever the audio was truncated at 480 000 samples (at most 750 tokens then). None: no cap.
    """
    m = np.asarray(mask, dtype=bool)
    if m.ndim != 1:
        raise InputError(f"the mask must be one clip's frame mask, shape [T], got shape {list(m.shape)}")
    for _ in range(SUBSAMPLING_LAYERS):
        m = m[::2][: (len(m) + 2 - 3) // 2 + 1]
    count = int(m.sum())
    return count if max_tokens is None else min(count, max_tokens)
