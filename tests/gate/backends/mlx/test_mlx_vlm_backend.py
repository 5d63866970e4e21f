"""The mlx-vlm backend (``conformance.backends.mlx_vlm``): mlx-vlm's own loader, models and prompt caches
behind the backend protocol, image and audio prompts included, for Gemma 4 (``gemma4``, ``gemma4_text``)
and Gemma 4 Unified (``gemma4_unified``).

Graded through the harness on the bundled image and audio sets (e2b-vision-mini, 31b-vision-mini,
e2b-audio-mini) and the Unified set (12b-mini: text, image and audio), with mlx-vlm's own vision and
audio towers and Unified embedders: everything passes at ``fp32`` except the cases the shipped
expectations file records, and every entry of that file is used; and on a text set. The recorded
divergence is shown to be the vision mask alone (the spec's mask in mlx-vlm's place passes every image
case; against sets generated with the ``all-unclamped`` rule only the continued-piece cases fail); the
soft tokens are shown to be the towers' own (blanking the request's rows changes nothing); the config
patch (per_layer_config, ``"vision_config": null``, Unified's embedder keys) against refimpl's
derivation; option and checkpoint errors message for message.

MTP (mode ``generate``, mlx-vlm's own assisted decoding loop): the output is plain greedy decoding, and the
recorded rounds make it; the gate on the bundled assistant sets under the declared convention ``rotating/P-1``
and claiming ``target-cache/P`` and ``transformers/P``, as measured (the e2b target is a ``gemma4_text`` model,
on which mlx-vlm has no MTP: every case an error); every drafter state is refimpl's replaying mlx-vlm's rounds
with the keys ``mtp.py`` describes (on the e2b weights through the conditional layout too: its centroid head).

Measured on 2 cores: about 45 s (mlx-vlm's vision tower runs on the 90 image cases of the first test).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from helpers import FULL, SLIDING, max_abs, micro_checkpoint, micro_config, tup
from safetensors.numpy import load_file, save_file

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_vlm.generate import generate_step
from mlx_vlm.models.gemma4 import language as gemma4_language
from mlx_vlm.speculative.drafters.gemma4_assistant import Gemma4AssistantDraftModel

import refimpl.mtp as refimpl_mtp
from conformance import registry
from conformance.backends.mlx_vlm.backend import EXPECTATIONS_DIR, MlxVlmBackend
from conformance.backends.mlx_vlm.config import config_patch
from conformance.backends.mlx_vlm.families import family_for, geometry_problems
from conformance.check import expectations
from conformance.check.profiles import PROFILES
from conformance.check.requests import build_request
from conformance.check.runner import run
from conformance.generate import generate_set
from conformance.protocol import Backend, BackendError, Request
from conformance.sets import bundled_set, load_set
from refimpl import Gemma4, load_config
from refimpl.assistant import Drafter
from refimpl.model import LayerKV
from refimpl.synth import write_checkpoint

MEDIA = ("e2b-vision-mini", "31b-vision-mini", "e2b-audio-mini", "12b-mini")  # 12b-mini: Gemma 4 Unified
VISION_BLOCKS = ("31b-vision-mini", "12b-mini")  # use_bidirectional_attention "vision": the recorded divergence
TEXT = ("all-features",)  # MoE, K=V, PLE, KV sharing (12b-mini's text cases, in the media test: no PLE)
F32 = 2e-3


# ----------------------------------------------------------------------------------------------
# the harness on the bundled sets


def test_media_sets_pass_except_the_recorded_divergences(tmp_path):
    backend = MlxVlmBackend()
    shipped = expectations.load(backend.expectations_file)
    result = run(backend, [bundled_set(s) for s in MEDIA], PROFILES["fp32"], expectations=shipped, workdir=tmp_path)
    status = {s: sorted({r.status for r in result.cases if r.set == s}) for s in MEDIA}
    assert status == {"e2b-vision-mini": ["pass"], "e2b-audio-mini": ["pass"], "31b-vision-mini": ["xfail"],
                      "12b-mini": ["pass", "xfail"]}
    unified = {r.status: 0 for r in result.cases if r.set == "12b-mini"}
    for r in result.cases:
        if r.set == "12b-mini":
            unified[r.status] += 1
            assert (r.status == "xfail") == ("image" in r.features)  # its text and audio cases pass
    assert unified == {"pass": 82, "xfail": 30}
    assert len(result.cases) == 90 + 112 and result.exit_code == 0
    assert all(entry.matched for entry in shipped.entries if "_make_masks" in entry.reason)  # no stale mask entry
    features = set().union(*(r.features for r in result.cases))
    assert {"image", "audio", "vision-blocks", "inside-image", "inside-audio", "chunked", "decode", "ple"} <= features
    for what, n in (("image", 90), ("audio", 60)):  # mlx-vlm's own tower (embedder) ran on every media forward
        cases = [r for r in result.cases if what in r.features]
        rows = [u[f"{what}_rows_max_abs"] for r in cases for u in _forwards(r.executed) if f"{what}_rows_max_abs" in u]
        assert len(cases) == n and len(rows) >= len(cases) and max(rows) < 1e-3, what  # and agrees
    for r in result.cases:
        if r.status == "xfail":
            assert r.set in VISION_BLOCKS and r.check in ("max_abs", "identity") and "vision-blocks" in r.features


def _forwards(executed: dict) -> list[dict]:
    """The per-forward notes of an executed record (a prefill's micro-batches, or the one forward)."""
    if "pieces" in executed:
        return [u for piece in executed["pieces"] for u in piece["ubatches"]]
    return [executed]


def test_text_sets_pass_at_fp32(tmp_path):
    result = run(MlxVlmBackend(), [bundled_set(s) for s in TEXT], PROFILES["fp32"], workdir=tmp_path)
    assert [r.id for r in result.cases if r.status != "pass"] == []
    assert len(result.cases) == 52 and result.exit_code == 0
    assert {(r.kind, r.entry) for r in result.cases} >= {("last", "last:embeddings"), ("multi", "multi")}
    assert {"ubatch", "no-output-ubatch", "chunk>window", "moe", "ple", "kv-shared", "k=v"} <= set().union(
        *(r.features for r in result.cases))
    pruned = [u["logits_to_keep"] for r in result.cases for u in _forwards(r.executed)
              if u.get("logits_to_keep") not in (None, 0)]
    assert pruned  # mlx-vlm's own row pruning (before the KV-shared layers) was exercised


def _spec_masks(self, h, cache, mm_token_type_ids=None):
    """The spec's vision mask in mlx-vlm's place: sliding layers k > q - W AND (k <= q OR same block), full
    layers causal, on every forward (a cached prefix too); the key positions follow mlx-vlm's caches."""
    N = h.shape[1]
    if mm_token_type_ids is None or N == 1 or self.config.use_bidirectional_attention != "vision":
        return ORIGINAL_MASKS(self, h, cache, mm_token_type_ids)
    offset = mm_token_type_ids.shape[1] - N
    vis = np.isin(np.array(mm_token_type_ids[0]), (1, 2))
    start = vis & ~np.concatenate([[False], vis[:-1]])
    block = np.where(vis, np.cumsum(start) - 1, -1)
    W, out = self.window_size, []
    for layer in self.layers:
        q = np.arange(offset, offset + N)[:, None]
        sliding = layer.layer_type == SLIDING
        k = np.arange(offset - min(W - 1, offset) if sliding else 0, offset + N)[None]
        seen = k <= q
        if sliding:
            seen = (seen | ((block[q] >= 0) & (block[q] == block[k]))) & (k > q - W)
        out.append(mx.array(seen[None, None]))
    return out


ORIGINAL_MASKS = gemma4_language.Gemma4TextModel._make_masks


def test_the_recorded_divergence_is_the_vision_mask(tmp_path, monkeypatch):
    shipped = json.loads((EXPECTATIONS_DIR / "mlx-vlm-float32.json").read_text())
    masks = [e for e in shipped["entries"] if "_make_masks" in e["reason"]]
    video = [e for e in shipped["entries"] if "video" in e["match"]]  # the video sets' mask rule, one float32 row
    assert [e["action"] for e in video] == ["known-failure", "tolerance"]
    assert {e["action"] for e in shipped["entries"] if e not in video} == {"known-failure"}
    assert len(masks) == 3 and all("mtp" in e["match"] for e in shipped["entries"] if e not in masks + video)
    # mlx-vlm's rule is all-unclamped, except in a forward that continues a cache (the last mask entry's cases)
    continued = re.compile(masks[-1]["match"])
    for preset in VISION_BLOCKS:
        unclamped = tmp_path / f"{preset}-unclamped"
        generate_set(unclamped, preset=preset, seed=0, cases="images", vision_mask="all-unclamped", workers=1)
        result = run(MlxVlmBackend(image_tower="off"), [unclamped], PROFILES["fp32"], workdir=tmp_path)
        failing = [r.id for r in result.cases if r.status != "pass"]
        assert len(result.cases) == 30 and len(failing) == 4 and all(continued.search(i) for i in failing), failing
    # with the spec's rule in mlx-vlm's place, every image case of both bundled sets passes
    monkeypatch.setattr(gemma4_language.Gemma4TextModel, "_make_masks", _spec_masks)
    result = run(MlxVlmBackend(image_tower="off"), [bundled_set(s) for s in VISION_BLOCKS], PROFILES["fp32"],
                 select="/I[01]/",
                 workdir=tmp_path)
    assert [r.id for r in result.cases if r.status != "pass"] == []
    assert len(result.cases) == 60
    # and every video case of 12b-mini-video, its frames' masks by the same rule (the known-failure entry's claim)
    result = run(MlxVlmBackend(image_tower="off"), [bundled_set("12b-mini-video")], PROFILES["fp32"], workdir=tmp_path)
    assert [r.id for r in result.cases if r.status != "pass"] == [] and len(result.cases) == 30


# ----------------------------------------------------------------------------------------------
# identity, options, errors


def test_identity_capabilities_and_options():
    b = MlxVlmBackend()
    assert isinstance(b, Backend)
    assert (b.name, b.dtype, b.capabilities.default_profile) == ("mlx-vlm-float32", "float32", "fp32")
    claimed = b.capabilities.to_dict()
    assert claimed.pop("embedding_convention") == "scaled"
    assert claimed.pop("mtp_conventions") == "rotating/P-1"  # what mlx-vlm follows (mtp.py)
    claimed.pop("default_profile")
    assert claimed.pop("weight_formats") == "safetensors,mlx-affine"  # mlx_vlm.convert -q directories as they are
    assert claimed.pop("activation_conventions") == "none"  # MLX multiplies the activations as they are
    # image, video and audio prompts, both towers, MTP in mode generate; not the hidden rows nor the white-box rounds
    # (MTP after media and batched MTP: its loop takes one sequence and no given patches)
    assert {k for k, v in claimed.items() if v is not True} == {"hidden_states", "mtp", "traces", "mtp_media",
                                                                 "mtp_batch", "top_logprobs"}, claimed
    assert b.expectations_file == EXPECTATIONS_DIR / "mlx-vlm-float32.json"
    claim = MlxVlmBackend(mtp_convention="target-cache/P")
    assert (claim.name, claim.capabilities.mtp_conventions) == ("mlx-vlm-float32-mtp-target-cache-P", "target-cache/P")
    off = MlxVlmBackend(image_tower="off", audio_tower="off")
    caps = off.capabilities
    assert (off.name, caps.image_tower, caps.audio_tower, caps.image_prompts, caps.audio_prompts) == (
        "mlx-vlm-float32-image-tower-off-audio-tower-off", False, False, True, True)
    assert off.expectations_file == b.expectations_file  # the divergences are the vision mask's
    assert registry.available_backends()["mlx-vlm"] == "conformance.backends.mlx_vlm.backend:MlxVlmBackend"


def test_bad_options_have_exact_messages():
    with pytest.raises(ValueError) as e:
        MlxVlmBackend(dtype="bfloat16")
    assert str(e.value) == "mlx-vlm backend: option dtype must be one of float32, got 'bfloat16'"
    for tower in ("image_tower", "audio_tower"):
        with pytest.raises(ValueError) as e:
            MlxVlmBackend(**{tower: "auto"})
        assert str(e.value) == f"mlx-vlm backend: option {tower} must be one of on, off, got 'auto'"
    with pytest.raises(ValueError) as e:
        MlxVlmBackend(mtp_convention="mlx")
    assert str(e.value) == ("mlx-vlm backend: option mtp_convention must be one of "
                            + ", ".join(refimpl_mtp.CONVENTIONS) + ", got 'mlx'")
    with pytest.raises(ValueError) as e:
        MlxVlmBackend(default_profile="fp64")
    assert str(e.value) == ("mlx-vlm backend: option default_profile must be one of "
                            + ", ".join(PROFILES) + ", got 'fp64'")
    with pytest.raises(BackendError) as e:
        registry.load_backend("mlx-vlm", dtype="f16")
    assert str(e.value) == ("backend 'mlx-vlm': the class raised ValueError: mlx-vlm backend: option dtype must be "
                            "one of float32, got 'f16'")
    with pytest.raises(RuntimeError, match=r"^mlx-vlm backend: run\(\) called before open\(\)$"):
        MlxVlmBackend().run(Request("full", tokens=(2, 3)))


def test_missing_mlx_vlm_gives_the_install_hint(monkeypatch):
    class NotInstalled:  # mlx_vlm as if absent: every import of it fails the way a missing package does
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "mlx_vlm" or name.startswith("mlx_vlm."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    monkeypatch.delitem(sys.modules, "conformance.backends.mlx_vlm.backend")
    for name in [m for m in sys.modules if m == "mlx_vlm" or m.startswith("mlx_vlm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled(), *sys.meta_path])
    with pytest.raises(BackendError) as e:
        registry.load_backend("mlx-vlm")
    assert str(e.value) == ("backend 'mlx-vlm': module 'conformance.backends.mlx_vlm.backend' needs 'mlx_vlm', which "
                            "is not installed; install the 'mlx' extra: pip install 'gemma4-conformance[mlx]'")


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint ``src`` (weights linked) with config.json's top-level keys changed."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))
    return dst


def test_unsupported_checkpoints_are_one_line_errors(tmp_path):
    with pytest.raises(BackendError, match=f"^mlx-vlm backend cannot open {tmp_path}: "):
        MlxVlmBackend().open(tmp_path)
    src = write_checkpoint("e2b-mini", 0, tmp_path / "e2b")
    other = _with_config(src, tmp_path / "gemma3", model_type="gemma3_text")
    with pytest.raises(BackendError) as e:
        MlxVlmBackend().open(other)
    assert str(e.value) == (f"mlx-vlm backend: {other}: model_type 'gemma3_text' is not a Gemma 4 model this backend "
                            "serves (it serves mlx-vlm's gemma4, gemma4_text, gemma4_unified)")
    with pytest.raises(BackendError) as e:
        family_for({"model_type": "gemma4_unified_text"}, "DIR")
    assert str(e.value) == ("mlx-vlm backend: DIR: model_type 'gemma4_unified_text': mlx-vlm 0.7.10 has no model for a "
                            "Gemma4UnifiedForCausalLM checkpoint (its gemma4_unified model reads the conditional "
                            "layout only)")
    # Gemma 4 Unified saved under transformers 5.24's module names (model.embed_vision.*): mlx-vlm's sanitize
    # maps only the published ones (model.vision_embedder.*, refimpl reads both)
    unified = write_checkpoint("12b-mini", 0, tmp_path / "unified")
    modules = _with_config(unified, tmp_path / "modules")
    (modules / "model.safetensors").unlink()
    weights = load_file(str(unified / "model.safetensors"))
    renamed = {k.replace("model.vision_embedder.", "model.embed_vision.").replace(
        "model.embed_vision.embedding_projection", "model.embed_vision.multimodal_embedder.embedding_projection"): v
        for k, v in weights.items()}
    save_file(renamed, str(modules / "model.safetensors"))
    with pytest.raises(BackendError) as e:
        MlxVlmBackend().open(modules)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        f"mlx-vlm backend: mlx_vlm.utils.load_model cannot load {modules}: ValueError: Received 10 parameters not in "
        "model: embed_vision.multimodal_embedder.embedding_projection.weight, embed_vision.patch_dense.bias")
    # a geometry mlx-vlm cannot express: a full layer with its own KV head count without K=V
    cfg = micro_config(num_attention_heads=2, num_key_value_heads=1,
                       per_layer_config={"2": {"head_dim": 8, "num_key_value_heads": 2}})
    del cfg["global_head_dim"]
    with pytest.raises(BackendError) as e:
        MlxVlmBackend().open(micro_checkpoint(tmp_path / "plc", cfg, 0))
    assert str(e.value).startswith("mlx-vlm backend: mlx_vlm.utils.load_model cannot "
                                   "load ") and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# the paths


def _request(name: str, case_id: str, model_dir: Path) -> Request:
    fs = load_set(bundled_set(name))
    case = next(c for c in fs.cases if c.id == case_id)
    return build_request(case, fs.bases(), None, fs.media("scaled"))


TOWER_CASES = {  # modality: (set, a case with two blocks in one forward, the towers the checkpoint has)
    "image": ("e2b-vision-mini", "e2b-vision-mini/prefill/I1/T140/rows-all", {"vision_tower": True,
                                                                               "audio_tower": False}),
    "audio": ("e2b-audio-mini", "e2b-audio-mini/prefill/S1/T44/rows-all", {"vision_tower": False,
                                                                            "audio_tower": True}),
    # Gemma 4 Unified: the encoder-free embedders on padded model patches and on raw waveform frames
    "unified-image": ("12b-mini", "12b-mini/prefill/I1/T146/rows-all", {"vision_embedder": True, "embed_audio": True}),
    "unified-audio": ("12b-mini", "12b-mini/prefill/S1/T44/rows-all", {"vision_embedder": True, "embed_audio": True}),
}


@pytest.mark.parametrize("what", list(TOWER_CASES))
def test_soft_tokens_come_from_mlx_vlms_own_tower(tmp_path, what):
    name, case_id, towers = TOWER_CASES[what]
    what = what.removeprefix("unified-")
    path = write_checkpoint(name, 0, tmp_path / name)
    request = _request(name, case_id, path)
    piece = request.pieces[0]
    blanked = piece.embeddings.copy()
    for start, n in getattr(request, "images" if what == "image" else "audio"):
        blanked[start:start + n] = 0.0  # the request's soft tokens gone
    altered = dataclasses.replace(request, pieces=(dataclasses.replace(piece, embeddings=blanked),))
    out = {}
    for tower in ("on", "off"):
        b = MlxVlmBackend(**{f"{what}_tower": tower})
        b.open(path)
        try:
            assert b.load_info["towers"] == towers
            out[tower] = (b.run(request), b.run(altered))
        finally:
            b.close()
    (on, on_blank), (off, off_blank) = out["on"], out["off"]
    # the tower's rows (1e-5 from the given ones) and the given ones pass the same profile
    assert max_abs(on.logits, off.logits) < PROFILES["fp32"].max_abs
    assert max_abs(on_blank.logits, on.logits) < 1e-6  # the tower's rows replace whatever the request says
    assert max_abs(off_blank.logits, off.logits) > 1.0  # without it the given rows are used
    key = f"{what}_rows_max_abs"
    assert on.executed["pieces"][0]["ubatches"][0][key] < 1e-4  # mlx-vlm's tower agrees with the oracle's rows
    assert on_blank.executed["pieces"][0]["ubatches"][0][key] > 0.1
    assert key not in off.executed["pieces"][0]["ubatches"][0]


def test_a_shorter_first_audio_clip_lands_in_the_next_clips_rows(tmp_path):
    """Recorded in docs/backends.md (no bundled set has it: S1's longer clip comes first): mlx-vlm 0.7.10's
    gemma4 get_input_embeddings scatters every row of the padded tower output, padding rows included, so a
    shorter clip before a longer one pushes its padding rows into the next clip's positions."""
    path = write_checkpoint("e2b-audio-mini", 0, tmp_path / "audio")
    media = load_set(bundled_set("e2b-audio-mini")).media("scaled")["S1"]
    (long_start, n_long), (short_start, n_short) = media.audio
    want = {0: media.embeddings[long_start:long_start + n_long], 1: media.embeddings[short_start:short_start + n_short]}
    b = MlxVlmBackend()
    b.open(path)
    try:
        got = {}
        for order in ((0, 1), (1, 0)):
            x, mask = b._audio_features([media.audio_inputs[k] for k in order])
            ids = mx.array([[b.media_ids["audio"]] * (n_long + n_short)])
            rows = np.array(b.model.get_input_embeddings(input_ids=ids, input_features=x,
                                                         input_features_mask=mask).inputs_embeds[0])
            first = n_long if order[0] == 0 else n_short
            got[order] = (max_abs(rows[:first], want[order[0]]), max_abs(rows[first:], want[order[1]]))
    finally:
        b.close()
    assert max(got[(0, 1)]) < 1e-4  # longer first: both clips right
    assert got[(1, 0)][0] < 1e-4 and got[(1, 0)][1] > 1.0  # shorter first: the second clip's rows are wrong


def test_the_views_config_patches(tmp_path):
    # an audio-text checkpoint: mlx-vlm's loader cannot build "vision_config": null
    path = write_checkpoint("e2b-audio-mini", 0, tmp_path / "audio")
    raw = json.loads((path / "config.json").read_text())
    assert raw["vision_config"] is None
    assert config_patch(raw, load_config(path), "gemma4") == {"<top>.vision_config": {"was": None, "now": "absent"}}
    # Gemma 4 Unified: mlx-vlm's embedder configs default model_patch_size to 48 and size the audio projection
    # by output_proj_dims (640), where the model takes patch_size x pooling_kernel_size and audio_embed_dim
    path = write_checkpoint("12b-mini", 0, tmp_path / "unified")
    raw = json.loads((path / "config.json").read_text())
    patch = config_patch(raw, load_config(path), "gemma4_unified")
    assert patch == {"<top>.vision_config.model_patch_size": {"was": "absent", "now": 12},
                     "<top>.audio_config.output_proj_dims": {"was": "absent", "now": 640}}
    small = _with_config(path, tmp_path / "small-audio", audio_config={**raw["audio_config"], "audio_embed_dim": 320})
    assert config_patch(json.loads((small / "config.json").read_text()), load_config(path), "gemma4_unified")[
        "<top>.audio_config.output_proj_dims"] == {"was": "absent", "now": 320}


def test_image_prompt_on_a_text_checkpoint_is_refused(tmp_path):
    b = MlxVlmBackend(image_tower="off")
    b.open(write_checkpoint("e2b-mini", 0, tmp_path / "e2b"))
    try:
        assert b.load_info["model_class"] == "mlx_vlm.models.gemma4_text.gemma4_text.Model"
        with pytest.raises(ValueError, match=r"has no vision_config \(a text-only checkpoint\); it cannot serve "
                                             r"image prompts$"):
            b.run(Request("last", tokens=(2, 7, 9, 9, 8), entry="embeddings", seq_id=0, last_pos=4,
                          embeddings=np.zeros((5, 64)), images=((2, 2),)))
    finally:
        b.close()


def test_conditional_layout_text_path(tmp_path):
    path = write_checkpoint("31b-mini", 0, tmp_path / "cond", layout="conditional")
    b = MlxVlmBackend()
    b.open(path)
    try:
        assert b.load_info["model_class"] == "mlx_vlm.models.gemma4.gemma4.Model"
        ids = tup(np.random.default_rng(1).integers(3, 512, 19))
        r = b.run(Request("last", tokens=ids, entry="seq_id", seq_id=4, last_pos=8, decode=(7, 8)))
        want = Gemma4(path).forward(np.asarray(ids + (7, 8)), rows="all")
        assert max_abs(r.logits, want[8:9]) < F32 and max_abs(r.decode_logits, want[-2:]) < F32
        assert r.executed["logits_to_keep"] == 19 - 8  # the suffix from the requested row
    finally:
        b.close()


def test_config_patch_is_refimpl_derivation(tmp_path):
    # transformers 5.23+'s per_layer_config, absent layer_types / num_kv_shared_layers / softcap
    cfg = micro_config(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2, attention_k_eq_v=True,
                       per_layer_config={"5": {"head_dim": 8, "num_key_value_heads": 1}})
    for key in ("global_head_dim", "num_global_key_value_heads", "layer_types", "num_kv_shared_layers",
                "final_logit_softcapping"):
        cfg.pop(key)
    path = micro_checkpoint(tmp_path / "ckpt", cfg, 3)
    ref = load_config(path)
    patch = config_patch(json.loads((path / "config.json").read_text()), ref, "gemma4_text")
    assert set(patch) == {"global_head_dim", "num_global_key_value_heads", "layer_types", "num_kv_shared_layers",
                          "final_logit_softcapping"}
    assert patch["layer_types"] == {"was": "absent", "now": list(ref.layer_types)}
    assert ref.layer_types[-1] == FULL and ref.layer_types[0] == SLIDING
    views = set(Path(tempfile.gettempdir()).glob("gemma4-conformance-mlx-vlm-view-*"))
    b = MlxVlmBackend()
    b.open(path)
    try:
        assert set(Path(tempfile.gettempdir()).glob("gemma4-conformance-mlx-vlm-view-*")) == views  # removed
        assert b.config_patch == patch and json.loads((path / "config.json").read_text()) == cfg  # untouched
        ids = tup(np.random.default_rng(0).integers(0, ref.vocab_size, 13))
        r = b.run(Request("full", tokens=ids, decode=(5, 6)))
        want = Gemma4(path).forward(np.asarray(ids + (5, 6)), rows="all")
        assert max_abs(r.logits, want[:13]) < F32 and max_abs(r.decode_logits, want[13:]) < F32
        assert r.executed["config_patch"] == patch
        good = b.text_config
        b.text_config = dataclasses.replace(good, sliding_window=4)
        assert "sliding_window: mlx-vlm has 3, the config means 4" in geometry_problems(b.family, b.model,
                                                                                      b.text_config)
        b.text_config = good
    finally:
        b.close()


# ----------------------------------------------------------------------------------------------
# MTP: mlx-vlm's own assisted decoding loop

MTP_SETS = ("e2b-assistant-mini", "12b-assistant-mini")
NO_MTP_ON_GEMMA4_TEXT = ("RuntimeError: mlx-vlm backend: mlx-vlm's MTP loop (generate_step, draft_kind='mtp') fails on "
                         "mlx_vlm.models.gemma4_text.gemma4_text.Model: TypeError: 'NoneType' object is not "
                         "subscriptable")
FIRST_DIFFERENCE = {  # convention claimed -> 12b-assistant-mini base -> how its mtp_trace message starts (None: pass)
    # M0, M2 (prompts up to W) follow rotating/P-1 until the budget ends; M1, M3 (longer) differ in round 0's keys
    "rotating/P-1": {"M0": "round 8: 3 drafts, the oracle 2", "M1": "round 0 step 0: drafted 478, the oracle drafts 94",
                     "M2": "round 6: 1 drafts, the oracle "
                           "0", "M3": "round 0 step 0: drafted 485, the oracle drafts 424"},
    "target-cache/P": {"M0": "round 1 step 0: drafted 52, the oracle drafts 68",
                       "M1": "round 0 step 0: drafted 478, the oracle drafts 437",
                       "M2": "round 6: 1 drafts, the oracle "
                             "0", "M3": "round 0 step 0: drafted 485, the oracle drafts 343"},
    "transformers/P": {"M0": "round 1 step 0: drafted 52, the oracle drafts 293",
                       "M1": "round 0 step 0: drafted 478, the oracle drafts 437",
                       "M2": "round 6: 1 drafts, the oracle 0",
                       "M3": None},  # the oracle's first draft is undecided (margin 0.011): nothing graded after it
}


def _mtp_request(name: str, base: str, path: Path, convention: str = "rotating/P-1"):
    fs = load_set(bundled_set(name))
    case = next(c for c in fs.cases if c.id == f"{name}/mtp/generate/{base}/{convention}")
    return case, build_request(case, fs.bases(), None, None, path / "assistant")


@pytest.mark.parametrize("convention", list(FIRST_DIFFERENCE))
def test_mtp_gate_on_the_bundled_assistant_sets(tmp_path, convention):
    result = run(MlxVlmBackend(mtp_convention=convention), [bundled_set(s) for s in MTP_SETS], PROFILES["fp32"],
                 workdir=tmp_path, select=r"/mtp/.*/M[0-3]/")  # (MTP after media, M4 and M5: no mtp_media)
    ran = {r.id: r for r in result.cases if r.status != "not-claimed"}
    assert len(result.cases) == 96 and sorted(ran) == sorted(f"{s}/mtp/generate/M{i}/{convention}" for s in MTP_SETS
                                                             for i in range(4))
    for base, want in FIRST_DIFFERENCE[convention].items():
        r = ran[f"e2b-assistant-mini/mtp/generate/{base}/{convention}"]
        assert (r.status, r.message) == ("error", NO_MTP_ON_GEMMA4_TEXT)
        r = ran[f"12b-assistant-mini/mtp/generate/{base}/{convention}"]
        if want is None:
            assert r.status == "pass"
        else:  # the output is plain greedy decoding (mtp_output passed); the rounds differ
            assert (r.status, r.check) == ("fail", "mtp_trace") and r.message.startswith(want), r.message


def _rounds_make_the_output(mtp) -> None:
    """Each round appends its accepted drafts, then the target's own token, until the budget ends."""
    at = 1  # the first token comes from the prompt
    for drafts, accepted in zip(mtp.drafts, mtp.accepted, strict=True):
        kept = mtp.output[at:at + accepted + 1]
        assert kept[:accepted] == drafts[:len(kept[:accepted])]
        if accepted < len(drafts) and len(kept) > accepted:
            assert kept[accepted] != drafts[accepted]  # the target's token, where it rejected the draft
        at += accepted + 1
    assert at >= len(mtp.output) > at - (mtp.accepted[-1] + 1)


def test_mtp_output_is_plain_greedy_decoding(tmp_path, monkeypatch):
    """On the bundled cases (whose random drafter is never right: every draft rejected, by the oracle too), and
    with drafts forced into mlx-vlm's loop so that rounds accept 1, 3, 0, 2 of them (its verification and the
    rollback of its caches past the window): the output is plain greedy decoding, the recorded rounds make it."""
    path = write_checkpoint("12b-assistant-mini", 0, tmp_path / "12b")
    b = MlxVlmBackend()
    b.open(path)
    try:
        for base in ("M0", "M1"):  # a prompt shorter than the window and one longer
            case, request = _mtp_request("12b-assistant-mini", base, path)
            r = b.run(request)
            plain = [t for t, _ in generate_step(mx.array([list(request.tokens)]), b.model, None, None,
                                                 max_tokens=case.mtp.max_new_tokens, temperature=0.0)]
            assert r.mtp.output == tuple(plain) == case.mtp.output
            assert r.mtp.accepted == [c.accepted for c in case.mtp.rounds[:len(r.mtp.accepted)]] == [0] * 11
            _rounds_make_the_output(r.mtp)
            want = Gemma4(path).forward(np.asarray(request.tokens), rows="all")[-1:]
            assert max_abs(r.logits, want) < F32
            assert r.executed["drafter"].endswith("Gemma4AssistantDraftModel")
            assert r.executed["drafts_per_round"] == [len(d) for d in r.mtp.drafts]

            full, pattern = list(request.tokens) + plain, (1, 3, 0, 2)
            rounds = []

            def forced(self, last_bonus, hidden, cache, block_size, *args, full=full, pattern=pattern, rounds=rounds,
                       **kwargs):
                P, k = self._kv_offset, block_size - 1  # the pending token's position, the drafts
                right = pattern[len(rounds) % len(pattern)]
                rounds.append(min(right, k))
                drafts = [full[P + 1 + j] if j < right else (full[P + 1 + j] + 1) % b.vocab_size
                          for j in range(k)]
                return mx.array([drafts], dtype=mx.int32)

            with monkeypatch.context() as m:
                m.setattr(Gemma4AssistantDraftModel, "draft_block", forced)
                r = b.run(request)
            assert r.mtp.output == tuple(plain) and r.mtp.accepted == rounds and 3 in rounds and 0 in rounds
            _rounds_make_the_output(r.mtp)
    finally:
        b.close()


def _mlx_vlm_keys(prompt_length: int):
    """``refimpl.mtp.handed_over`` as mlx-vlm 0.7.10 hands the target's keys over (``mtp.py``): full layers
    0 .. P-1; sliding layers P-W .. P-1, except P-W .. P-2 in the first round after a prompt longer than W and
    P-W+1 .. P-1 in its later rounds."""
    def handed_over(call, P, window, kv_rule):
        out = {}
        for kind, kv in call.kv.items():
            if kind == FULL:
                first, last = 0, P - 1
            elif call.prefill:
                first, last = P - window, P - 2 if P > window else P - 1
            else:
                first, last = P - window + (prompt_length > window), P - 1
            keep = (kv.pos >= first) & (kv.pos <= last)
            out[kind] = LayerKV(kv.k[keep], kv.v[keep], kv.pos[keep])
        return out
    return handed_over


def _replay(target, drafter, request, got, handed_over, convention, monkeypatch):
    """refimpl's rounds with mlx-vlm's drafts and counts under the key rule ``handed_over``: every drafter
    state, the drafter's own argmax per round, the target's acceptance, the output."""
    with monkeypatch.context() as m:
        m.setattr(refimpl_mtp, "handed_over", handed_over)
        a = refimpl_mtp.Assisted(target, drafter, request.tokens, convention)
        out, states, argmax, accepted = [a.token], [], [], []
        for drafts in got.drafts:
            r = a.round(len(drafts), forced=drafts, budget=request.mtp.max_new_tokens - len(out))
            out += r.appended
            states += list(r.draft_states)
            argmax.append(r.draft_argmax)
            accepted.append(r.accepted)
    return np.array(states), argmax, accepted, tuple(out)


@pytest.mark.parametrize("name, layout", [("12b-assistant-mini", "causal"),  # Unified: always conditional
                                          ("e2b-assistant-mini", "conditional")])  # the published E2B layout
def test_mtp_rounds_are_refimpls_under_mlx_vlms_keys(tmp_path, monkeypatch, name, layout):
    """Every drafter state of mlx-vlm's run (its final-normed z_hat) is refimpl's, replaying mlx-vlm's rounds
    with ``_mlx_vlm_keys`` queried at P-1, and only so: the oracle's rotating keys miss on the long prompts
    (M1, M3) and agree on the short ones, the query at P misses on all. The e2b weights run through mlx-vlm's
    ``gemma4`` model in the conditional layout (its ``gemma4_text`` has no MTP): the centroid head too."""
    path = write_checkpoint(name, 0, tmp_path / name, layout=layout)
    states: list[np.ndarray] = []
    forward = Gemma4AssistantDraftModel._forward_hidden

    def recorded(self, *args, **kwargs):
        last, z = forward(self, *args, **kwargs)
        states.append(np.array(z.astype(mx.float32)).reshape(-1))
        return last, z

    monkeypatch.setattr(Gemma4AssistantDraftModel, "_forward_hidden", recorded)
    target, drafter = Gemma4(path), Drafter(path / "assistant")
    b = MlxVlmBackend()
    b.open(path)
    try:
        assert b.load_info["model_class"].startswith("mlx_vlm.models.gemma4")
        assert (b.drafters == {}) and (drafter.acfg.use_ordered_embeddings == (name == "e2b-assistant-mini"))
        for base in ("M0", "M1", "M2", "M3"):
            case, request = _mtp_request(name, base, path)
            states.clear()
            got = b.run(request).mtp
            assert got.output == case.mtp.output  # plain greedy decoding
            mlx_keys = _mlx_vlm_keys(len(request.tokens))
            want, argmax, accepted, output = _replay(target, drafter, request, got, mlx_keys, "rotating/P-1",
                                                     monkeypatch)
            assert np.max(np.abs(np.array(states) - want)) < 1e-4, base
            assert (argmax, accepted, output) == ([tuple(d) for d in got.drafts], got.accepted, got.output)
            for rule, convention, agrees in ((refimpl_mtp.handed_over, "rotating/P-1", base in ("M0", "M2")),
                                             (mlx_keys, "rotating/P", False)):
                other = _replay(target, drafter, request, got, rule, convention, monkeypatch)[0]
                assert (np.max(np.abs(np.array(states) - other)) < 1e-4) == agrees, (base, convention)
    finally:
        b.close()


def test_mtp_requests_it_does_not_serve_are_one_line_errors(tmp_path):
    path = write_checkpoint("12b-assistant-mini", 0, tmp_path / "12b")
    _, request = _mtp_request("12b-assistant-mini", "M3", path)
    b = MlxVlmBackend()
    b.open(path)
    try:
        for mode, convention in (("rounds", "rotating/P-1"), ("generate", "target-cache/P")):
            spec = dataclasses.replace(request.mtp, mode=mode, convention=convention)
            with pytest.raises(ValueError) as e:
                b.run(dataclasses.replace(request, mtp=spec))
            assert str(e.value) == ("mlx-vlm backend: serves MTP requests in mode 'generate' with convention "
                                    f"rotating/P-1 (mlx-vlm's own MTP loop), got mode {mode!r} with convention "
                                    f"{convention!r}")
        with pytest.raises(ValueError) as e:
            b.run(dataclasses.replace(request, drafter=None))
        assert str(e.value) == "mlx-vlm backend: an mtp request needs the drafter's directory (request.drafter)"
        with pytest.raises(BackendError) as e:
            b.run(dataclasses.replace(request, drafter=str(path)))
        assert str(e.value) == (f"mlx-vlm backend: {path} is not a Gemma 4 assistant (model_type 'gemma4_unified'; "
                                "expected one of gemma4_assistant, gemma4_unified_assistant)")
    finally:
        b.close()
