"""The llama-cpp backend: llama.cpp (llama-cpp-python 0.3.36) behind the subprocess protocol.

Needs llama-cpp-python and the llama.cpp sources with the GGUF converter (scripts/build-llama-cpp.sh
builds and installs both; ``--exact-gelu`` adds the exact-GELU library). GGUF files are cached in a
temporary directory per session, so the first test that opens a preset converts it (~5-15 s).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build-llama-cpp.sh)")

from conformance.backend import BackendError, Request
from conformance.backends import llama_cpp_engine as eng
from conformance.check.profiles import PROFILES

try:
    SOURCE = eng.resolve_source()
except BackendError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"llama.cpp converter sources missing: {exc}", allow_module_level=True)

from conformance.backends.llama_cpp_backend import LlamaCppBackend

HAVE_EXACT = (eng.EXACT_GELU_LIB / "libllama.so").is_file()
S, F = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """One GGUF cache for the module (the children inherit GEMMA4_CONFORMANCE_CACHE)."""
    root = tmp_path_factory.mktemp("llama-cache")
    old = os.environ.get("GEMMA4_CONFORMANCE_CACHE")
    os.environ["GEMMA4_CONFORMANCE_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("GEMMA4_CONFORMANCE_CACHE", None)
    else:
        os.environ["GEMMA4_CONFORMANCE_CACHE"] = old


@pytest.fixture(scope="module")
def e2b_dir(tmp_path_factory):
    from refimpl.synth import write_checkpoint

    return write_checkpoint("e2b-mini", 0, tmp_path_factory.mktemp("ckpt") / "e2b-mini")


@pytest.fixture(scope="module")
def altpat_dir(tmp_path_factory):
    """A checkpoint whose KV-owning prefix ends in [full, sliding]: HF's by-type KV sharing accepts
    it, llama.cpp's positional rule (full -> n_unshared-1, sliding -> n_unshared-2) aborts."""
    from refimpl.safetensors_io import write_safetensors
    from refimpl.synth import (
        SPECIAL_PIECES,
        make_weights,
        preset_config,
        train_tokenizer,
    )

    out = tmp_path_factory.mktemp("ckpt") / "altpat"
    out.mkdir()
    cfg = preset_config("e2b-mini", SPECIAL_PIECES.index("<turn|>") + 4)
    cfg.update(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2,
               use_double_wide_mlp=False)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_safetensors(out / "model.safetensors", {"model." + k: v for k, v in make_weights(cfg, 0).items()}, "F32")
    (out / "tokenizer.model").write_bytes(train_tokenizer())
    return out


# ----------------------------------------------------------------------------------------------
# the shipped configurations through the subprocess backend

SUBSET = (r"^(e2b-mini|26b-a4b-mini)/(full/B|last/plain/A/T19/pos9|last/seq_id/B/T19|last/embeddings/C/T19/pos9"
          r"|prefill/A/T19/rows-all/ub5|prefill/B/T20/none-then-last|prefill/A/T21/chunks|multi/A-T3\+B-T8\+C-T13)")
CONFIGS = [
    pytest.param({"kv_type": "f16"}, "llama-cpp-f16kv-embd", "fp16-kv", id="stock-f16kv"),
    pytest.param({"kv_type": "f32", "lib": "exact-gelu"}, "llama-cpp-f32kv-exact-gelu-embd", "fp32", id="exact-gelu-f32kv",
                 marks=pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library "
                                          "(scripts/build-llama-cpp.sh --exact-gelu)")),
]


@pytest.mark.parametrize("options, name, profile", CONFIGS)
def test_subset_passes_through_the_subprocess(gguf_cache, tmp_path, options, name, profile):
    """Every request kind through LlamaCppBackend, graded with the expectations the configuration
    ships (embeddings=true: the PLE checkpoints' embeddings cases are known failures)."""
    from conformance.cli import main

    argv = ["check", "--backend", "llama-cpp", "-q", "-k", SUBSET, "--json", str(tmp_path / "r.json"),
            "--backend-option", "embeddings=true"]
    for k, v in options.items():
        argv += ["--backend-option", f"{k}={v}"]
    code = main(argv)
    report = json.loads((tmp_path / "r.json").read_text())
    status = {c["id"]: c["status"] for c in report["cases"]}
    bad = [(c["id"], c["status"], c["message"]) for c in report["cases"]
           if c["status"] != ("xfail" if c["id"].startswith("e2b-mini/last/embeddings/") else "pass")]
    assert code == 0 and not bad, bad
    assert len(status) == 18 and sum(s == "xfail" for s in status.values()) == 1
    assert report["backend"]["name"] == name and report["profile"]["name"] == profile
    assert report["expectations"]["path"].endswith(f"expectations/{name}.json")
    ex = next(c["executed"] for c in report["cases"] if c["id"] == "e2b-mini/prefill/A/T19/rows-all/ub5")
    assert ex["context"]["n_ubatch"] == 5 and ex["ubatches"] == [5, 5, 5, 4] and ex["fresh_state"] is True
    assert ex["decode_calls"][0] == {"tokens": 19, "outputs": 19, "seq_ids": [0]}
    assert ex["state_len_after_prefill"] == 19
    multi = next(c["executed"] for c in report["cases"] if c["id"] == "e2b-mini/multi/A-T3+B-T8+C-T13")
    assert multi["decode_calls"][0] == {"tokens": 24, "outputs": 3, "seq_ids": [3, 4, 5]}
    assert multi["state_len_after_prefill"] == [3, 8, 13]
    last = next(c["executed"] for c in report["cases"] if c["id"] == "e2b-mini/last/seq_id/B/T19/pos9")
    assert last["decode_calls"][0]["outputs"] == 1 and last["state_len_after_prefill"] == 19


def test_names_profiles_and_shipped_expectations():
    from conformance.check.expectations import load

    assert eng.config_name("f16", "stock") == "llama-cpp-f16kv"
    assert eng.config_name("f32", "stock") == "llama-cpp-f32kv"
    assert eng.config_name("f32", "exact-gelu") == "llama-cpp-f32kv-exact-gelu"
    assert eng.config_name("f32", "exact-gelu", flash_attn=True, embeddings=True) == "llama-cpp-f32kv-exact-gelu-fa-embd"
    # the default configurations pass all 220 claimed cases: nothing to declare, no file
    for name in ("llama-cpp-f16kv", "llama-cpp-f32kv", "llama-cpp-f32kv-exact-gelu"):
        assert eng.expectations_for(name) is None
    for name in ("llama-cpp-f16kv-embd", "llama-cpp-f32kv-embd", "llama-cpp-f32kv-exact-gelu-embd"):
        ex = load(eng.expectations_for(name))
        assert ex.backend == name and [e.action for e in ex.entries] == ["known-failure"]
    assert eng.default_profile_for("f16", "stock") == "fp16-kv"
    assert eng.default_profile_for("f32", "stock") == "fp16-kv"  # the fp16 GELU table stays
    assert eng.default_profile_for("f32", "exact-gelu") == "fp32"
    assert eng.default_profile_for("f16", "exact-gelu") == "fp16-kv"
    assert eng.default_profile_for("f32", "exact-gelu", flash_attn=True) == "fp16-kv"  # K/V cast to f16


# ----------------------------------------------------------------------------------------------
# conversion


def test_gguf_cache_hit_on_second_open(tmp_path, e2b_dir):
    cache = tmp_path / "cache"
    path, info = eng.convert_to_gguf(e2b_dir, SOURCE, "f32", cache)
    assert info["cached"] is False and path.is_file() and path.parent == cache
    mtime = path.stat().st_mtime_ns
    path2, info2 = eng.convert_to_gguf(e2b_dir, SOURCE, "f32", cache)
    assert info2["cached"] is True and path2 == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in cache.glob("*.gguf")] == [path.name]
    # the key is the content, not the directory: a copy elsewhere hits the same file
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in e2b_dir.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    assert eng.convert_to_gguf(copy, SOURCE, "f32", cache)[1]["cached"] is True
    # another outtype or other weights are another key
    assert eng.gguf_cache_key(copy, SOURCE, "f16")[0] != info["key"]
    blob = bytearray((copy / "model.safetensors").read_bytes())
    blob[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(blob))
    assert eng.gguf_cache_key(copy, SOURCE, "f32")[0] != info["key"]


def test_default_cache_location(gguf_cache, e2b_dir):
    key, _ = eng.gguf_cache_key(e2b_dir, SOURCE, "f32")
    path, _ = eng.convert_to_gguf(e2b_dir, SOURCE, "f32")
    assert path == gguf_cache / "gguf" / f"{key}.gguf"
    assert eng.convert_to_gguf(e2b_dir, SOURCE, "f32")[1]["cached"] is True


def test_tokenizer_json_keeps_vocab_size(tmp_path, e2b_dir):
    before = sorted(p.name for p in e2b_dir.iterdir())
    out = eng.make_tokenizer_json(e2b_dir, tmp_path / "t", 512)
    tok = json.loads((out / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 512 and tok["model"]["type"] == "BPE" and tok["model"]["byte_fallback"]
    assert max(t["id"] for t in tok["added_tokens"]) < 512
    assert (out / "model.safetensors").is_symlink() and not (out / "config.json").is_symlink()
    assert sorted(p.name for p in e2b_dir.iterdir()) == before  # nothing written into the checkpoint
    with pytest.raises(BackendError, match=r"has 512 tokens .* the config's vocab_size is 600; the GGUF converter "
                                           r"needs exactly vocab_size"):
        eng.make_tokenizer_json(e2b_dir, tmp_path / "t2", 600)


# ----------------------------------------------------------------------------------------------
# crash isolation


def test_abort_is_an_error_and_the_next_case_runs(gguf_cache, altpat_dir, e2b_dir):
    from conformance.backends.subprocess_backend import EngineCrash

    b = LlamaCppBackend(kv_type="f32")
    try:
        b.open(altpat_dir)  # loading works; llama.cpp asserts when it builds the KV cache
        req = Request(kind="full", tokens=(2, 17, 300, 45, 99), decode=(5,))
        for _ in range(2):  # each case: the child aborts, the case is an error, the next one restarts it
            with pytest.raises(EngineCrash) as err:
                b.run(req)
            msg = str(err.value)
            assert "SIGABRT" in msg and "GGML_ASSERT(map_layer_ids.find(il_reuse) != map_layer_ids.end())" in msg
        b.close()
        b.open(e2b_dir)
        r = b.run(Request(kind="last", tokens=(2, 17, 300, 45, 99), last_pos=4, decode=(5, 6)))
        assert r.logits.shape == (1, 512) and r.decode_logits.shape == (2, 512)
        assert np.isfinite(r.logits).all() and r.executed["state_len_after_prefill"] == 5
        assert b.restarts >= 2
    finally:
        b.close()


# ----------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize("options, message", [
    ({"kv_type": "q4_0"}, "llama-cpp backend: kv_type must be 'f16' or 'f32', got 'q4_0'"),
    ({"threads": 0}, "llama-cpp backend: threads must be a positive integer, got 0"),
    ({"threads": "2"}, "llama-cpp backend: threads must be a positive integer, got '2'"),
    ({"outtype": "q4_k"}, "llama-cpp backend: outtype must be one of f32, f16, bf16, q8_0, got 'q4_k'"),
    ({"flash_attn": "maybe"}, "llama-cpp backend: flash_attn must be true or false, got 'maybe'"),
    ({"multi_decode": "parallel"}, "llama-cpp backend: multi_decode must be 'interleaved' or 'batched', got 'parallel'"),
    ({"default_profile": "fp8"}, (f"llama-cpp backend: default_profile must be one of {', '.join(PROFILES)}, "
                                  f"got 'fp8'")),
    ({"lib": "/nonexistent"}, ("llama-cpp backend: lib '/nonexistent' is neither 'stock', 'exact-gelu' nor a "
                               "directory holding libllama.so")),
])
def test_bad_options(options, message):
    with pytest.raises(BackendError) as err:
        LlamaCppBackend(**options)
    assert str(err.value) == message
    with pytest.raises(ValueError if "lib" not in options else BackendError) as err:
        eng.LlamaCppEngine(**options)
    assert str(err.value) == message


def test_missing_converter_says_how_to_get_it(tmp_path):
    with pytest.raises(BackendError) as err:
        LlamaCppBackend(source=str(tmp_path))
    assert str(err.value) == (
        f"llama-cpp backend: no llama.cpp converter at {tmp_path / 'convert_hf_to_gguf.py'} (source option "
        f"{str(tmp_path)!r}). Get the llama.cpp sources that match llama-cpp-python 0.3.36 with "
        f"scripts/build-llama-cpp.sh (it extracts the sdist to .cache/llama-cpp/src/), or point the 'source' "
        f"option or LLAMA_CPP_SOURCE at a llama.cpp tree")


def test_registry_wraps_a_bad_option():
    from conformance.registry import load_backend

    with pytest.raises(BackendError, match=re.escape("backend 'llama-cpp': the class raised BackendError: "
                                                     "llama-cpp backend: kv_type must be 'f16' or 'f32', got 'f8'")):
        load_backend("llama-cpp", kv_type="f8")
