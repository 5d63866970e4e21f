"""refimpl.arrays: the device of a model, chosen once (``Gemma4(dir, device=...)``), and the one-line
errors where the GPU path cannot run (no CuPy, no CUDA device). Runs everywhere: CuPy is stood in for by a fake
module where its presence is what is tested."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from refimpl import arrays
from refimpl.errors import InputError
from refimpl.model import Gemma4


def test_cpu_is_numpy():
    assert arrays.resolve_device("cpu") == "cpu" and arrays.array_module("cpu") is np


def test_a_bad_device_is_one_line():
    with pytest.raises(InputError, match=r"^device must be one of cpu, cuda, got 'gpu'$"):
        arrays.resolve_device("gpu")


def test_cuda_without_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(InputError, match=r"^device cuda: CuPy is not installed \(.*\); install CuPy for the machine's "
                                         r"CUDA major version: pip install 'gemma4-conformance\[cuda12\]' or "
                                         r"'gemma4-conformance\[cuda13\]' \(docs/refimpl.md, 'GPU'\)$"):
        arrays.array_module("cuda")


def _fake_cupy(count):
    def get_count():
        if isinstance(count, Exception):
            raise count
        return count

    runtime = types.SimpleNamespace(getDeviceCount=get_count)
    return types.SimpleNamespace(__version__="14.2.0", cuda=types.SimpleNamespace(runtime=runtime))


def test_cuda_without_a_device_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(0))
    with pytest.raises(InputError, match=r"^device cuda: CuPy 14.2.0 sees no CUDA device \(getDeviceCount\(\) is 0\); "
                                         r"run on a machine with an NVIDIA GPU and its driver, or use device cpu$"):
        arrays.array_module("cuda")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(RuntimeError("cudaErrorNoDevice: no CUDA-capable device")))
    with pytest.raises(InputError, match=r"^device cuda: CuPy 14.2.0 finds no CUDA device \(RuntimeError: "
                                         r"cudaErrorNoDevice: no CUDA-capable device\); run on a machine"):
        arrays.array_module("cuda")
    fake = _fake_cupy(1)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert arrays.array_module("cuda") is fake


def test_a_model_on_the_cpu_keeps_numpy(preset_dirs, monkeypatch):
    """device="cpu" is the NumPy oracle: the same logits as the default model, as NumPy arrays; the GPU refuses
    ggml's CPU activation convention in one line."""
    ids = list(np.random.default_rng(3).integers(3, 500, 9))
    a = Gemma4(preset_dirs["e2b-mini"]).forward(ids, rows="all")
    b = Gemma4(preset_dirs["e2b-mini"], device="cpu").forward(ids, rows=[2, -1])
    assert type(a) is np.ndarray and np.max(np.abs(a[[2, -1]] - b)) <= 1e-12 * np.max(np.abs(a))
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(1))
    with pytest.raises(InputError, match=r"^activations ggml-cpu/x86: ggml's CPU activation convention runs on device "
                                         r"cpu only$"):
        Gemma4(preset_dirs["e2b-mini"], device="cuda", activations="ggml-cpu/x86")


def test_the_command_line_without_cupy_is_one_line_and_writes_nothing(preset_dirs, monkeypatch, tmp_path, capsys):
    """``refimpl logits --device cuda`` where CuPy is missing: exit 2, the one line on stderr, no output file."""
    from refimpl.cli import main

    monkeypatch.setitem(sys.modules, "cupy", None)
    out = tmp_path / "l.safetensors"
    assert main(["logits", "--model", str(preset_dirs["e2b-mini"]), "--tokens", "2,17,30", "--out", str(out),
                 "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("refimpl: error: device cuda: CuPy is not installed")
    assert not out.exists()
    assert main(["logits", "--model", str(preset_dirs["e2b-mini"]), "--tokens", "2,17,30", "--out", str(out),
                 "--device", "cpu"]) == 0 and out.exists()


@pytest.mark.parametrize("kind", ["BF16", "F16", "F32", "F64"])
def test_decoding_where_stored_is_the_host_decoder(kind):
    """What the device path runs on the stored values (the array's own methods: astype, shift, view) decodes every
    plain float type as the host decoder does, bit for bit (both exact), NaN, infinities and subnormals included."""
    from refimpl.safetensors_io import STORAGE, decode, decode_where_stored

    rng = np.random.default_rng(3)
    if kind == "BF16":
        stored = rng.integers(0, 2**16, 5000, dtype=np.uint16)
    else:
        width = STORAGE[kind].itemsize * 8
        stored = rng.integers(0, 2**width, 5000, dtype=np.uint64).astype(f"u{width // 8}").view(STORAGE[kind])
    with np.errstate(invalid="ignore"):  # (signalling NaNs among the random bit patterns)
        want, got = decode(stored, kind, np.float64), decode_where_stored(stored, kind, np.float64)
    assert got.dtype == np.float64 and np.array_equal(got.view(np.uint64), want.view(np.uint64))
