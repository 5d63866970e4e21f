"""The oracle's device path on every machine (issue 53): ``Gemma4(dir, device="cuda")`` with CuPy stood in for by
tests/strict_device.py, whose arrays compute with NumPy and refuse every implicit crossing between the host and
the device, as CuPy does (stricter). Every preset runs there as on the host, so the crossings the GPU needs are
all explicit; tests/oracle/test_cupy.py runs CuPy's own kernels on a CUDA machine."""

from __future__ import annotations

import numpy as np
import pytest
import strict_device
from gguf_writer import T, write_gguf

from refimpl.arrays import DEVICE_ENV, resolve_device
from refimpl.errors import InputError
from refimpl.model import Gemma4
from refimpl.synth import PRESETS


def test_the_stand_in_refuses_what_cupy_refuses(monkeypatch):
    cp = strict_device.install(monkeypatch)
    a = cp.asarray(np.arange(6.0).reshape(2, 3))
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError, match=r"a host numpy.ndarray \[3\] given to the device's ufunc add"):
        a + np.ones(3)
    with pytest.raises(TypeError, match=r"a host numpy.ndarray \[1\] given to the device's indexing"):
        a[np.array([1])]
    with pytest.raises(TypeError, match=r"given to the device's concatenate"):
        np.concatenate([a, np.ones((1, 3))])
    assert isinstance(np.exp(a), cp.ndarray) and isinstance(a @ a.T, cp.ndarray) and isinstance(a.sum(), cp.ndarray)
    assert np.array_equal((a * 2.0).get(), np.arange(6.0).reshape(2, 3) * 2.0)  # numpy scalars and floats are fine
    assert type(cp.asnumpy(a[cp.asarray(np.array([1]))])) is np.ndarray


@pytest.mark.parametrize("kv_cache", ["exact", "f16"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_runs_under_the_device_rules(preset_dirs, monkeypatch, preset, kv_cache):
    """Each preset's prefill, decode steps and pruned rows on the stand-in device: NumPy arrays back, equal to the
    host model's within the rounding of two float64 evaluations (the device multiplies a weight whole where the
    host streams it in blocks)."""
    cp = strict_device.install(monkeypatch)
    cpu = Gemma4(preset_dirs[preset], kv_cache=kv_cache, device="cpu")
    gpu = Gemma4(preset_dirs[preset], kv_cache=kv_cache, device="cuda")
    assert gpu.xp is cp and isinstance(gpu.weights["norm.weight"], cp.ndarray)
    strict_device.assert_device_is_host(cpu, gpu)


def test_refimpl_device_names_the_device_of_a_model_not_given_one(preset_dirs, monkeypatch):
    strict_device.install(monkeypatch)
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert resolve_device() == "cuda" and Gemma4(preset_dirs["e2b-mini"]).device == "cuda"
    assert Gemma4(preset_dirs["e2b-mini"], device="cpu").device == "cpu"  # a device given wins
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(InputError, match=r"^REFIMPL_DEVICE must be one of cpu, cuda, got 'gpu'$"):
        Gemma4(preset_dirs["e2b-mini"])
    monkeypatch.delenv(DEVICE_ENV)
    assert resolve_device() == "cpu"


def test_a_gpu_out_of_memory_is_one_line(preset_dirs, monkeypatch, tmp_path, capsys):
    """CuPy's OutOfMemoryError in a forward: one line naming the allocation, the memory free, and how to ask for
    less; exit 2 from the command line, nothing written."""
    from refimpl.cli import main

    strict_device.install(monkeypatch, capacity=4096)  # (the miniature's projections are 16 KB and more)
    out = tmp_path / "l.safetensors"
    assert main(["logits", "--model", str(preset_dirs["e2b-mini"]), "--tokens", "2,17,30", "--out", str(out),
                 "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refimpl: error: device cuda: out of GPU memory (Out of memory allocating ") and err.endswith(
        " bytes (allocated so far: 0 bytes).; 0.0 of 80.0 GiB free): keep fewer weights there (a smaller weight "
        "cache, REFIMPL_WEIGHT_CACHE; the cache now holds 0.0 GiB), ask for fewer rows or tokens at once, or use "
        "device cpu\n") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("preset", ["e2b-mini", "26b-a4b-mini", "31b-mini"])
def test_weights_kept_as_stored_where_their_decoded_copies_do_not_fit(preset_dirs, monkeypatch, preset):
    """A weight cache under the decoded matrices' bytes but over their stored bytes (the minis store F32: half):
    keep "stored", whole tensors copied to the device once and decoded at each use, no float64 copy kept, the
    budget never passed, the logits the host's."""
    strict_device.install(monkeypatch)
    probe = Gemma4(preset_dirs[preset], device="cuda", weight_cache="all")
    strict_device.model_outputs(probe, list(range(3, 26)))
    decoded = probe.weights.cache_bytes  # every matrix the forward multiplies by, in float64
    assert probe.weights.keep == "decoded" and not probe.weights.resident
    budget = int(0.75 * decoded)
    cpu = Gemma4(preset_dirs[preset], device="cpu")
    gpu = Gemma4(preset_dirs[preset], device="cuda", weight_cache=budget)
    assert gpu.weights.keep == "stored"
    strict_device.assert_device_is_host(cpu, gpu)
    w = gpu.weights
    assert not w.cache and w.resident and w.cache_bytes <= budget
    assert w.cache_bytes >= decoded // 2  # (every matrix is there as stored)
    assert Gemma4(preset_dirs[preset], device="cuda", weight_cache=decoded).weights.keep == "decoded"


def test_the_auto_weight_cache_takes_most_of_the_free_gpu_memory(preset_dirs, monkeypatch):
    cp = strict_device.install(monkeypatch)
    monkeypatch.setattr(cp.cuda.runtime, "memGetInfo", lambda: (10 * 2**30, 80 * 2**30))
    assert Gemma4(preset_dirs["e2b-mini"], device="cuda", weight_cache="auto").weights.cache_budget == 8 * 2**30
    assert Gemma4(preset_dirs["e2b-mini"], device="cpu", weight_cache="auto").weights.cache_budget == 0
    monkeypatch.setenv("REFIMPL_WEIGHT_CACHE", "auto")
    assert Gemma4(preset_dirs["e2b-mini"], device="cuda").weights.cache_budget == 8 * 2**30


@pytest.mark.parametrize("keep", ["decoded", "stored", "decoded from a Q8_0 GGUF", "decoded from an MLX q4-g32"])
def test_the_moe_experts_cross_to_the_device_once(preset_dirs, monkeypatch, tmp_path, keep):
    """The MoE experts, gathered an expert at a time (``Gemma4Weights.rows``), are kept by the weight cache as the
    matrices are (decoded, or resident as stored; a GGUF's or MLX checkpoint's decoded on the host once): after
    the first forwards no forward reads them from the checkpoint again, and the logits are the host's. (They
    crossed at every use before: the 26B-A4B cuts' text sets grew about 13 s a layer on an H100.)"""
    strict_device.install(monkeypatch)
    directory = preset_dirs["26b-a4b-mini"]
    if keep.endswith("GGUF"):
        directory = write_gguf(directory, tmp_path / "moe-q8_0.gguf", T.Q8_0)
    if keep.endswith("q4-g32"):
        pytest.importorskip("mlx_lm")  # (mlx-lm quantises it: a heavy engine, imported here)
        from mlx_convert import quantise
        directory = quantise(directory, tmp_path / "mlx", 4, 32)
    probe = Gemma4(directory, device="cuda", weight_cache="all")
    strict_device.model_outputs(probe, list(range(3, 26)))
    assert probe.weights.keep == "decoded"
    assert any(".experts." in key[0] for key in probe.weights.cache)  # the experts are in the decoded budget
    budget = int(0.75 * probe.weights.cache_bytes) if keep == "stored" else "all"
    cpu = Gemma4(directory, device="cpu")
    gpu = Gemma4(directory, device="cuda", weight_cache=budget)
    assert gpu.weights.keep == keep.split()[0]
    store, reads = gpu.weights.store, []

    def recorded(read):
        def reading(full, *args, **kwargs):
            reads.append(full)
            return read(full, *args, **kwargs)
        return reading

    for method in ("raw", "read", "rows"):  # what reads a tensor from the checkpoint
        if hasattr(store, method):
            monkeypatch.setattr(store, method, recorded(getattr(store, method)))
    strict_device.assert_device_is_host(cpu, gpu)  # the first forwards fill the cache
    assert [full for full in reads if ".experts." in full]
    reads.clear()
    strict_device.assert_device_is_host(cpu, gpu)
    assert not [full for full in reads if ".experts." in full]
