"""The GGUF oracle against llama.cpp itself (issue 45), with the llama-cpp-python that ``make llama-cpp`` builds:

- ggml's block sizes (``ggml_get_type_traits``) are refimpl's;
- blocks drawn by hypothesis decode as libggml's ``to_float`` decodes them: equal where float32 holds the value
  (F32, F16, BF16, Q8_0, Q4_0, Q5_0), its single rounding for Q4_1 and Q5_1;
- a bundled checkpoint's weights quantised by libggml's own quantiser (``ggml_quantize_chunk``) decode the same
  way, and the GGUF of those blocks gives the logits of a checkpoint of libggml's decoded values;
- llama.cpp's own converter (``convert_hf_to_gguf.py``) at f32, f16, bf16 and q8_0: the config is config.json's,
  the logits the checkpoint's (f32) or those of the values libggml decodes from the converter's blocks."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build-llama-cpp.sh)")

import libggml
from gguf_writer import T, decoded_checkpoint, write_gguf
from helpers import examples, micro_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ggml_blocks import PLAIN, QK, QUANT, ROUNDED, blocks

from conformance.backends.llama_cpp import convert, library
from conformance.protocol import BackendError
from refimpl import Gemma4, load_config
from refimpl.errors import RefimplError
from refimpl.ggml_blocks import OTHER_SIZES, TYPES, dequantize
from refimpl.safetensors_io import TensorStore, write_safetensors

IDS = list(range(3, 40))


def _close(a: np.ndarray, b: np.ndarray) -> float:
    """Equal up to float64 rounding (a few ulps of the largest logit); returns the max difference."""
    diff = float(np.max(np.abs(a - b)))
    assert a.shape == b.shape and diff <= 1e-12 * max(1.0, float(np.max(np.abs(a))))
    return diff


def _agrees_with_libggml(got: np.ndarray, ref32: np.ndarray, rounded: bool) -> None:
    if rounded:  # libggml rounds d·q + m once to float32
        assert np.array_equal(got.astype(np.float32), ref32)
        assert np.all(np.abs(got - ref32) <= np.abs(got) * 2.0**-24 + 2.0**-149)
    else:
        assert np.array_equal(got, ref32.astype(np.float64), equal_nan=True)


def test_block_sizes_are_ggmls():
    for ggml_type, bt in TYPES.items():
        t = libggml.traits(ggml_type)
        assert (t.type_name.decode().upper(), t.blck_size, t.type_size) == (bt.name, bt.qk, bt.nbytes)
    for ggml_type, (qk, nbytes) in OTHER_SIZES.items():
        t = libggml.traits(ggml_type)
        assert (t.blck_size, t.type_size) == (qk, nbytes), t.type_name


@pytest.mark.parametrize("name", sorted(QUANT))
@settings(max_examples=examples(150), deadline=None)
@given(data=st.data())
def test_blocks_decode_as_libggml_decodes_them(name, data):
    raw, n = data.draw(blocks(name))
    _agrees_with_libggml(dequantize(raw, QUANT[name], QK[name] * n), libggml.to_float(raw, QUANT[name], QK[name] * n),
                         name in ROUNDED)


@pytest.mark.parametrize("name", sorted(PLAIN))
@settings(max_examples=examples(100), deadline=None)
@given(data=st.data())
def test_plain_types_decode_as_libggml_decodes_them(name, data):
    width = 4 if name == "F32" else 2
    raw = data.draw(st.binary(min_size=width, max_size=64 * width).filter(lambda b: len(b) % width == 0))
    n = len(raw) // width
    with np.errstate(invalid="ignore"):  # a signalling NaN widened
        _agrees_with_libggml(dequantize(raw, PLAIN[name], n), libggml.to_float(raw, PLAIN[name], n), False)


def _libggml_values(t) -> np.ndarray:
    return libggml.to_float(np.asarray(t.data).tobytes(), int(t.tensor_type), int(np.prod(t.shape)))


def _decoded_checkpoint(model_dir, path, out):
    """``model_dir``'s config with the values libggml decodes from the GGUF ``path``."""
    return decoded_checkpoint(model_dir, path, out, _libggml_values)


def _agrees_with_libggml_everywhere(model_dir, path, tmp_path, qtype_names=None) -> None:
    """Every tensor of the GGUF ``path`` (of the types ``qtype_names``, when given) decodes as libggml decodes it,
    and the logits are those of a checkpoint of libggml's values: equal where float32 holds them, within their one
    float32 rounding (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) otherwise."""
    store = Gemma4(path).weights.store
    rounded = False
    for info in store.infos.values():
        if qtype_names is None or info.dtype in qtype_names:
            raw, n = store.file.raw(info.gguf_name), int(np.prod(info.shape))
            _agrees_with_libggml(dequantize(raw, info.ggml_type, n), libggml.to_float(raw, info.ggml_type, n),
                                 info.dtype in ROUNDED)
        rounded |= info.dtype in ROUNDED
    want = Gemma4(_decoded_checkpoint(model_dir, path, tmp_path / "decoded")).forward(IDS, rows="all")
    got = Gemma4(path).forward(IDS, rows="all")
    if rounded:
        assert float(np.max(np.abs(want - got))) <= 1e-5 * float(np.max(np.abs(want)))
    else:
        _close(want, got)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_llama_cpps_quantiser_on_a_bundled_checkpoint(qtype, preset_dirs, tmp_path):
    model_dir = preset_dirs["e2b-mini"]
    path = write_gguf(model_dir, tmp_path / "q.gguf", qtype, quantizer=lambda v, q: libggml.quantize(v, int(q)))
    assert sum(info.dtype == qtype.name for info in Gemma4(path).weights.store.infos.values()) > 40  # every
    _agrees_with_libggml_everywhere(model_dir, path, tmp_path)  # weight whose rows are whole blocks


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_llama_cpps_k_quants_on_a_256_wide_checkpoint(qtype, micro_factory, tmp_path):
    """libggml's quantiser makes K-quant super-blocks of every 256-wide weight: each decodes as libggml decodes
    it, and the logits are those of libggml's decoded values (exactly for Q3_K and Q6_K, which float32 holds;
    within their one float32 rounding for Q2_K, Q4_K and Q5_K)."""
    model_dir = micro_factory(micro_config(hidden_size=256, intermediate_size=256, vocab_size=256))
    path = write_gguf(model_dir, tmp_path / "k.gguf", qtype, quantizer=lambda v, q: libggml.quantize(v, int(q)))
    # q/k/v and the MLP of every layer, the embedding table
    assert sum(info.dtype == qtype.name for info in Gemma4(path).weights.store.infos.values()) >= 10
    _agrees_with_libggml_everywhere(model_dir, path, tmp_path)


try:
    SOURCE = library.resolve_source()
except BackendError:  # pragma: no cover - depends on the machine
    SOURCE = None


@pytest.mark.skipif(SOURCE is None, reason="llama.cpp converter sources missing (scripts/build-llama-cpp.sh)")
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("preset", ["e2b-mini", "26b-a4b-mini", "31b-mini"])
def test_llama_cpps_converter(preset, outtype, tmp_path_factory, tmp_path):
    from refimpl.synth import write_checkpoint

    # a bf16 checkpoint, as published: the converter reads bf16 through float32
    model_dir = write_checkpoint(preset, 0, tmp_path_factory.mktemp("ckpt") / preset)
    path, _ = convert.convert_to_gguf(model_dir, SOURCE, outtype, tmp_path_factory.mktemp("cache"))
    ref, got = load_config(model_dir), load_config(path)
    same = ("architecture", "serialisation", "notes", "max_position_embeddings", "eos_token_ids")
    assert dataclasses.replace(got, **{k: getattr(ref, k) for k in same}) == ref
    assert set(got.eos_token_ids) <= set(ref.eos_token_ids)
    model = Gemma4(path)
    if outtype == "f32":
        want = Gemma4(model_dir).forward(IDS, rows="all")
    else:
        want = Gemma4(_decoded_checkpoint(model_dir, path, tmp_path / "decoded")).forward(IDS, rows="all")
    _close(want, model.forward(IDS, rows="all"))


TEXTS = ["Hello, world. How are you today?", "  double  spaces and\ttabs\n\nnewlines ", "naïve café, 漢字 and 🙂",
         "<|turn>user\nWhat is in <|image|>?<turn|>\n<|turn>model\n", "literal <bos> and <eos> and <pad>",
         '<|channel>thought<channel|><|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>', "x" * 200, ""]
PIECES = ["the", "table", "gemma", "who", "position", " ", "  ", "\n", "\t", "漢", "é", "🙂", "<|turn>", "<|image|>",
          "<bos>", "<mask>", '<|"|>', "<tool_call|>", "x", "ion", "▁", "<0x41>"]


def _converted(preset: str, tmp_path_factory):
    """(the preset's directory, its F32 GGUF made by llama.cpp's converter, in a directory of its own)."""
    from refimpl.synth import write_checkpoint

    if SOURCE is None:
        pytest.skip("llama.cpp converter sources missing (scripts/build-llama-cpp.sh)")
    model_dir = write_checkpoint(preset, 0, tmp_path_factory.mktemp("ckpt") / preset)
    path, _ = convert.convert_to_gguf(model_dir, SOURCE, "f32", tmp_path_factory.mktemp("cache"))
    return model_dir, path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return _converted("e2b-mini", tmp_path_factory)


@settings(max_examples=examples(200), deadline=None)
@given(text=st.one_of(st.sampled_from(TEXTS), st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
                      st.text(max_size=40)))
def test_the_gguf_vocabulary_tokenizes_as_the_sentencepiece_model(converted, text):
    """The converter's tokenizer.ggml.* (its BPE merges: every score is -1000) encode and decode as the checkpoint's
    tokenizer.model: plain text, text with Gemma 4's markers, rendered chat, any unicode."""
    from refimpl.tokenizer import Tokenizer

    model_dir, path = converted
    sp, gg = Tokenizer.from_dir(model_dir), Tokenizer.from_dir(path)
    assert gg.path == path and sp.vocab_size == gg.vocab_size == 512
    ids = sp.encode(text)
    assert gg.encode(text) == ids
    assert gg.decode(ids) == sp.decode(ids)
    assert gg.encode_rendered(text) == sp.encode_rendered(text)
    assert gg.encode_chat([{"role": "user", "content": text}]) == sp.encode_chat([{"role": "user", "content": text}])


def test_a_prompt_on_a_gguf_is_the_checkpoints_prompt(converted, tmp_path):
    """refimpl logits --prompt on the converted GGUF alone (no tokenizer.model beside it): the checkpoint's ids and
    logits; a tokenizer.model beside the file is used instead of the vocabulary when there is one."""
    from refimpl.cli import main

    model_dir, path = converted
    assert not (path.parent / "tokenizer.model").exists()
    outs = {}
    for name, model in (("dir", model_dir), ("gguf", path)):
        assert main(["logits", "--model", str(model), "--prompt", TEXTS[0], "--chat", "--rows", "all",
                     "--out", str(tmp_path / f"{name}.safetensors")]) == 0
        outs[name] = TensorStore(tmp_path / f"{name}.safetensors")
    assert np.array_equal(outs["dir"].get("tokens"), outs["gguf"].get("tokens"))
    _close(outs["dir"].get("logits"), outs["gguf"].get("logits"))
    beside = tmp_path / "beside"
    beside.mkdir()
    shutil.copy(model_dir / "tokenizer.model", beside / "tokenizer.model")
    (beside / "m.gguf").symlink_to(path)
    from refimpl.tokenizer import Tokenizer

    assert Tokenizer.from_dir(beside / "m.gguf").path == beside / "tokenizer.model"


def _dense_head_copy(drafter_dir, out):
    """A drafter directory as llama.cpp's converter keeps it: without the centroid head (masked_embedding.*)."""
    import json

    out.mkdir()
    raw = json.loads((drafter_dir / "config.json").read_text(encoding="utf-8"))
    (out / "config.json").write_text(json.dumps({**raw, "use_ordered_embeddings": False}), encoding="utf-8")
    store = TensorStore(drafter_dir)
    write_safetensors(out / "model.safetensors", {n: store.get(n) for n in store.names
                                                  if not n.startswith("masked_embedding.")}, "F32")
    return out


@pytest.mark.skipif(SOURCE is None, reason="llama.cpp converter sources missing (scripts/build-llama-cpp.sh)")
@pytest.mark.parametrize("preset", ["mtp-layout-mini", "12b-assistant-mini", "e2b-assistant-mini"])
def test_a_drafter_gguf_steps_as_its_checkpoint(preset, tmp_path_factory, tmp_path):
    """An MTP drafter converted by llama.cpp (architecture gemma4-assistant, the centroid head dropped): the
    drafter's geometry and every draft step's logits, hidden vector and final-normed state are those of its
    checkpoint with the dense head, over the same handed-over K/V."""
    from refimpl.assistant import Drafter, is_assistant
    from refimpl.config import FULL, SLIDING
    from refimpl.model import LayerKV
    from refimpl.synth import write_checkpoint

    drafter_dir = write_checkpoint(preset, 0, tmp_path_factory.mktemp("ckpt") / preset) / "assistant"
    path, _ = convert.convert_to_gguf(drafter_dir, SOURCE, "f32", tmp_path_factory.mktemp("cache"))
    assert is_assistant(path) and is_assistant(drafter_dir)
    want, got = Drafter(_dense_head_copy(drafter_dir, tmp_path / "dense")), Drafter(path)
    assert got.acfg.backbone_hidden_size == want.acfg.backbone_hidden_size and not got.acfg.use_ordered_embeddings
    strip = ("k_eq_v", "kv_source")  # q-only layers: the drafter reads the target's K/V, whatever these say
    assert [dataclasses.replace(x, **dict.fromkeys(strip, 0)) for x in got.cfg.layers] == \
        [dataclasses.replace(x, **dict.fromkeys(strip, 0)) for x in want.cfg.layers]
    rng = np.random.default_rng(5)
    H = want.acfg.backbone_hidden_size
    for step in range(3):
        kv = {}
        for kind in (SLIDING, FULL):
            layer = next(x for x in want.cfg.layers if x.layer_type == kind)
            shape = (4 + step, layer.num_kv_heads, layer.head_dim)
            kv[kind] = LayerKV(rng.standard_normal(shape), rng.standard_normal(shape), np.arange(shape[0]))
        e, h = rng.standard_normal(H), rng.standard_normal(H)
        a, b = want.step(e, h, 9 + step, kv), got.step(e, h, 9 + step, kv)
        _close(a.logits[None], b.logits[None])
        _close(a.h_next[None], b.h_next[None])
        _close(a.z_hat[None], b.z_hat[None])
    with pytest.raises(RefimplError, match="an MTP drafter GGUF .architecture 'gemma4-assistant'.; pass it as the "
                                           "drafter, and the target model's GGUF .architecture 'gemma4'. as the model"):
        Gemma4(path)


K_PRESETS = {"Q4_K_M": (15, {"Q4_K", "Q6_K"}), "Q5_K_M": (17, {"Q5_K", "Q6_K"}), "Q6_K": (18, {"Q6_K"}),
             "Q3_K_M": (12, {"Q3_K"})}  # llama_ftype, K-quant types the preset must make of e2b-256-mini


@pytest.fixture(scope="module")
def e256(tmp_path_factory):
    return _converted("e2b-256-mini", tmp_path_factory)


@pytest.mark.parametrize("ftype", sorted(K_PRESETS))
def test_llama_cpps_k_quant_presets_on_the_256_wide_preset(ftype, e256, tmp_path):
    """llama.cpp's own presets (llama_model_quantize) make real K-quant tensors of e2b-256-mini; the oracle decodes
    every tensor as libggml does and gives the logits of libggml's decoded values (within the one float32
    rounding of Q2_K/Q4_K/Q5_K)."""
    import llama_cpp

    model_dir, f32 = e256
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = K_PRESETS[ftype][0]
    out = tmp_path / f"{ftype}.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0
    types = {info.dtype for info in Gemma4(out).weights.store.infos.values()}
    assert K_PRESETS[ftype][1] <= types, types
    _agrees_with_libggml_everywhere(model_dir, out, tmp_path)


def test_the_gguf_vocabulary_on_the_bundled_prompts(converted):
    """Every text prompt a bundled set records (the chat bases), encoded through the converted GGUF's own
    vocabulary, is the prompt the set holds: the same ids as the SentencePiece model gave when the set was made."""
    import json

    from conformance.sets import bundled_sets
    from refimpl.tokenizer import Tokenizer

    gg = Tokenizer.from_dir(converted[1])
    checked = 0
    for set_dir in bundled_sets():
        for base, spec in json.loads((set_dir / "manifest.json").read_text(encoding="utf-8"))["bases"].items():
            if spec.get("source") == "chat" and isinstance(spec.get("text"), str):
                recorded = TensorStore(set_dir / f"base-{base}.safetensors").get("tokens").astype(int).tolist()
                want = recorded[:spec["prompt_length"]]
                assert gg.encode_chat([{"role": "user", "content": spec["text"]}]) == want, (set_dir.name, base)
                checked += 1
    assert checked >= 7


# an E2B miniature with a vision tower and an audio tower of the published geometry (chunk 12, left context 13:
# the values llama.cpp's gemma4a graph fixes), as E2B/E4B have both: the converter writes no audio-only projector
OMNI = "e2b-omni"
_PROJECTED: dict[str, tuple] = {}


def _omni() -> dict:
    from refimpl.presets import PRESETS

    audio = dict(PRESETS["e2b-audio-mini"]["audio"], attention_chunk_size=12, attention_context_left=13)
    return dict(PRESETS["e2b-vision-mini"], audio=audio, description="E2B in miniature with vision and audio")


def _mmproj(preset: str, tmp_path_factory):
    """(the preset's directory, the projector GGUF llama.cpp's converter makes of it: --mmproj, F32), made once
    per preset. The converter wants image_mean / image_std in processor_config.json, which the synthetic
    checkpoints leave out: 0 and 1, the oracle's x / 255 preprocessing."""
    import json
    import subprocess
    import sys

    from refimpl.presets import PRESETS
    from refimpl.synth import write_checkpoint

    if SOURCE is None:
        pytest.skip("llama.cpp converter sources missing (scripts/build-llama-cpp.sh)")
    if preset in _PROJECTED:
        return _PROJECTED[preset]
    root = tmp_path_factory.mktemp("mmproj")
    with pytest.MonkeyPatch.context() as mp:
        if preset == OMNI:
            mp.setitem(PRESETS, OMNI, _omni())
        model_dir = write_checkpoint(preset, 0, root / preset)
    src = convert.make_tokenizer_json(model_dir, root / "converter-input", 512)
    processor = json.loads((src / "processor_config.json").read_text(encoding="utf-8"))
    processor["image_processor"].update(image_mean=[0.0] * 3, image_std=[1.0] * 3)
    (src / "processor_config.json").write_text(json.dumps(processor), encoding="utf-8")
    out = root / "mmproj.gguf"
    run = subprocess.run([sys.executable, str(SOURCE / "convert_hf_to_gguf.py"), str(src), "--mmproj", "--outtype",
                          "f32", "--outfile", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    _PROJECTED[preset] = model_dir, out
    return model_dir, out


@pytest.mark.parametrize("preset", ["e2b-vision-mini", "31b-vision-mini"])
def test_a_vision_projector_gguf_is_the_checkpoints_tower(preset, tmp_path_factory):
    """The mmproj GGUF of the E-series tower (clipped linears) and of the 26B/31B one (standardize): its config (from
    its keys, its shapes and llama.cpp's fixed values) is config.json's, every tensor the checkpoint's (the patch
    embedder back from channels first, the clip bounds back to scalars), the soft tokens of an image the same."""
    from refimpl.gguf_mmproj import load_mmproj_tower
    from refimpl.vision import load_vision_tower, vision_tower

    model_dir, path = _mmproj(preset, tmp_path_factory)
    (wg, cg), (wd, cd) = load_mmproj_tower(path, "vision"), load_vision_tower(model_dir)
    assert cg == cd
    assert sorted(wg.store.names) == sorted(n for n in wd.store.names if n.startswith(("model.vision_tower.",
                                                                                       "model.embed_vision.")))
    for name in wg.store.names:
        assert np.array_equal(wg.store.get(name), wd.store.get(name)), name
    rng = np.random.default_rng(3)
    pixels = rng.random((36, 3 * cd.patch_size**2))
    positions = np.array([(x, y) for y in range(6) for x in range(6)])
    _close(vision_tower(pixels, positions, wd, cd), vision_tower(pixels, positions, wg, cg))
    with pytest.raises(RefimplError, match="not a projector GGUF"):
        load_mmproj_tower(convert.convert_to_gguf(model_dir, SOURCE, "f32", tmp_path_factory.mktemp("c"))[0], "vision")



def test_an_audio_projector_gguf_is_the_checkpoints_conformer(tmp_path_factory, monkeypatch):
    """The gemma4a tower of an E-series mmproj (the converter writes one only beside a vision tower, as E2B/E4B
    have): its config (keys, shapes, llama.cpp's fixed chunk 12 / context 13 / cap 50, the published values) is
    config.json's; every tensor is the checkpoint's (names mapped back, the depthwise kernel reshaped, the clip
    bounds scalars) but per_dim_scale, which the file holds as softplus(per_dim_scale) in float32: within one
    float32 ulp of the exact softplus. The tower's soft tokens equal the checkpoint tower's given that scale, and
    differ from the exact ones by the float32 rounding only."""
    from refimpl.audio import AudioWeights, audio_tower, load_audio_tower
    from refimpl.gguf_mmproj import load_mmproj_tower
    from refimpl.ops import softplus

    model_dir, path = _mmproj(OMNI, tmp_path_factory)
    (wg, cg), (wd, cd) = load_mmproj_tower(path, "audio"), load_audio_tower(model_dir)
    assert cg == cd
    audio_names = sorted(n for n in wd.store.names if n.startswith(("model.audio_tower.", "model.embed_audio.")))
    assert sorted(wg.store.names) == audio_names
    scales = [n for n in audio_names if n.endswith("per_dim_scale")]
    assert len(scales) == cd.num_hidden_layers
    for name in audio_names:
        if name in scales:
            exact, stored = softplus(wd.store.get(name)), wg.store.get(name)
            assert np.all(np.abs(stored - exact) <= np.spacing(np.abs(exact).astype(np.float32))), name
        else:
            assert np.array_equal(wg.store.get(name), wd.store.get(name)), name
    rng = np.random.default_rng(5)
    features, mask = rng.standard_normal((70, 128)), np.ones(70, dtype=bool)
    mask[61:] = False
    got, exact = audio_tower(features, mask, wg, cg), audio_tower(features, mask, wd, cd)
    monkeypatch.setattr(AudioWeights, "query_scale", lambda self, a: wg[a + "per_dim_scale"])
    _close(audio_tower(features, mask, wd, cd), got)
    assert 0 < np.max(np.abs(got - exact)) <= 1e-5 * np.max(np.abs(exact))


def test_the_unified_projectors_are_the_checkpoints_embedders(tmp_path_factory):
    """Gemma 4 Unified's mmproj (gemma4uv, gemma4ua): the configs are config.json's (the merge kernel llama.cpp's
    fixed 3, checked against the patch width), every tensor the checkpoint's once the converter's channels-first
    permutation of patch_dense and patch_ln1 and the swapped position-table axes are undone, and the soft tokens
    of an image and of a clip are the checkpoint's."""
    from refimpl.gguf_mmproj import load_mmproj_tower
    from refimpl.gguf_mmproj_unified import chw_order
    from refimpl.unified import UnifiedVisionWeights, audio_embedder, audio_frames, load_unified_audio, vision_embedder

    model_dir, path = _mmproj("12b-mini", tmp_path_factory)
    (vg, vcg), (ag, acg) = load_mmproj_tower(path, "vision"), load_mmproj_tower(path, "audio")
    vd, vcd = UnifiedVisionWeights.load(model_dir)
    ad, acd = load_unified_audio(model_dir)
    assert (vcg, acg) == (vcd, acd)
    assert (sorted(vg.store.names), sorted(ag.store.names)) == (sorted(vd.expected()), sorted(ad.expected()))
    for g, d in ((vg, vd), (ag, ad)):
        for name in g.store.names:
            assert np.array_equal(g.store.get(name), d.store.get(name)), name
    M = vcd.model_patch_size
    assert sorted(chw_order(M).tolist()) == list(range(3 * M * M))
    rng = np.random.default_rng(9)
    pixels = rng.random((8, vcd.patch_dim))
    positions = np.array([(x, y) for y in range(2) for x in range(3)] + [(-1, -1)] * 2)
    _close(vision_embedder(pixels, positions, vd, vcd), vision_embedder(pixels, positions, vg, vcg))
    frames = audio_frames(rng.standard_normal(3000) * 0.1, acd)
    _close(audio_embedder(frames, ad, acd), audio_embedder(frames, ag, acg))


def _ppm(path, pixels: np.ndarray):
    h, w, _ = pixels.shape
    path.write_bytes(b"P6\n%d %d\n255\n" % (w, h) + pixels.tobytes())
    return path


def _wav(path, n: int, seed: int):
    import wave

    x = np.random.default_rng(seed).normal(0, 0.2, n)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes())
    return path


def _logits(tmp_path, name: str, argv: list[str], capsys) -> tuple[np.ndarray, np.ndarray]:
    from refimpl.cli import main

    out = tmp_path / f"{name}.safetensors"
    assert main(["logits", *argv, "--rows", "all", "--out", str(out)]) == 0, capsys.readouterr().err
    store = TensorStore(out)
    return store.get("tokens"), store.get("logits")


@pytest.mark.parametrize("preset, media", [("e2b-vision-mini", "image"), ("31b-vision-mini", "image"),
                                           ("12b-mini", "image audio"), (OMNI, "image audio")])
def test_refimpl_reads_image_and_audio_prompts_through_the_projector(preset, media, tmp_path_factory, tmp_path,
                                                                     capsys):
    """``refimpl logits --model text.gguf --mmproj mmproj.gguf --image ... --audio ...`` (both llama.cpp's
    conversions of one checkpoint) gives the checkpoint directory's prompt and logits: the placeholders from the
    GGUF vocabulary, the image blocks causal on the E-series and bidirectional on the 31B and Unified (the GGUF
    config's rule), the towers from the projector. Equal up to float64 rounding; with the conformer, up to the
    float32 rounding of its stored per_dim_scale."""
    model_dir, mmproj = _mmproj(preset, tmp_path_factory)
    text, _ = convert.convert_to_gguf(model_dir, SOURCE, "f32", tmp_path_factory.mktemp("text"))
    rng = np.random.default_rng(1)
    argv = ["--prompt", "Describe what you see and hear."]
    if "image" in media:
        argv += ["--image", str(_ppm(tmp_path / "a.ppm", rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))),
                 "--max-soft-tokens", "70"]
    if "audio" in media:
        argv += ["--audio", str(_wav(tmp_path / "a.wav", 9_000, 2))]
    want_ids, want = _logits(tmp_path, "dir", ["--model", str(model_dir), *argv], capsys)
    got_ids, got = _logits(tmp_path, "gguf", ["--model", str(text), "--mmproj", str(mmproj), *argv], capsys)
    assert np.array_equal(got_ids, want_ids) and want_ids.size > 20
    assert load_config(text).use_bidirectional_attention == load_config(model_dir).use_bidirectional_attention
    if preset == OMNI:
        assert 0 < np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))
    else:
        _close(want, got)


def test_the_projector_options_are_refused_in_one_line(converted, e256, tmp_path_factory, tmp_path):
    """--mmproj on the command line: a GGUF model asked for an image without it, a checkpoint directory given
    one, a projector without --image/--audio, a file that is no projector, a projector of another width: each one
    line and exit 2."""
    import subprocess
    import sys

    model_dir, text = converted
    _, wide = e256
    _, mmproj = _mmproj("e2b-vision-mini", tmp_path_factory)
    png = _ppm(tmp_path / "a.ppm", np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8))
    cases = [
        ([text, "--image", png], f"{text} is a GGUF text model: its vision and audio towers are in a projector GGUF "
                                 "(convert_hf_to_gguf.py --mmproj); pass it with --mmproj FILE"),
        ([model_dir, "--mmproj", mmproj, "--image", png],
         f"--mmproj applies to a GGUF --model; the checkpoint directory {model_dir} holds its own towers"),
        ([text, "--mmproj", mmproj], "--mmproj applies to --image, --video and --audio"),
        ([text, "--mmproj", text, "--image", png],
         f"{text}: not a projector GGUF (architecture 'clip', from convert_hf_to_gguf.py --mmproj); its architecture "
         "is 'gemma4'"),
        ([text, "--mmproj", mmproj, "--audio", png], f"{mmproj}: the projector holds no audio tower "
                                                     "(clip.has_audio_encoder is not true)"),
        ([wide, "--mmproj", mmproj, "--image", png],
         f"{mmproj}: the vision projector makes soft tokens 64 wide, but the model's hidden size is 256; pass the "
         "projector converted from the same checkpoint"),
    ]
    for (model, *rest), says in cases:
        run = subprocess.run([sys.executable, "-m", "refimpl", "logits", "--model", str(model), "--prompt", "hi",
                              *map(str, rest), "--out", str(tmp_path / "o.safetensors")],
                             capture_output=True, text=True, timeout=300)
        assert (run.returncode, run.stderr) == (2, f"refimpl: error: {says}\n"), rest
    assert not (tmp_path / "o.safetensors").exists()
