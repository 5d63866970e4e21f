"""MLX affine-quantised checkpoints in the oracle (refimpl/mlx_quant.py, refimpl/mlx_store.py).

The decoder against an independent one written here (each code read from two 32-bit words with shifts, the
value s * q + beta in Python floats): equal; against ``mlx.core.dequantize``: within its float32 (or half)
rounding, on hypothesis-drawn groups at every width and group size; checkpoints quantised by mlx-lm's own
``quantize_model`` (4, 8, 2, 3, 5, 6 bits, group sizes 32 and 64, mlx-lm's mixed_3_6 recipe, bfloat16 scales)
read as their dequantised values: every tensor, and the logits of ``Gemma4`` equal those of a float64
checkpoint of the values decoded here. Bad quantisation blocks and shapes: one line, exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl import Gemma4
from refimpl.errors import RefimplError
from refimpl.mlx_quant import BITS, FLOAT_MODES, GROUP_SIZES, QuantSpec, dequantize
from refimpl.mlx_store import MlxStore
from refimpl.safetensors_io import TensorStore, write_safetensors
from refimpl.synth import write_checkpoint

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (the 'mlx' extra)")
from mlx_convert import quantise, quantise_vlm  # noqa: E402 - after the importorskip of mlx

HALF_ULP = {np.float32: 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def reference_decode(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """W = s * q + beta, each code q_k read from the two 32-bit words that hold its bits [k b, (k + 1) b)."""
    words = np.asarray(words, dtype=np.uint64).reshape(-1, words.shape[-1])
    s = np.asarray(scales, dtype=np.float64).reshape(words.shape[0], -1)
    beta = np.asarray(biases, dtype=np.float64).reshape(words.shape[0], -1)
    n_in = words.shape[1] * 32 // bits
    g = n_in // s.shape[1]
    k = np.arange(n_in)
    word, shift = (k * bits) // 32, ((k * bits) % 32).astype(np.uint64)
    padded = np.concatenate([words, np.zeros((words.shape[0], 1), dtype=np.uint64)], axis=1)
    pair = padded[:, word] | (padded[:, word + 1] << np.uint64(32))
    q = ((pair >> shift) & np.uint64((1 << bits) - 1)).astype(np.float64)
    out = np.array([[float(s[r, i // g]) * float(q[r, i]) + float(beta[r, i // g]) for i in range(n_in)]
                    for r in range(words.shape[0])])
    return out


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Rows of b-bit codes as little-endian bit streams in uint32 words (Python integers: the format's words)."""
    out = []
    for row in codes:
        value = sum(int(c) << (k * bits) for k, c in enumerate(row))
        n_words = len(row) * bits // 32
        out.append([(value >> (32 * w)) & 0xFFFFFFFF for w in range(n_words)])
    return np.array(out, dtype=np.uint32)


@settings(max_examples=examples(200), deadline=None)
@given(bits=st.sampled_from(BITS), group=st.sampled_from(GROUP_SIZES), rows=st.integers(1, 3),
       groups=st.integers(1, 3), seed=st.integers(0, 2 ** 32 - 1), half=st.sampled_from([None, "F16", "BF16"]))
def test_the_codes_and_values_are_the_formats(bits, group, rows, groups, seed, half):
    """Codes drawn at random, packed as the format says, scales and biases of either sign (stored in float32,
    float16 or bfloat16): the decoder's values are exactly s * q + beta of the independent decoder."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (rows, groups * group))
    scales = rng.normal(0, 0.05, (rows, groups)).astype(np.float32)
    biases = rng.normal(0, 0.5, (rows, groups)).astype(np.float32)
    if half == "F16":
        scales, biases = scales.astype(np.float16), biases.astype(np.float16)
    words = pack(codes, bits)
    got = dequantize(words, scales, biases, QuantSpec(bits, group))
    assert np.array_equal(got, reference_decode(words, scales, biases, bits))
    assert np.array_equal(np.rint((got - np.repeat(biases.astype(np.float64), group, axis=1))
                                  / np.repeat(scales.astype(np.float64), group, axis=1)), codes)


def _mx_bound(theirs: np.ndarray, scales: np.ndarray, bits: int, ulp: float) -> np.ndarray:
    """mx.dequantize rounds s * q, then the sum, to its type: half an ulp of each."""
    s = np.repeat(np.abs(np.asarray(scales, dtype=np.float64)), theirs.shape[-1] // scales.shape[-1], axis=-1)
    return ulp * (s * ((1 << bits) - 1) + np.abs(theirs)) * 1.0001


@settings(max_examples=examples(100), deadline=None)
@given(bits=st.sampled_from(BITS), group=st.sampled_from(GROUP_SIZES), rows=st.integers(1, 4),
       groups=st.integers(1, 3), seed=st.integers(0, 2 ** 32 - 1),
       dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_the_values_are_mlx_dequantize_within_its_rounding(bits, group, rows, groups, seed, dtype):
    """Weights quantised by mx.quantize (float32, float16, bfloat16): the float64 values are mx.dequantize's
    within the rounding mx.dequantize adds (to float32, or twice to the half type)."""
    w = mx.array(np.random.default_rng(seed).normal(0, 0.1, (rows, groups * group)).astype(np.float32))
    w = w.astype(getattr(mx, dtype))
    words, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    theirs = np.array(mx.dequantize(words, scales, biases, group_size=group, bits=bits).astype(mx.float32),
                      dtype=np.float64)
    s, b = (np.array(a.astype(mx.float32)) for a in (scales, biases))  # exact: halves widen exactly
    got = dequantize(np.array(words), s, b, QuantSpec(bits, group))
    ulp = HALF_ULP[np.float32 if dtype == "float32" else dtype]
    assert np.all(np.abs(got - theirs) <= _mx_bound(theirs, s, bits, ulp))


@settings(max_examples=examples(100), deadline=None)
@given(mode=st.sampled_from(sorted(FLOAT_MODES)), rows=st.integers(1, 4), groups=st.integers(1, 3),
       seed=st.integers(0, 2 ** 32 - 1))
def test_the_floating_point_modes_are_mlx_dequantize(mode, rows, groups, seed):
    """mxfp4, nvfp4, mxfp8: codes and scale bytes drawn at random (every code; scales of every sign and exponent
    whose products stay inside float32's normal range; rows of 64 inputs a unit: mlx's nvfp4 fails on some narrow
    shapes, one row of 16 among them): the
    float64 values are exactly mx.dequantize's in float32 (scale * value is exact there). A NaN code or scale
    (E4M3 0x7f / 0xff; E8M0 255, the OCP MX NaN, which mlx reads as 2^128) is NaN, where mlx's value is not finite
    either."""
    bits, group, scale = FLOAT_MODES[mode]
    rng = np.random.default_rng(seed)
    n_in = 64 * groups
    words = rng.integers(0, 1 << 32, (rows, n_in * bits // 32), dtype=np.uint64).astype(np.uint32)
    shape = (rows, n_in // group)
    scales = rng.integers(90, 165, shape) if scale == "e8m0" else rng.integers(0, 256, shape)
    scales[0, 0] = 255 if scale == "e8m0" else 127  # a NaN scale
    scales = scales.astype(np.uint8)
    theirs = np.array(mx.dequantize(mx.array(words), mx.array(scales), group_size=group, bits=bits, mode=mode,
                                    dtype=mx.float32), dtype=np.float64)
    got = dequantize(words, scales, None, QuantSpec(bits, group, mode))
    nan = np.isnan(got)
    assert nan[0, :group].all() and not np.isfinite(theirs[nan]).any()
    assert np.array_equal(got[~nan], theirs[~nan])


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """preset -> its synthetic checkpoint, written once."""
    root, made = tmp_path_factory.mktemp("mlx"), {}

    def get(preset: str) -> Path:
        if preset not in made:
            made[preset] = write_checkpoint(preset, 0, root / preset)
        return made[preset]
    return get


@pytest.fixture(scope="module")
def e2b(presets) -> Path:
    return presets("e2b-mini")


# name -> (preset, bits, group size, mlx-lm recipe, dtype the weights are cast to first)
CONVERSIONS = {"q4-g32": ("e2b-mini", 4, 32, None, None), "q8-g64": ("e2b-mini", 8, 64, None, None),
               "q2-g32": ("e2b-mini", 2, 32, None, None), "q3-g64": ("e2b-mini", 3, 64, None, None),
               "q5-g32": ("e2b-mini", 5, 32, None, None), "q6-g64": ("e2b-mini", 6, 64, None, None),
               "mixed_3_6-g32": ("e2b-mini", 3, 32, "mixed_3_6", None),
               "q4-g64-bf16": ("e2b-mini", 4, 64, None, "bfloat16"),
               "256-wide q4-g128": ("e2b-256-mini", 4, 128, None, None),
               "moe q4-g32": ("26b-a4b-mini", 4, 32, None, None),
               "gemma4 wrapper q4-g32": ("e2b-vision-mini", 4, 32, None, None)}


def _reference(raw: TensorStore, info) -> np.ndarray:
    """A tensor of the store as the independent decoder reads it (a joined one: its parts along axis 1)."""
    if info.parts:
        return np.concatenate([_reference(raw, p) for p in info.parts], axis=1)
    if info.spec is None:
        return raw.get(info.mlx_name)
    words = raw.raw(info.mlx_name)
    s, b = raw.get(info.module + ".scales"), raw.get(info.module + ".biases")
    want = reference_decode(words, s, b, info.spec.bits).reshape(info.shape)
    theirs = np.array(mx.dequantize(mx.array(np.array(words)), mx.array(s.astype(np.float32)),
                                    mx.array(b.astype(np.float32)), group_size=info.spec.group_size,
                                    bits=info.spec.bits), dtype=np.float64).reshape(info.shape)
    assert np.all(np.abs(want - theirs) <= _mx_bound(theirs.reshape(-1, theirs.shape[-1]),
                                                     s.reshape(-1, s.shape[-1]), info.spec.bits,
                                                     2.0 ** -24).reshape(info.shape)), info.name
    return want


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_a_checkpoint_quantised_by_mlx_lm_is_its_dequantised_values(name, presets, tmp_path):
    """Every tensor equals the independent decoder's values (within mx.dequantize's rounding of them too; the MoE
    experts joined again from mlx-lm's halves); the forward equals that of a float64 checkpoint holding those
    values (float64 rounding). mlx-lm's gemma4 wrapper (an image-text checkpoint) writes the text model under
    language_model.model. and leaves the towers out: read as the checkpoint's model.language_model."""
    preset, bits, group, recipe, dtype = CONVERSIONS[name]
    src = presets(preset)
    out = quantise(src, tmp_path / "mlx", bits, group, recipe, dtype)
    store, raw = MlxStore(out), TensorStore(out)
    decoded, widths = {}, set()
    for full, info in store.infos.items():
        decoded[full] = want = _reference(raw, info)
        widths |= {(p.spec.bits, p.spec.group_size) for p in info.parts or (info,) if p.spec is not None}
        assert np.array_equal(store.get(full), want), full
        picked = [info.shape[0] - 1, 0, info.shape[0] - 1]
        assert np.array_equal(store.rows(full, picked), want[picked]), full
    assert widths >= ({(bits, group), (6, group)} if recipe else {(bits, group)})
    if preset == "e2b-vision-mini":
        assert all(n.startswith("language_model.model.") for n in raw.names) and "model.language_model.norm.weight" \
            in store.infos
    f64 = tmp_path / "decoded"
    f64.mkdir()
    for f in out.iterdir():
        if f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy(f, f64 / f.name)
    shutil.copy(src / "config.json", f64 / "config.json")
    write_safetensors(f64 / "model.safetensors", decoded, dtype="F64")
    ids = [2, 17, 300, 45, 9, 511, 2, 88]
    got, want = Gemma4(out).forward(ids, rows="all"), Gemma4(f64).forward(ids, rows="all")
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want))


VLM_CONVERSIONS = {"audio q8-g64": ("e2b-audio-mini", 8, 64, None),
                   "vision mixed_3_6-g64": ("e2b-vision-mini", 3, 64, "mixed_3_6")}


@pytest.mark.parametrize("name", sorted(VLM_CONVERSIONS))
def test_a_checkpoint_quantised_by_mlx_vlm_is_the_checkpoint_under_its_names(name, presets, tmp_path):
    """``mlx_vlm.convert -q`` writes the towers and their embedders without ``model.`` and unquantised, the
    audio tower's convolutions in MLX's channels-last layout: read back, every tower tensor is the source
    checkpoint's own tensor exactly (the convolutions transposed back), every quantised one the independent
    decoder's values, and nothing is missing or extra."""
    pytest.importorskip("mlx_vlm")
    preset, bits, group, recipe = VLM_CONVERSIONS[name]
    src = presets(preset)
    out = quantise_vlm(src, tmp_path / "mlx", bits, group, recipe)
    store, raw, source = MlxStore(out), TensorStore(out), TensorStore(src)
    assert sorted(store.infos) == sorted(source.names)
    towers = [n for n in raw.names if n.startswith(("vision_tower.", "audio_tower.", "embed_"))]
    assert towers and not any(n.endswith(".scales") for n in towers)
    transposed = {n: i for n, i in store.infos.items() if i.axes is not None}
    assert bool(transposed) == (preset == "e2b-audio-mini")
    for full, info in transposed.items():
        assert raw.infos[info.mlx_name].shape != source.infos[full].shape, full  # stored in MLX's layout
        assert np.array_equal(store.rows(full, [1, 0]), source.get(full)[[1, 0]]), full
    for full, info in store.infos.items():
        want = source.get(full) if info.spec is None else _reference(raw, info)
        assert store.infos[full].shape == tuple(want.shape), full
        assert np.array_equal(store.get(full), want), full
    if recipe is not None:
        assert {info.spec.bits for info in store.infos.values() if info.spec is not None} == {3, 6}


@pytest.mark.parametrize("mode", sorted(FLOAT_MODES))
def test_a_checkpoint_in_a_floating_point_mode_is_its_dequantised_values(mode, e2b, tmp_path):
    """mlx-lm's quantize_model in mode mxfp4 / nvfp4 / mxfp8 (``convert --q-mode``): every quantised tensor reads
    as mx.dequantize's float32 values of it (exact), config.json's mode and its fixed width and group size."""
    bits, group, _ = FLOAT_MODES[mode]
    out = quantise(e2b, tmp_path / mode, bits, group, mode=mode)
    store, raw = MlxStore(out), TensorStore(out)
    quantised = [info for info in store.infos.values() if info.spec is not None]
    assert quantised and {info.dtype for info in quantised} == {f"{mode} q{bits} g{group}"}
    for info in quantised:
        assert raw.infos[info.module + ".scales"].dtype == "U8" and info.module + ".biases" not in raw
        theirs = mx.dequantize(mx.array(np.array(raw.raw(info.mlx_name))), mx.array(raw.get(info.module + ".scales")
                                                                                     .astype(np.uint8)),
                               group_size=group, bits=bits, mode=mode, dtype=mx.float32)
        assert np.array_equal(store.get(info.name), np.array(theirs, dtype=np.float64)), info.name
    assert np.isfinite(Gemma4(out).forward([2, 17, 300], rows="all")).all()


def _refimpl(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refimpl", *argv], capture_output=True, text=True, timeout=300)


def test_the_cli_reads_an_mlx_checkpoint(e2b, tmp_path):
    out = quantise(e2b, tmp_path / "q4", 4, 32)
    run = _refimpl("logits", "--model", str(out), "--tokens", "2,5,6,7", "--rows", "all", "--out",
                   str(tmp_path / "l.safetensors"))
    assert run.returncode == 0, run.stderr
    got, want = TensorStore(tmp_path / "l.safetensors").get("logits"), Gemma4(out).forward([2, 5, 6, 7], rows="all")
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want))
    run = _refimpl("inspect", "--model", str(out))
    assert run.returncode == 0 and "affine q4 g32" in run.stdout, run.stdout + run.stderr


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization"])
    cfg["quantization_config"] = cfg["quantization"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


ST = "{dir}/model.safetensors: model.embed_tokens"
BAD = {
    "bits 7": (lambda q: q.update(bits=7),
               "{cfg}: quantization: bits 7 is not one of MLX's affine widths the oracle decodes (2, 3, 4, 5, 6, 8)"),
    "affine bytes called mxfp4": (lambda q: q.update(mode="mxfp4"),
                                  ST + ": mxfp4 scales stored as F32 (expected U8)"),
    "nvfp4 at group 32": (lambda q: q.update(mode="nvfp4"),
                          "{cfg}: quantization: mode 'nvfp4' takes bits 4 and group_size 16 only, got bits 4 and "
                          "group_size 32"),
    "a global scale": (lambda q: q.update({"model.layers.0.mlp.up_proj": {"bits": 4, "group_size": 32,
                                                                          "global_scale": True}}),
                       "{cfg}: quantization['model.layers.0.mlp.up_proj']: global_scale (a tensor-wide nvfp4 scale) "
                       "is not read yet by the oracle"),
    "a group size of the other": (lambda q: q.update(group_size=64),
                                  ST + ": scales [512, 2] do not match the packed weight [512, 8] at 4 bits and group "
                                  "size 64 (expected [512, 1])"),
    "a width that does not divide": (lambda q: q.update(bits=3),
                                     ST + ": the packed weight [512, 8] holds 8 uint32 words a row, which do not "
                                     "divide into 3-bit codes"),
    "an entry for no tensor": (lambda q: q.update({"model.layers.0.mlp.gate": {"bits": 8, "group_size": 32}}),
                               "{cfg}: quantization['model.layers.0.mlp.gate'] names no quantised tensor of the "
                               "checkpoint (no 'model.layers.0.mlp.gate.weight' with "
                               "'model.layers.0.mlp.gate.scales')"),
    "false for a stored one": (lambda q: q.update({"model.layers.0.mlp.up_proj": False}),
                               "{cfg}: quantization['model.layers.0.mlp.up_proj'] is false (not quantised), but the "
                               "checkpoint stores 'model.layers.0.mlp.up_proj' packed with scales"),
}


def test_bad_quantisation_is_one_line_and_exit_2(e2b, tmp_path):
    good = quantise(e2b, tmp_path / "q4", 4, 32)
    for what, (edit, says) in BAD.items():
        bad = _edited(good, tmp_path / what.replace(" ", "-"), edit)
        with pytest.raises(RefimplError):
            Gemma4(bad)
        run = _refimpl("logits", "--model", str(bad), "--tokens", "2,5", "--out", str(tmp_path / "x.safetensors"))
        said = says.format(cfg=bad / "config.json", dir=bad)
        assert (run.returncode, run.stderr) == (2, f"refimpl: error: {said}\n"), what
        assert not (tmp_path / "x.safetensors").exists()
