"""Tests of the safetensors reader/writer (``refimpl.safetensors_io``) and of checkpoint validation
(``refimpl.weights``): round trips, interop with the ``safetensors`` library and torch, lazy memory
maps, sharded / conditional / stale-tensor / BF16 checkpoints, and the exact text of every error for
malformed input.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refimpl import safetensors_io
from refimpl.cli import main as cli_main
from refimpl.config import load_config
from refimpl.errors import WeightsError
from refimpl.model import Gemma4
from refimpl.safetensors_io import TensorStore, bf16_to_f32, f32_to_bf16, write_safetensors
from refimpl.synth import write_checkpoint
from refimpl.weights import Gemma4Weights

IDS = [2, 17, 300, 45, 9, 101, 250, 33, 7, 480, 64, 12]  # > sliding window 8 of the presets


# ----------------------------------------------------------------------------------------------
# helpers and fixtures


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """Synthetic checkpoints written once per session."""
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "e2b": write_checkpoint("e2b-mini", 3, root / "e2b"),
        "e2b_cond": write_checkpoint("e2b-mini", 3, root / "e2b_cond", layout="conditional"),
        "e2b_bf16": write_checkpoint("e2b-mini", 3, root / "e2b_bf16", dtype="bf16"),
        "31b": write_checkpoint("31b-mini", 5, root / "31b"),
        "31b_cond": write_checkpoint("31b-mini", 5, root / "31b_cond", layout="conditional"),
        "all": write_checkpoint("all-features", 7, root / "all"),
    }


@pytest.fixture(scope="session")
def ref_logits(ckpts):
    return {k: Gemma4(ckpts[k]).forward(IDS) for k in ("e2b", "31b", "all")}


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_all(model_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint as float32 / int64 copies (the synth checkpoints store F32)."""
    store = TensorStore(model_dir)
    return {n: np.array(store.raw(n)) for n in store.names}


def rewrite(model_dir: Path, tensors: dict[str, np.ndarray]) -> None:
    (model_dir / "model.safetensors").unlink()
    write_safetensors(model_dir / "model.safetensors", tensors, "F32")


def raw_file(header: dict, data: bytes = b"", header_len: int | None = None) -> bytes:
    blob = json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    return struct.pack("<Q", n) + blob + data


def err(fn, *args, exc=WeightsError) -> str:
    with pytest.raises(exc) as e:
        fn(*args)
    return str(e.value)


def header_of(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8:8 + n])


# ----------------------------------------------------------------------------------------------
# round trips and interop


def test_round_trip_all_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 7))
    ints = rng.integers(-2**62, 2**62, size=(4, 3), dtype=np.int64)
    cases = {}
    for dt in ("F32", "F16", "BF16", "F64"):
        path = tmp_path / f"{dt}.safetensors"
        write_safetensors(path, {"x": x, "i": ints, "scalar": np.float64(1.5), "empty": np.zeros((0, 3))}, dt)
        store_dir = tmp_path / dt
        store_dir.mkdir()
        path.rename(store_dir / "model.safetensors")
        cases[dt] = TensorStore(store_dir)
    assert cases["F64"].infos["x"].dtype == "F64"
    assert np.array_equal(cases["F64"].get("x"), x)
    assert np.array_equal(cases["F32"].get("x", np.float32), x.astype(np.float32))
    assert np.array_equal(cases["F16"].get("x", np.float32), x.astype(np.float16).astype(np.float32))
    # BF16 expectation computed independently: round-half-even on the float32 bit pattern, in Python ints
    f32 = x.astype(np.float32).ravel()
    expect = []
    for u in f32.view(np.uint32).tolist():
        hi, lo = u >> 16, u & 0xFFFF
        if lo > 0x8000 or (lo == 0x8000 and hi & 1):
            hi += 1
        expect.append(hi)
    expect = np.array(expect, dtype=np.uint32) << 16
    assert np.array_equal(cases["BF16"].get("x", np.float32).ravel().view(np.uint32), expect)
    for dt, store in cases.items():
        assert store.infos["x"].dtype == dt and store.infos["x"].shape == (3, 5, 7)
        assert store.infos["i"].dtype == "I64"
        assert store.raw("i").dtype == np.dtype("<i8")
        assert np.array_equal(store.raw("i"), ints)
        assert store.infos["scalar"].shape == () and store.get("scalar") == 1.5
        assert store.get("empty").shape == (0, 3)


def test_writer_is_deterministic_and_aligned(tmp_path):
    t = {"b": np.ones(3), "a": np.arange(5, dtype=np.int64)}
    write_safetensors(tmp_path / "1.safetensors", t, "F32", metadata={"format": "pt"})
    write_safetensors(tmp_path / "2.safetensors", dict(reversed(list(t.items()))), "F32", metadata={"format": "pt"})
    b1 = (tmp_path / "1.safetensors").read_bytes()
    assert b1 == (tmp_path / "2.safetensors").read_bytes()
    n, header = header_of(tmp_path / "1.safetensors")
    assert (8 + n) % 8 == 0
    assert header["__metadata__"] == {"format": "pt"}
    assert list(header) == ["__metadata__", "a", "b"]


def test_writer_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"^unsupported dtype 'I8'$"):
        write_safetensors(tmp_path / "x.safetensors", {"x": np.ones(2)}, "I8")


def _store_of(tmp_path: Path, write) -> TensorStore:
    d = tmp_path / "store"
    d.mkdir(exist_ok=True)
    write(d / "model.safetensors")
    return TensorStore(d)


@pytest.mark.parametrize("np_dtype,st_dtype", [(np.float32, "F32"), (np.float16, "F16")])
def test_safetensors_library_files_read_exactly(tmp_path, np_dtype, st_dtype):
    st_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(1)
    tensors = {"w": rng.normal(size=(17, 9)).astype(np_dtype), "v": rng.normal(size=(4,)).astype(np_dtype),
               "ids": np.arange(10, dtype=np.int64).reshape(2, 5)}
    store = _store_of(tmp_path, lambda p: st_numpy.save_file(tensors, str(p), metadata={"format": "np"}))
    assert store.infos["w"].dtype == st_dtype
    for name, value in tensors.items():
        got = store.raw(name)
        assert got.dtype == value.dtype and got.shape == value.shape
        assert np.array_equal(got, value)
    assert np.array_equal(store.get("w", np.float64), tensors["w"].astype(np.float64))


@pytest.mark.parametrize("np_dtype,st_dtype", [(np.float32, "F32"), (np.float16, "F16"), (np.float64, "F64")])
def test_write_safetensors_read_by_safetensors_library(tmp_path, np_dtype, st_dtype):
    st_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 11)).astype(np_dtype)
    ids = rng.integers(0, 1000, size=(3,)).astype(np.int64)
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"x": x, "ids": ids}, st_dtype, metadata={"k": "v"})
    loaded = st_numpy.load_file(str(path))
    assert loaded["x"].dtype == np_dtype and np.array_equal(loaded["x"], x)
    assert loaded["ids"].dtype == np.int64 and np.array_equal(loaded["ids"], ids)


def _torch_bf16(x: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    return torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).to(torch.float32).numpy()


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(3)
    random_vals = np.concatenate([
        rng.normal(size=20000) * 10.0 ** rng.integers(-30, 30, size=20000),
        rng.uniform(-4, 4, size=5000),
    ]).astype(np.float32)
    # exact ties: a bf16 value plus half an ulp (low 16 bits 0x8000), odd and even upper halves
    upper = rng.integers(0, 0x7F7F, size=5000, dtype=np.uint32)
    ties = ((upper << 16) | 0x8000).view(np.float32)
    near_ties = np.concatenate([((upper << 16) | 0x7FFF), ((upper << 16) | 0x8001)]).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38,
                        3.3961776e38, 65504.0], dtype=np.float32)
    x = np.concatenate([random_vals, ties, -ties, near_ties, special])
    got = bf16_to_f32(f32_to_bf16(x))
    want = _torch_bf16(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_bf16_rounding_in_blocks_equals_the_one_pass_formula(monkeypatch):
    """f32_to_bf16 rounds BF16_BLOCK values at a time: over many blocks (a small block here, a last one
    partial) and a shape of two axes, every value equals the formula applied to the whole array at once,
    NaNs of either sign and any payload at block edges included."""
    monkeypatch.setattr(safetensors_io, "BF16_BLOCK", 64)
    rng = np.random.default_rng(8)
    bits = rng.integers(0, 2**32, size=(7, 45), dtype=np.uint64).astype(np.uint32)
    bits.reshape(-1)[[0, 63, 64, 127, 200, 314]] = [0x7FC00000, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800000,
                                                    0x7F7FFFFF]  # NaNs, +inf, the largest finite
    want = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    want[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    got = f32_to_bf16(bits.view(np.float32))
    assert got.shape == (7, 45) and got.dtype == np.uint16
    assert np.array_equal(got, want)
    assert f32_to_bf16(np.zeros(0, np.float32)).shape == (0,)


def test_bf16_hand_cases():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1.0, -2.0], dtype=np.float32)
    got = bf16_to_f32(f32_to_bf16(x))
    assert got.tolist() == [1.0, 1 + 2**-6, 1.0, -2.0]
    assert f32_to_bf16(x).tolist() == [0x3F80, 0x3F82, 0x3F80, 0xC000]
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x4049], dtype=np.uint16)
    dec = bf16_to_f32(bits)
    assert dec.dtype == np.float32
    assert dec[:6].tolist() == [1.0, -2.0, np.inf, -np.inf, 0.0, -0.0]
    assert np.signbit(dec[5])
    assert dec[6] == 3.140625
    assert np.isnan(bf16_to_f32(np.array([0x7FC0], dtype=np.uint16)))[0]


def test_bf16_nan_stays_nan():
    x = np.array([0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0x7F80FFFF], dtype=np.uint32).view(np.float32)
    assert np.isnan(_torch_bf16(x)).all()
    assert np.isnan(bf16_to_f32(f32_to_bf16(x))).all()


def test_torch_written_bf16_decoded_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(33, 7, generator=g) * 3).to(torch.bfloat16)
    e = torch.tensor([1.0, -2.0, float("inf"), 1 + 2**-7, 3.140625]).to(torch.bfloat16)
    store = _store_of(tmp_path, lambda p: st_torch.save_file({"w": w, "e": e}, str(p)))
    assert store.infos["w"].dtype == "BF16"
    assert np.array_equal(store.raw("w"), w.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(store.get("w", np.float32), w.to(torch.float32).numpy())
    assert np.array_equal(store.get("w", np.float64), w.to(torch.float64).numpy())
    assert store.get("e").tolist() == [1.0, -2.0, np.inf, 1 + 2**-7, 3.140625]


def test_write_bf16_read_by_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    x = np.random.default_rng(4).normal(size=(5, 6)).astype(np.float32)
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"x": x}, "BF16")
    loaded = st_torch.load_file(str(path))["x"]
    assert loaded.dtype == torch.bfloat16
    assert np.array_equal(loaded.to(torch.float32).numpy(), _torch_bf16(x))


# ----------------------------------------------------------------------------------------------
# lazy memory mapping


def test_raw_is_a_view_of_the_memory_map(ckpts):
    store = TensorStore(ckpts["e2b"])
    name = "model.embed_tokens.weight"
    raw = store.raw(name)
    # walk the base chain down to the read-only mmap.mmap of the file
    base = raw
    while isinstance(base, np.ndarray):
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    assert isinstance(base, mmap.mmap), "raw() is not backed by a memory map"
    whole = np.frombuffer(base, dtype=np.uint8)
    assert np.shares_memory(raw, whole)
    assert not raw.flags.owndata
    assert not raw.flags.writeable  # opened read-only
    # the same view is not copied on a second call either
    assert np.shares_memory(store.raw(name), whole)
    # and the decoded tensor is a new array
    got = store.get(name)
    assert not np.shares_memory(got, whole)
    assert got.shape == raw.shape


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_DONTNEED")
                    or not hasattr(os, "preadv"),
                    reason="needs Linux /proc/self/smaps, madvise and preadv")
def test_decoded_tensors_do_not_stay_mapped_in(ckpts, tmp_path):
    """get, read and row slices read the file without mapping it; a gather reads the map and hands the
    tensor's pages back (the resident set is the decoded working set), and every read is unchanged."""
    big = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    path = tmp_path / "big.safetensors"
    write_safetensors(path, {"w": big, "e": big[:64]})
    store = TensorStore(path)
    first = store.get("w")
    assert np.array_equal(first, big.astype(np.float64))
    assert np.array_equal(store.rows("w", slice(3, 9)), big[3:9].astype(np.float64))
    assert np.array_equal(store.read("w", 500, 512), big[500:].astype(np.float64))
    assert _resident_kib(path) == 0  # never mapped in
    raw = store.raw("w")
    touched = int(raw[::256].sum())  # fault pages in without decoding through the store
    assert touched is not None and _resident_kib(path) > 0
    assert np.array_equal(store.rows("w", [7, 2, 7]), big[[7, 2, 7]].astype(np.float64))
    assert _resident_kib(path) <= 8  # at most the header page and a page shared with the next tensor


def test_read_into_a_given_buffer(tmp_path):
    """read(out=...) fills a caller's buffer (reused from call to call by the weights) with the same values;
    a buffer of the wrong shape, dtype or layout is refused."""
    bits = np.random.default_rng(2).integers(0, 1 << 16, (40, 33), dtype=np.uint16)
    bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits).astype(np.uint16)  # no inf/NaN
    path = tmp_path / "b.safetensors"
    write_safetensors(path, {"w": bf16_to_f32(bits)}, dtype="BF16")
    store = TensorStore(path)
    out = np.full((10, 33), np.nan)
    assert store.read("w", 5, 15, out=out) is out
    assert np.array_equal(out, bf16_to_f32(bits[5:15]).astype(np.float64))
    assert np.array_equal(store.read("w", dtype=np.float32), bf16_to_f32(bits))
    for bad in (np.empty((9, 33)), np.empty((10, 33), np.float32), np.empty((33, 10)).T):
        with pytest.raises(ValueError, match=r"out must be a contiguous float64 array of shape \[10, 33\]"):
            store.read("w", 5, 15, out=bad)
    with pytest.raises(IndexError):
        store.read("w", 30, 41)


@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_decode_in_blocks_and_threads_is_exact(monkeypatch, threads):
    """Large BF16 tensors are decoded a block at a time, on several threads: the same bits as the plain
    decode (every bit pattern but NaNs, whose payload may differ)."""
    import refimpl.safetensors_io as sio
    from refimpl.threads import use_threads

    bits = np.random.default_rng(1).integers(0, 1 << 16, 30 * sio.DECODE_BLOCK + 5, dtype=np.uint16)
    bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits).astype(np.uint16)  # no inf/NaN exponent
    with use_threads(threads):
        got = sio.decode(bits.reshape(5, -1) if bits.size % 5 == 0 else bits, "BF16", np.float64)
    want = bf16_to_f32(bits).astype(np.float64).reshape(got.shape)
    assert np.array_equal(got.view(np.uint64), want.view(np.uint64))


def test_rows_reads_only_requested_rows(ckpts):
    store = TensorStore(ckpts["e2b"])
    name = "model.embed_tokens.weight"
    full = store.get(name)
    assert np.array_equal(store.rows(name, [5, 1, 5]), full[[5, 1, 5]])
    assert np.array_equal(store.rows(name, slice(10, 13)), full[10:13])


# ----------------------------------------------------------------------------------------------
# sharded, conditional, stale tensors, BF16 checkpoints


def make_sharded(src: Path, dst: Path, n_shards: int = 3) -> dict[str, str]:
    copy_ckpt(src, dst)
    tensors = read_all(dst)
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for k in range(n_shards):
        shard = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = names[k::n_shards]
        write_safetensors(dst / shard, {n: tensors[n] for n in part}, "F32")
        weight_map.update({n: shard for n in part})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2))
    return weight_map


@pytest.mark.parametrize("key", ["e2b", "all"])
def test_sharded_checkpoint_same_logits(ckpts, ref_logits, tmp_path, key):
    weight_map = make_sharded(ckpts[key], tmp_path / "sharded")
    assert len(set(weight_map.values())) == 3
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    model = Gemma4(tmp_path / "sharded")
    assert {info.path.name for info in model.weights.store.infos.values()} == set(weight_map.values())
    assert np.array_equal(model.forward(IDS), ref_logits[key])


def test_conditional_layout_same_logits(ckpts, ref_logits):
    for cond, causal in (("e2b_cond", "e2b"), ("31b_cond", "31b")):
        model = Gemma4(ckpts[cond])
        assert model.cfg.architecture == "Gemma4ForConditionalGeneration"
        assert model.weights.prefix == "model.language_model."
        assert model.cfg.layers == load_config(ckpts[causal]).layers
        assert np.array_equal(model.forward(IDS), ref_logits[causal])


def test_stale_kv_tensors_on_shared_layers_ignored(ckpts, ref_logits, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "stale")
    tensors = read_all(d)
    cfg = load_config(d)
    assert [layer.index for layer in cfg.layers if not layer.owns_kv] == [5, 6, 7, 8, 9]
    rng = np.random.default_rng(9)
    stale = []
    for layer in cfg.layers[5:]:
        D, K = layer.head_dim, layer.num_kv_heads
        for leaf, shape in (("k_proj.weight", (K * D, 64)), ("v_proj.weight", (K * D, 64)), ("k_norm.weight", (D,))):
            name = f"model.layers.{layer.index}.self_attn.{leaf}"
            assert name not in tensors
            tensors[name] = rng.normal(size=shape).astype(np.float32) * 100  # would wreck the logits if used
            stale.append(name)
    rewrite(d, tensors)
    model = Gemma4(d)
    assert sorted(model.weights.ignored) == sorted(stale)
    assert np.array_equal(model.forward(IDS), ref_logits["e2b"])


def test_multimodal_tower_tensors_ignored(ckpts, ref_logits, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "mm")
    tensors = read_all(d)
    tensors["model.vision_tower.patch.weight"] = np.ones((3, 4), np.float32)
    tensors["model.embed_audio.proj.weight"] = np.ones((2,), np.float32)
    rewrite(d, tensors)
    model = Gemma4(d)
    assert sorted(model.weights.ignored) == ["model.embed_audio.proj.weight", "model.vision_tower.patch.weight"]
    assert np.array_equal(model.forward(IDS), ref_logits["e2b"])


def test_untied_lm_head_is_used(ckpts, ref_logits, tmp_path):
    d = copy_ckpt(ckpts["31b"], tmp_path / "untied")
    tensors = read_all(d)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    rewrite(d, tensors)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    model = Gemma4(d)
    assert model.weights.head_name == "lm_head.weight"
    assert np.array_equal(model.forward(IDS), ref_logits["31b"])
    # a different head changes the logits: the head really is read
    tensors["lm_head.weight"] = tensors["lm_head.weight"][::-1].copy()
    rewrite(d, tensors)
    assert not np.array_equal(Gemma4(d).forward(IDS), ref_logits["31b"])


def test_bf16_checkpoint_is_f32_rounded(ckpts):
    f32 = TensorStore(ckpts["e2b"])
    bf16 = TensorStore(ckpts["e2b_bf16"])
    assert sorted(f32.names) == sorted(bf16.names)
    cfg = load_config(ckpts["e2b_bf16"])
    weights = Gemma4Weights(ckpts["e2b_bf16"], cfg)
    assert weights.storage_dtypes == {"BF16": len(bf16.names)}
    changed = 0
    for name in f32.names:
        assert bf16.infos[name].dtype == "BF16"
        x = np.array(f32.raw(name))
        assert x.dtype == np.float32
        want = _torch_bf16(x)
        got = bf16.get(name, np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
        assert np.array_equal(weights[name[len("model."):]], want.astype(np.float64)), name
        changed += int(not np.array_equal(got, x))
    assert changed > len(f32.names) // 2  # the rounding really happened
    logits = Gemma4(ckpts["e2b_bf16"]).forward(IDS)
    assert np.isfinite(logits).all()


# ----------------------------------------------------------------------------------------------
# malformed input: exact messages


def mismatch(d: Path, *lines: str) -> str:
    return f"{d}: the weights do not match config.json:\n  " + "\n  ".join(lines)


def test_error_missing_tensor(ckpts, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "m")
    tensors = read_all(d)
    del tensors["model.layers.3.self_attn.q_norm.weight"]
    rewrite(d, tensors)
    assert err(Gemma4, d) == mismatch(d, "missing tensor 'model.layers.3.self_attn.q_norm.weight' (expected shape "
                                         "[16])")


def test_error_missing_embedding(ckpts, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "m")
    tensors = read_all(d)
    del tensors["model.embed_tokens.weight"]
    rewrite(d, tensors)
    assert err(Gemma4, d) == (
        f"{d}: missing tensor 'embed_tokens.weight' (looked for 'model.language_model.embed_tokens.weight' "
        "and 'model.embed_tokens.weight'); is this a Gemma 4 checkpoint?"
    )


def test_error_unexpected_tensor(ckpts, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "u")
    tensors = read_all(d)
    tensors["model.layers.2.self_attn.v_bias"] = np.zeros(16, np.float32)
    rewrite(d, tensors)
    assert err(Gemma4, d) == mismatch(
        d, "model.safetensors: unexpected tensor 'model.layers.2.self_attn.v_bias' (not part of this config's text "
           "decoder)")


def test_error_kv_on_owning_layer_of_k_eq_v_is_unexpected(ckpts, tmp_path):
    # 31b-mini: layer 5 is a full K=V layer, it must not carry v_proj
    d = copy_ckpt(ckpts["31b"], tmp_path / "kv")
    tensors = read_all(d)
    tensors["model.layers.5.self_attn.v_proj.weight"] = np.zeros((32, 64), np.float32)
    rewrite(d, tensors)
    assert err(Gemma4, d) == mismatch(
        d, "model.safetensors: unexpected tensor 'model.layers.5.self_attn.v_proj.weight' "
           "(not part of this config's text decoder)")


def test_error_misshaped_tensor(ckpts, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "s")
    tensors = read_all(d)
    tensors["model.layers.4.self_attn.q_proj.weight"] = np.zeros((64, 64), np.float32)  # full layer: [4*32, 64]
    rewrite(d, tensors)
    assert err(Gemma4, d) == mismatch(
        d, "model.safetensors: tensor 'model.layers.4.self_attn.q_proj.weight' has shape [64, 64], expected [128, 64]")


def test_error_integer_weights(ckpts, tmp_path):
    """Quantized (integer) storage is refused, not decoded as if the integers were the weights."""
    d = copy_ckpt(ckpts["e2b"], tmp_path / "q")
    tensors = read_all(d)
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((128, 64), np.uint8)
    rewrite(d, tensors)
    assert err(Gemma4, d) == mismatch(
        d, "model.safetensors: tensor 'model.layers.2.mlp.up_proj.weight' is stored as U8; the oracle reads float "
           "weights (F32, BF16, F16, F64), not quantized ones")


def test_error_misshaped_tensor_in_shard_names_the_shard(ckpts, tmp_path):
    d = tmp_path / "sh"
    weight_map = make_sharded(ckpts["e2b"], d)
    name = "model.layers.7.mlp.up_proj.weight"  # shared layer: double-wide 256
    shard = weight_map[name]
    tensors = {n: np.array(TensorStore(d).raw(n)) for n, s in weight_map.items() if s == shard}
    tensors[name] = np.zeros((128, 64), np.float32)
    write_safetensors(d / shard, tensors, "F32")
    assert err(Gemma4, d) == mismatch(
        d, f"{shard}: tensor '{name}' has shape [128, 64], expected [256, 64]")


def test_error_many_problems_truncated_list(ckpts, tmp_path):
    d = copy_ckpt(ckpts["31b"], tmp_path / "many")
    tensors = read_all(d)
    for i in range(10):
        tensors[f"model.extra.{i}"] = np.zeros(1, np.float32)
    rewrite(d, tensors)
    lines = [f"model.safetensors: unexpected tensor 'model.extra.{i}' (not part of this config's text decoder)"
             for i in range(8)]
    assert err(Gemma4, d) == mismatch(d, *lines, "... and 2 more")


def test_error_untied_head_missing(ckpts, tmp_path):
    d = copy_ckpt(ckpts["31b"], tmp_path / "untied")
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    assert err(Gemma4, d) == mismatch(
        d, "missing tensor 'lm_head.weight' (expected shape [512, 64]; the config sets tie_word_embeddings to false)")


def test_error_misshaped_lm_head(ckpts, tmp_path):
    d = copy_ckpt(ckpts["31b"], tmp_path / "head")
    tensors = read_all(d)
    tensors["lm_head.weight"] = np.zeros((511, 64), np.float32)
    rewrite(d, tensors)
    assert err(Gemma4, d) == mismatch(d, "model.safetensors: tensor 'lm_head.weight' has shape [511, 64], expected "
                                         "[512, 64]")


def test_error_truncated_file(ckpts, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "t")
    path = d / "model.safetensors"
    n, header = header_of(path)
    data = path.read_bytes()
    path.write_bytes(data[:-6])
    data_size = len(data) - 6 - 8 - n
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    b, e = header[last]["data_offsets"]
    assert e == len(data) - 8 - n
    assert err(Gemma4, d) == (
        f"{path}: tensor '{last}': file is truncated: the tensor needs bytes [{b}, {e}) of the data section "
        f"but it holds {data_size} bytes"
    )


def test_error_header_length_larger_than_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, 10_000))
    size = path.stat().st_size
    assert err(TensorStore, tmp_path) == (
        f"{path}: corrupt safetensors header: it declares a 10000-byte header but the file has {size} bytes "
        "(truncated or not a safetensors file)"
    )


def test_error_header_not_json(tmp_path):
    path = tmp_path / "model.safetensors"
    blob = b"{not json"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert err(TensorStore, tmp_path) == (
        f"{path}: corrupt safetensors header: not valid JSON "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    )


def test_error_header_not_object(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file([1, 2]))  # type: ignore[arg-type]
    assert err(TensorStore, tmp_path) == f"{path}: corrupt safetensors header: expected a JSON object"


def test_error_unsupported_dtype(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"x": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4))
    assert err(TensorStore, tmp_path) == (
        f"{path}: tensor 'x': dtype 'I8' is not supported (use one of U8, U32, I64, F64, F32, F16, BF16)"
    )


def test_error_data_offsets_inconsistent_with_shape(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, b"\0" * 24))
    assert err(TensorStore, tmp_path) == (
        f"{path}: tensor 'x': corrupt header: shape [2, 3] of F32 needs 24 bytes but data_offsets span 20"
    )


def test_error_data_offsets_reversed(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 8))
    assert err(TensorStore, tmp_path) == f"{path}: tensor 'x': corrupt data_offsets [4, 0]"


def test_error_header_entry_missing_fields(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"x": {"dtype": "F32", "shape": [1]}}, b"\0" * 4))
    assert err(TensorStore, tmp_path) == (
        f"{path}: tensor 'x': corrupt header entry (needs dtype, shape and data_offsets): "
        "{'dtype': 'F32', 'shape': [1]}"
    )


def test_error_corrupt_shape(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4))
    assert err(TensorStore, tmp_path) == f"{path}: tensor 'x': corrupt shape [-1]"


@pytest.mark.parametrize("size", [0, 5])
def test_error_file_shorter_than_8_bytes(tmp_path, size):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\1" * size)
    assert err(TensorStore, tmp_path) == f"{path}: corrupt safetensors header: the file has only {size} bytes"


def test_error_index_points_at_missing_shard(ckpts, tmp_path):
    d = tmp_path / "sh"
    weight_map = make_sharded(ckpts["e2b"], d)
    shard = "model-00002-of-00003.safetensors"
    (d / shard).unlink()
    first = next(n for n, s in weight_map.items() if s == shard)  # the index is read in weight_map order
    assert err(Gemma4, d) == (
        f"{d / 'model.safetensors.index.json'}: tensor '{first}' is mapped to shard '{shard}', which does not exist"
    )


def test_error_index_names_tensor_absent_from_shard(ckpts, tmp_path):
    d = tmp_path / "sh"
    make_sharded(ckpts["e2b"], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.ghost.weight"] = "model-00001-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert err(Gemma4, d) == (
        f"{d / 'model-00001-of-00003.safetensors'}: tensor 'model.layers.0.ghost.weight' is listed in "
        "model.safetensors.index.json but not stored in this shard"
    )


def test_error_corrupt_index(ckpts, tmp_path):
    d = tmp_path / "sh"
    make_sharded(ckpts["e2b"], d)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert err(Gemma4, d) == (
        f"{d / 'model.safetensors.index.json'}: corrupt index: expected a JSON object with a 'weight_map' object"
    )


def test_error_directory_without_weights(ckpts, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "now")
    (d / "model.safetensors").unlink()
    assert err(Gemma4, d) == (
        f"{d}: no model.safetensors or model.safetensors.index.json; a checkpoint directory must hold its weights"
    )


def test_cli_inspect_reports_error_without_traceback(ckpts, tmp_path, capsys):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "cli")
    (d / "model.safetensors").unlink()
    msg = f"{d}: no model.safetensors or model.safetensors.index.json; a checkpoint directory must hold its weights"
    assert cli_main(["inspect", "--model", str(d)]) == 2
    out, errtext = capsys.readouterr()
    assert out == ""
    assert errtext == f"refimpl: error: {msg}\n"


def test_cli_subprocess_exit_code_2(ckpts, tmp_path):
    d = copy_ckpt(ckpts["e2b"], tmp_path / "cli")
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5])
    proc = subprocess.run([sys.executable, "-m", "refimpl.cli", "inspect", "--model", str(d)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"refimpl: error: {path}: corrupt safetensors header: the file has only 5 bytes\n"
    assert "Traceback" not in proc.stderr


def test_cli_inspect_ok_on_valid_checkpoint(ckpts, capsys):
    assert cli_main(["inspect", "--model", str(ckpts["e2b_cond"]), "--json"]) == 0
    out, errtext = capsys.readouterr()
    info = json.loads(out)
    assert info["tensor_prefix"] == "model.language_model."
    assert [r["kv_source"] for r in info["layers"]] == [0, 1, 2, 3, 4, 3, 3, 3, 3, 4]
    assert [r["ffn_width"] for r in info["layers"]] == [128] * 5 + [256] * 5
    assert errtext == ""


def test_error_index_shard_not_a_string(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": 5}}))
    assert err(TensorStore, tmp_path) == (
        f"{index}: corrupt index: weight_map entry 'model.norm.weight' must name a shard file, got 5"
    )


def test_error_overlapping_data_offsets(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                               "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
    assert err(TensorStore, tmp_path) == (
        f"{path}: tensor 'b': corrupt header: its bytes [0, 4) overlap tensor 'a' (data ends at 4)"
    )


def test_error_gap_and_trailing_bytes(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8))
    assert err(TensorStore, tmp_path) == (
        f"{path}: tensor 'a': corrupt header: 4 unused bytes before it (the data section must be contiguous)"
    )
    path.write_bytes(raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 6))
    assert err(TensorStore, tmp_path) == f"{path}: corrupt safetensors file: 2 bytes after the last tensor"


def test_error_shard_outside_the_directory(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    assert err(TensorStore, tmp_path) == (
        f"{index}: corrupt index: weight_map entry 'model.norm.weight' names '../elsewhere.safetensors', which is "
        "not a file name in the checkpoint directory"
    )


def test_error_tensor_in_shard_but_not_in_index(tmp_path):
    shard = tmp_path / "part-1.safetensors"
    shard.write_bytes(raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
    assert err(TensorStore, tmp_path) == (
        f"{shard}: tensor 'b' is stored in this shard but not listed in model.safetensors.index.json; "
        "add it to the weight_map"
    )
