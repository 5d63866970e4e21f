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

from conformance.backends.llama_cpp import convert, library, options
from conformance.backends.llama_cpp import engine as eng
from conformance.check.profiles import PROFILES
from conformance.protocol import BackendError, Request

try:
    SOURCE = library.resolve_source()
except BackendError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"llama.cpp converter sources missing: {exc}", allow_module_level=True)

from conformance.backends.llama_cpp.backend import LlamaCppBackend

HAVE_EXACT = (library.EXACT_GELU_LIB / "libllama.so").is_file()
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
    from refimpl.synth import SPECIAL_PIECES, make_weights, preset_config, train_tokenizer

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
    pytest.param({"kv_type": "f32", "lib": "exact-gelu"}, "llama-cpp-f32kv-exact-gelu-embd", "fp32",
                 id="exact-gelu-f32kv",
                 marks=pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library "
                                          "(scripts/build-llama-cpp.sh --exact-gelu)")),
]


@pytest.mark.parametrize("options, name, profile", CONFIGS)
def test_subset_passes_through_the_subprocess(gguf_cache, tmp_path, options, name, profile):
    """Every request kind through LlamaCppBackend, graded with the expectations the configuration
    ships (embeddings=true: the PLE checkpoints' embeddings cases are known failures)."""
    from conformance.cli import main

    argv = ["check", "--backend", "llama-cpp", "-q", "--match", SUBSET, "--json", str(tmp_path / "r.json"),
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
    # hidden_states: every returned row (decode steps included) has its final-norm state graded beside it
    for c in report["cases"]:
        if c["status"] == "pass":
            logits = [r for r in c["rows"] if not r["label"].endswith(" hidden")]
            hidden = [r for r in c["rows"] if r["label"].endswith(" hidden")]
            assert len(hidden) == len(logits) and {r["status"] for r in hidden} == {"pass"}, c["id"]


MTP_CONFIGS = [
    pytest.param({"kv_type": "f16"}, "llama-cpp-f16kv", ("M0", "M1"), id="stock-f16kv"),
    pytest.param({"kv_type": "f32", "lib": "exact-gelu"}, "llama-cpp-f32kv-exact-gelu", ("M0", "M1", "M2", "M3"),
                 id="exact-gelu-f32kv", marks=pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library")),
]


@pytest.mark.parametrize("options, name, generate_xfail", MTP_CONFIGS)
def test_mtp_sets_through_the_subprocess(gguf_cache, tmp_path, options, name, generate_xfail):
    """The bundled MTP sets: convention target-cache/P is claimed, the others are not; the dense-head drafter
    passes every case, the centroid-head drafter's are the shipped known failures (no centroid head)."""
    from conformance.cli import main

    argv = ["check", "--backend", "llama-cpp", "-q", "--match", r"^(e2b|12b)-assistant-mini/mtp/.*/M[0-3]/",
            "--json", str(tmp_path / "r.json")]
    for k, v in options.items():
        argv += ["--backend-option", f"{k}={v}"]
    code = main(argv)
    report = json.loads((tmp_path / "r.json").read_text())
    status = {c["id"]: c["status"] for c in report["cases"]}
    assert code == 0 and len(status) == 96 and report["backend"]["name"] == name
    for cid, st in status.items():
        if not cid.endswith("/target-cache/P"):
            want = "not-claimed"
        elif cid.startswith("12b-"):
            want = "pass"
        else:
            want = "xfail" if "/rounds/" in cid or cid.split("/")[3] in generate_xfail else "pass"
        assert st == want, (cid, st)
    ex = next(c["executed"] for c in report["cases"] if c["id"] == "12b-assistant-mini/mtp/generate/M1/target-cache/P")
    assert ex["convention"] == "target-cache/P" and ex["drafter_context"]["ctx_type"] == "LLAMA_CONTEXT_TYPE_MTP"
    assert ex["draft_positions"] == [p for p, k in zip(ex["positions"], ex["drafts_per_round"], strict=True) if k]
    assert ex["positions"][0] == 15 and ex["decode_calls"][0] == {"tokens": 15, "outputs": 1, "seq_ids": [0]}


@pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library (scripts/build-llama-cpp.sh --exact-gelu)")
def test_mtp_matches_the_oracle(gguf_cache, tmp_path):
    """Both MTP modes on a dense-head pair against refimpl.mtp under target-cache/P: a prompt past the window
    (8), a partial acceptance, a rejection, a round without drafts."""
    from conformance.protocol import MtpRequest, MtpRound
    from refimpl.assistant import Drafter
    from refimpl.model import Gemma4
    from refimpl.mtp import assisted_greedy, run_rounds
    from refimpl.synth import write_checkpoint

    pair = write_checkpoint("12b-assistant-mini", 0, tmp_path / "pair")
    drafter = str(pair / "assistant")
    target, oracle_drafter = Gemma4(pair), Drafter(drafter)
    prompt = (2, 17, 300, 45, 99, 120, 7, 8, 9, 10, 11, 12)
    ref = assisted_greedy(target, oracle_drafter, prompt, 10, 3)
    out = ref.output
    rounds = (MtpRound(out[0], (out[1], out[2], 5), 2), MtpRound(out[3], (7, 8, 9), 0), MtpRound(out[4], (), 0))
    forced = run_rounds(target, oracle_drafter, prompt, [(r.token, r.drafts, r.accepted) for r in rounds])
    b = LlamaCppBackend(kv_type="f32", lib="exact-gelu")
    try:
        b.open(pair)
        gen = b.run(Request(kind="mtp", tokens=prompt, drafter=drafter, hidden=True,
                            mtp=MtpRequest("generate", "target-cache/P", 3, 10)))
        white = b.run(Request(kind="mtp", tokens=prompt, drafter=drafter, hidden=True,
                              mtp=MtpRequest("rounds", "target-cache/P", 3, 10, rounds)))
    finally:
        b.close()
    assert gen.mtp.output == out and gen.mtp.accepted == [r.accepted for r in ref.rounds]
    assert [tuple(d) for d in gen.mtp.drafts] == [r.drafts for r in ref.rounds]
    assert np.abs(gen.hidden - ref.prefill_hidden).max() < 1e-5
    m = white.mtp
    assert m.output == forced.output and m.accepted == [r.accepted for r in forced.rounds] == [2, 0, 0]
    assert [tuple(d) for d in m.drafts] == [r.draft_argmax for r in forced.rounds]
    for got, r in zip(zip(m.draft_logits, m.verify_logits, m.verify_hidden, strict=True), forced.rounds, strict=True):
        for a, want in zip(got, (r.draft_logits, r.verify_logits, r.verify_hidden), strict=True):
            assert a.shape == want.shape and (a.size == 0 or np.abs(a - want).max() < 1e-4)
    assert white.executed["kept"] == [2, 0, 0] and white.executed["positions"] == [12, 15, 16]


def test_a_drafter_must_be_an_assistant(tmp_path, e2b_dir):
    from conformance.backends.llama_cpp.mtp import check_assistant

    with pytest.raises(BackendError) as err:
        check_assistant(e2b_dir)
    assert str(err.value) == (f"llama-cpp backend: {e2b_dir} is not a Gemma 4 assistant (model_type 'gemma4_text'; "
                              f"expected one of gemma4_assistant, gemma4_unified_assistant)")
    with pytest.raises(BackendError, match="cannot read the drafter's config.json"):
        check_assistant(tmp_path)


def test_staging_api_names_a_missing_symbol():
    """llama-ext.h's functions are reached by their C++ names; a library without one fails at open, named."""
    from types import SimpleNamespace

    from conformance.backends.llama_cpp.ext import SYMBOLS, Ext

    lib = SimpleNamespace(_name="/x/libllama.so")
    with pytest.raises(BackendError) as err:
        Ext(SimpleNamespace(llama_cpp=SimpleNamespace(_lib=lib)))
    name, (mangled, _, _) = next(iter(SYMBOLS.items()))
    assert str(err.value) == f"llama-cpp backend: /x/libllama.so exports no {name} ({mangled}, src/llama-ext.h)"


def test_names_profiles_and_shipped_expectations():
    from conformance.check.expectations import load

    assert options.config_name("f16", "stock") == "llama-cpp-f16kv"
    assert options.config_name("f32", "stock") == "llama-cpp-f32kv"
    assert options.config_name("f32", "exact-gelu") == "llama-cpp-f32kv-exact-gelu"
    assert options.config_name("f32", "exact-gelu", flash_attn=True, embeddings=True) == \
        "llama-cpp-f32kv-exact-gelu-fa-embd"
    # the default configurations pass every claimed text case; they declare e2b-assistant-mini's MTP cases
    # (no centroid head in llama.cpp) and mtp-layout-mini's (its positional KV-sharing rule aborts), the -embd
    # ones also the PLE presets' input-embeddings cases, the f16-KV ones e2b-ple-eps-mini's quiet token decoded alone
    for name in ("llama-cpp-f16kv", "llama-cpp-f32kv", "llama-cpp-f32kv-exact-gelu"):
        quiet = name == "llama-cpp-f16kv"
        for suffix, n in (("", 3 + quiet), ("-embd", 4 + quiet)):
            ex = load(options.expectations_for(name + suffix))
            assert quiet == any(e.match.startswith("^e2b\\-ple\\-eps\\-mini/") for e in ex.entries)
            assert ex.backend == name + suffix and [e.action for e in ex.entries] == ["known-failure"] * n
            assert all("assistant\\-mini/mtp/" in e.match and e.match.startswith("^e2b") for e in ex.entries[-3:-1])
            assert ex.entries[-1].match == "^mtp\\-layout\\-mini/mtp/" and "GGML_ASSERT" in ex.entries[-1].reason
    assert options.expectations_for("llama-cpp-f32kv-exact-gelu-fa") is None
    caps = options.capabilities_for("fp32", False)
    assert caps.hidden_states and caps.mtp and caps.mtp_generate and caps.mtp_conventions == "target-cache/P"
    assert options.default_profile_for("f16", "stock") == "fp16-kv"
    assert options.default_profile_for("f32", "stock") == "fp16-kv"  # the fp16 GELU table stays
    assert options.default_profile_for("f32", "exact-gelu") == "fp32"
    assert options.default_profile_for("f16", "exact-gelu") == "fp16-kv"
    assert options.default_profile_for("f32", "exact-gelu", flash_attn=True) == "fp16-kv"  # K/V cast to f16


# ----------------------------------------------------------------------------------------------
# conversion


def test_gguf_cache_hit_on_second_open(tmp_path, e2b_dir):
    cache = tmp_path / "cache"
    path, info = convert.convert_to_gguf(e2b_dir, SOURCE, "f32", cache)
    assert info["cached"] is False and path.is_file() and path.parent == cache
    mtime = path.stat().st_mtime_ns
    path2, info2 = convert.convert_to_gguf(e2b_dir, SOURCE, "f32", cache)
    assert info2["cached"] is True and path2 == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in cache.glob("*.gguf")] == [path.name]
    # the key is the content, not the directory: a copy elsewhere hits the same file
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in e2b_dir.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    assert convert.convert_to_gguf(copy, SOURCE, "f32", cache)[1]["cached"] is True
    # another outtype or other weights are another key
    assert convert.gguf_cache_key(copy, SOURCE, "f16")[0] != info["key"]
    blob = bytearray((copy / "model.safetensors").read_bytes())
    blob[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(blob))
    assert convert.gguf_cache_key(copy, SOURCE, "f32")[0] != info["key"]


def test_default_cache_location(gguf_cache, e2b_dir):
    key, _ = convert.gguf_cache_key(e2b_dir, SOURCE, "f32")
    path, _ = convert.convert_to_gguf(e2b_dir, SOURCE, "f32")
    assert path == gguf_cache / "gguf" / f"{key}.gguf"
    assert convert.convert_to_gguf(e2b_dir, SOURCE, "f32")[1]["cached"] is True


def test_tokenizer_json_keeps_vocab_size(tmp_path, e2b_dir):
    before = sorted(p.name for p in e2b_dir.iterdir())
    out = convert.make_tokenizer_json(e2b_dir, tmp_path / "t", 512)
    tok = json.loads((out / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 512 and tok["model"]["type"] == "BPE" and tok["model"]["byte_fallback"]
    assert max(t["id"] for t in tok["added_tokens"]) < 512
    assert (out / "model.safetensors").is_symlink() and not (out / "config.json").is_symlink()
    assert sorted(p.name for p in e2b_dir.iterdir()) == before  # nothing written into the checkpoint
    with pytest.raises(BackendError, match=r"has 512 tokens .* the config's vocab_size is 600; the GGUF converter "
                                           r"needs exactly vocab_size"):
        convert.make_tokenizer_json(e2b_dir, tmp_path / "t2", 600)


# ----------------------------------------------------------------------------------------------
# crash isolation


def test_abort_is_an_error_and_the_next_case_runs(gguf_cache, altpat_dir, e2b_dir):
    from conformance.protocol.wire import EngineCrash

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
    ({"multi_decode": "parallel"}, "llama-cpp backend: multi_decode must be one of interleaved, batched, got "
                                   "'parallel'"),
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

    with pytest.raises(BackendError, match=re.escape("backend 'llama-cpp': llama-cpp backend: kv_type must be 'f16' or "
                                                     "'f32', got 'f8'")):
        load_backend("llama-cpp", kv_type="f8")
