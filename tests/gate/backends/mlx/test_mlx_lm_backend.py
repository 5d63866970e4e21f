"""The mlx-lm backend (``conformance.backends.mlx_lm.backend``): mlx-lm's own loader and prompt caches
behind the backend protocol.

Graded through the harness on two bundled sets (e2b-mini: PLE, MQA, KV sharing, double-wide MLP;
all-features: MoE, K=V, both sharing types), every request kind at the ``fp32`` profile; the config
patch against refimpl's derivation (per_layer_config, absent keys whose mlx-lm default differs, the
conditional layout); option errors message for message; and properties of the cache paths (an
interior row is the row of the full forward; chunk plans through the RotatingKVCache, chunks longer
than the window included, give the full forward's rows).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
from helpers import FULL, SLIDING, max_abs, micro_checkpoint, micro_config, tup

pytest.importorskip("mlx_lm")

import mlx.core as mx

from conformance import registry
from conformance.backends.mlx_lm.backend import EXPECTATIONS_DIR, MlxLmBackend, config_patch
from conformance.check.profiles import PROFILES
from conformance.check.runner import run
from conformance.protocol import Backend, BackendError, Piece, Request
from conformance.sets import bundled_set
from refimpl import Gemma4, load_config
from refimpl.synth import write_checkpoint

PRESETS = ("e2b-mini", "all-features")  # all-features has the MoE block
F32 = 2e-3  # float32 engine vs the float64 oracle on these presets (worst measured 4.6e-4)
W = 8


@pytest.fixture(scope="module")
def backends(preset_dirs):
    opened = {}
    for preset in PRESETS:
        b = MlxLmBackend()
        b.open(preset_dirs[preset])
        opened[preset] = b
    yield opened
    for b in opened.values():
        b.close()


# ----------------------------------------------------------------------------------------------
# the harness, every request kind


def test_bundled_sets_pass_at_fp32(tmp_path):
    backend = MlxLmBackend()
    result = run(backend, [bundled_set(p) for p in PRESETS], PROFILES["fp32"], workdir=tmp_path)
    assert [r.id for r in result.cases if r.status != "pass"] == []
    assert len(result.cases) == 2 * 52
    kinds = {(r.kind, r.entry) for r in result.cases}
    assert {k for k, _ in kinds} == {"full", "last", "prefill", "multi"}
    assert {e for k, e in kinds if k == "last"} == {"last:plain", "last:seq_id", "last:embeddings"}
    features = set().union(*(r.features for r in result.cases))
    assert {"interior", "ubatch", "no-output-ubatch", "chunked", "chunk>window", "no-output-piece",
            "multi", "decode", "moe", "ple", "kv-shared"} <= features
    assert result.exit_code == 0


# ----------------------------------------------------------------------------------------------
# identity, options, errors


def test_identity_capabilities_and_options():
    b = MlxLmBackend()
    assert isinstance(b, Backend)
    assert (b.name, b.dtype, b.capabilities.default_profile) == ("mlx-lm-float32", "float32", "fp32")
    claimed = b.capabilities.to_dict()
    assert claimed.pop("embedding_convention") == "raw"
    claimed.pop("default_profile")
    # mlx-lm is text only (media are mlx-vlm's)
    for media in ("image_prompts", "audio_prompts", "audio_tower", "image_tower", "video_prompts"):
        assert claimed.pop(media) is False
    for later in ("hidden_states", "mtp", "mtp_generate", "mtp_media", "mtp_batch"):  # not served (yet): backends.md
        assert claimed.pop(later) is False
    assert claimed.pop("mtp_conventions") == ""
    assert claimed.pop("weight_formats") == "safetensors,mlx-affine"  # a quantised directory as it is
    assert claimed.pop("activation_conventions") == "none"  # MLX multiplies the activations as they are
    assert claimed.pop("top_logprobs") is False  # whole logits rows
    assert all(v is True for v in claimed.values()), claimed
    assert b.expectations_file is None
    for dtype in ("bfloat16", "float16"):
        r = MlxLmBackend(dtype=dtype)
        assert (r.name, r.capabilities.default_profile) == (f"mlx-lm-{dtype}", "bf16")
        if mx.default_device().type == mx.cpu:
            assert r.expectations_file == EXPECTATIONS_DIR / f"mlx-lm-{dtype}.json"
    assert MlxLmBackend(default_profile="bf16").capabilities.default_profile == "bf16"


def test_bad_options_have_exact_messages():
    allowed = "float32, bfloat16, float16"
    with pytest.raises(ValueError) as e:
        MlxLmBackend(dtype="bf16")
    assert str(e.value) == f"mlx-lm backend: option dtype must be one of {allowed}, got 'bf16'"
    with pytest.raises(ValueError) as e:
        MlxLmBackend(dtype="float64")
    assert str(e.value) == (
        f"mlx-lm backend: option dtype must be one of {allowed} (float64 is not offered: mlx's CPU fast kernels "
        "compute in float32 and its gather_mm, used by MoE, accepts float32 only), got 'float64'")
    with pytest.raises(ValueError) as e:
        MlxLmBackend(default_profile="fp64")
    assert str(e.value) == ("mlx-lm backend: option default_profile must be one of "
                            + ", ".join(PROFILES) + ", got 'fp64'")
    with pytest.raises(BackendError) as e:
        registry.load_backend("mlx-lm", dtype="f16")
    assert str(e.value) == (f"backend 'mlx-lm': the class raised ValueError: mlx-lm backend: option dtype must be "
                            f"one of {allowed}, got 'f16'")
    with pytest.raises(RuntimeError, match=r"^mlx-lm backend: run\(\) called before open\(\)$"):
        MlxLmBackend().run(Request("full", tokens=(2, 3)))


def test_missing_mlx_gives_the_install_hint(monkeypatch):
    monkeypatch.delitem(sys.modules, "conformance.backends.mlx_lm.backend")
    monkeypatch.setitem(sys.modules, "mlx", None)
    with pytest.raises(BackendError) as e:
        registry.load_backend("mlx-lm")
    assert str(e.value) == ("backend 'mlx-lm': module 'conformance.backends.mlx_lm.backend' needs 'mlx', which is not "
                            "installed; install the 'mlx' extra: pip install 'gemma4-conformance[mlx]'")


def test_open_errors(tmp_path, preset_dirs, backends):
    with pytest.raises(BackendError, match=f"^mlx-lm backend cannot open {tmp_path}: "):
        MlxLmBackend().open(tmp_path)
    # a geometry mlx-lm cannot express: a full layer with its own KV head count without K=V
    cfg = micro_config(num_attention_heads=2, num_key_value_heads=1,
                       per_layer_config={"2": {"head_dim": 8, "num_key_value_heads": 2}})
    del cfg["global_head_dim"]
    with pytest.raises(BackendError, match=r"^mlx-lm backend: mlx_lm.utils.load_model cannot load .*: "
                                           r"ValueError: Expected shape"):
        MlxLmBackend().open(micro_checkpoint(tmp_path / "plc", cfg, 0))
    # the built model is checked against refimpl's derivation
    b = backends["e2b-mini"]
    good = b.text_config
    try:
        b.text_config = dataclasses.replace(good, sliding_window=4)
        with pytest.raises(BackendError, match="sliding_window: mlx-lm has 8, the config means 4"):
            b._verify_geometry()
    finally:
        b.text_config = good


@pytest.mark.skipif(mx.default_device().type != mx.cpu, reason="mlx's CPU build only")
def test_moe_in_bfloat16_is_a_clear_error(preset_dirs):
    b = MlxLmBackend(dtype="bfloat16")
    b.open(preset_dirs["all-features"])
    try:
        with pytest.raises(RuntimeError, match=r"MoE blocks.*gather_mm in float32 only.*\[GatherMM::eval\].*"
                                               r"cannot run this model in bfloat16 on this device; use dtype=float32"):
            b.run(Request("full", tokens=(2, 3)))
    finally:
        b.close()


# ----------------------------------------------------------------------------------------------
# the config patch


def _plc(**overrides) -> dict:
    """A transformers 5.23+-style config: per_layer_config instead of the legacy keys."""
    cfg = micro_config(**overrides)
    for key in ("global_head_dim", "num_global_key_value_heads"):
        cfg.pop(key)
    return cfg


PATCH_CASES = {
    # per_layer_config, K=V with its own global KV heads, absent layer_types (refimpl: 5:1 with the last
    # full; mlx-lm: 4:1), absent num_kv_shared_layers (mlx-lm: 20), absent softcap (mlx-lm: 30)
    "per_layer_config+defaults": (
        _plc(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2, attention_k_eq_v=True,
             per_layer_config={"5": {"head_dim": 8, "num_key_value_heads": 1}}),
        ("layer_types", "num_kv_shared_layers", "final_logit_softcapping"),
        {"global_head_dim", "num_global_key_value_heads", "layer_types", "num_kv_shared_layers",
         "final_logit_softcapping"}),
    # KV sharing with use_double_wide_mlp absent: refimpl (and transformers) false, mlx-lm true
    "double-wide default": (
        micro_config(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2,
                     hidden_size_per_layer_input=4),
        ("use_double_wide_mlp",), {"use_double_wide_mlp"}),
    # a last layer that is sliding: transformers and refimpl force it to full; mlx-lm would not
    "last layer forced full": (
        micro_config(layer_types=[SLIDING, FULL, SLIDING]), (), {"layer_types"}),
    # everything stated: nothing to patch
    "legacy, complete": (micro_config(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL],
                                      num_kv_shared_layers=2, use_double_wide_mlp=True), (), set()),
}


@pytest.mark.parametrize("name", list(PATCH_CASES))
def test_config_patch_is_refimpl_derivation(tmp_path, name):
    cfg, drop, expect_keys = PATCH_CASES[name]
    cfg = {k: v for k, v in cfg.items() if k not in drop}
    path = micro_checkpoint(tmp_path / "ckpt", cfg, 3)
    ref = load_config(path)
    patch = config_patch(json.loads((path / "config.json").read_text()), ref)
    assert set(patch) == expect_keys
    full = [layer for layer in ref.layers if layer.layer_type == FULL]
    derived = {"global_head_dim": full[0].head_dim, "num_global_key_value_heads": full[0].num_kv_heads,
               "layer_types": list(ref.layer_types), "num_kv_shared_layers": ref.num_kv_shared_layers,
               "final_logit_softcapping": ref.final_logit_softcapping,
               "use_double_wide_mlp": ref.use_double_wide_mlp}
    for key, change in patch.items():
        assert change["now"] == derived[key], key
        assert change["was"] == cfg.get(key, "absent"), key
    b = MlxLmBackend()
    b.open(path)
    try:
        assert b.config_patch == patch
        ids = tup(np.random.default_rng(0).integers(0, ref.vocab_size, 13))
        r = b.run(Request("full", tokens=ids, decode=(5, 6)))
        want = Gemma4(path).forward(np.asarray(ids + (5, 6)), rows="all")
        assert max_abs(r.logits, want[:13]) < F32 and max_abs(r.decode_logits, want[13:]) < F32
        assert r.executed["config_patch"] == patch
    finally:
        b.close()


def test_conditional_layout(tmp_path):
    path = write_checkpoint("31b-mini", 0, tmp_path / "cond", layout="conditional")
    b = MlxLmBackend()
    b.open(path)
    try:
        assert b.config_patch == {"<top>.vocab_size": {"was": "absent", "now": 512}}
        assert b.load_info["model_class"] == "mlx_lm.models.gemma4.Model"
        ids = tup(np.random.default_rng(1).integers(3, 512, 2 * W + 3))
        r = b.run(Request("last", tokens=ids, entry="seq_id", seq_id=4, last_pos=W, decode=(7, 8)))
        want = Gemma4(path).forward(np.asarray(ids + (7, 8)), rows="all")
        assert max_abs(r.logits, want[W:W + 1]) < F32 and max_abs(r.decode_logits, want[-2:]) < F32
    finally:
        b.close()


# ----------------------------------------------------------------------------------------------
# properties of the paths


@pytest.mark.parametrize("preset", PRESETS)
def test_interior_row_is_the_full_forward_row(backends, oracle_bases, preset):
    b = backends[preset]
    ids, ref = oracle_bases[preset][0]
    T, d = 2 * W + 5, 3
    full = b.run(Request("full", tokens=tup(ids[:T]), decode=tup(ids[T:T + d])))
    for pos in (0, W - 1, W, T - 2):
        r = b.run(Request("last", tokens=tup(ids[:T]), entry="plain", last_pos=pos, decode=tup(ids[T:T + d])))
        assert max_abs(r.logits, full.logits[pos:pos + 1]) < 1e-5, pos  # same call, one row selected
        assert max_abs(r.decode_logits, full.decode_logits) < 1e-5, pos  # the state holds all T tokens
        assert r.executed["state_len_after_prefill"] == T and r.executed["rows_computed"] == T
    assert max_abs(full.logits, ref[:T]) < F32


@pytest.mark.parametrize("preset", PRESETS)
def test_chunk_plans_through_the_rotating_cache(backends, oracle_bases, preset):
    b = backends[preset]
    ids, ref = oracle_bases[preset][1]
    caches = b.load_info["caches"]
    assert "RotatingKVCache" in caches and "KVCache" in caches
    for plan, ubatch in [((3, 2 * W + 1, 1, 1, W, 5), None), ((W + 1, W - 1, W, 1, 12), None), ((31,), 1),
                         ((17, 14), 6)]:
        pieces, expect, start = [], [], 0
        for n in plan:
            rows = (0, n - 1) if n > 1 else (0,)
            pieces.append(Piece(tup(ids[start:start + n]), rows))
            expect += [start + r for r in rows]
            start += n
        r = b.run(Request("prefill", pieces=tuple(pieces), ubatch=ubatch, decode=tup(ids[start:start + 4])))
        assert max_abs(r.logits, ref[expect]) < F32, plan
        assert max_abs(r.decode_logits, ref[start:start + 4]) < F32, plan
        assert r.executed["state_len_after_prefill"] == start


@pytest.mark.parametrize("preset", PRESETS)
def test_embeddings_entry_reads_raw_embeddings(backends, preset_models, oracle_bases, preset):
    b, model = backends[preset], preset_models[preset]
    ids, _ = oracle_bases[preset][2]
    T = 13
    scaled = model.embed(ids[:T]) * 1.01  # the oracle takes scaled embeddings
    want = model.forward(ids[:T], embeddings=scaled, rows="all")
    raw = scaled / np.sqrt(model.cfg.hidden_size)
    for pos in (T - 1, 4):
        r = b.run(Request("last", tokens=tup(ids[:T]), entry="embeddings", last_pos=pos, seq_id=0, embeddings=raw))
        assert max_abs(r.logits, want[pos:pos + 1]) < F32
        assert max_abs(r.logits, model.forward(ids[:T], rows=[pos])) > 1e-2


@pytest.mark.parametrize("preset", PRESETS)
def test_multi_sequences_keep_their_own_caches(backends, oracle_bases, preset):
    b = backends[preset]
    (a, ra), (c, rc) = oracle_bases[preset][0], oracle_bases[preset][2]
    lengths, dl = (W + 3, 5), (4, 2)
    r = b.run(Request("multi", sequences=(tup(a[:lengths[0]]), tup(c[:lengths[1]])), seq_ids=(9, 2),
                      decode=(tup(a[lengths[0]:lengths[0] + dl[0]]), tup(c[lengths[1]:lengths[1] + dl[1]]))))
    assert max_abs(r.logits, np.stack([ra[lengths[0] - 1], rc[lengths[1] - 1]])) < F32
    assert max_abs(r.decode_logits[0], ra[lengths[0]:lengths[0] + dl[0]]) < F32
    assert max_abs(r.decode_logits[1], rc[lengths[1]:lengths[1] + dl[1]]) < F32
    assert r.executed["state_len_after_prefill"] == list(lengths)


def test_bfloat16_dense(preset_dirs, oracle_bases):
    b = MlxLmBackend(dtype="bfloat16")
    b.open(preset_dirs["e2b-mini"])
    try:
        ids, ref = oracle_bases["e2b-mini"][0]
        r = b.run(Request("full", tokens=tup(ids[:9])))
        assert r.logits.dtype == np.float32 and r.executed["dtype"] == "bfloat16"
        assert 1e-3 < max_abs(r.logits, ref[:9]) < PROFILES["bf16"].max_abs  # bf16, not float32, and close
    finally:
        b.close()


def test_quantize_at_open_is_the_quantised_checkpoint(preset_dirs):
    """quantize="4:32" quantises at open with mlx-lm's own quantize_model: the same weights as the bundled MLX
    checkpoint mlx-lm's quantiser wrote from the same preset, so the same answer (float32 rounding of the same
    computation); a quantised checkpoint is loaded as it is (no requantisation); a malformed option is refused."""
    from conformance.sets import bundled_sets

    request = Request(kind="full", tokens=(2, 17, 300, 45, 9))
    own = next(p for p in bundled_sets() if p.name == "e2b-mini-mlx-q4") / "checkpoint"
    answers = {}
    for name, model_dir, options in (("at open", preset_dirs["e2b-mini"], {"quantize": "4:32"}),
                                     ("shipped", own, {}), ("shipped, option ignored", own, {"quantize": "8:64"})):
        b = MlxLmBackend(**options)
        b.open(model_dir)
        answers[name] = np.asarray(b.run(request).logits, dtype=np.float64)
        b.close()
    want = answers["shipped"]
    assert all(max_abs(a, want) <= 1e-5 * np.max(np.abs(want)) for a in answers.values())
    b = MlxLmBackend(quantize="4:32")
    assert (b.name, b.capabilities.default_profile) == ("mlx-lm-float32-q4-g32", "q4")
    assert MlxLmBackend(quantize="8:64").capabilities.default_profile == "q8"
    with pytest.raises(ValueError) as e:
        MlxLmBackend(quantize="4")
    assert str(e.value) == ("mlx-lm backend: option quantize must be '<bits>:<group size>' (bits 2, 3, 4, 5, 6 or 8, "
                            "or one of mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6; group size 32, 64 or 128), got '4'")
