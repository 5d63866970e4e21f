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

from conformance.backend import BackendError
from conformance.backends import llama_cpp_engine as eng
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
    SOURCE = eng.resolve_source()
except BackendError:  # pragma: no cover - depends on the machine
    SOURCE = None


@pytest.mark.skipif(SOURCE is None, reason="llama.cpp converter sources missing (scripts/build-llama-cpp.sh)")
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("preset", ["e2b-mini", "26b-a4b-mini", "31b-mini"])
def test_llama_cpps_converter(preset, outtype, tmp_path_factory, tmp_path):
    from refimpl.synth import write_checkpoint

    # a bf16 checkpoint, as published: the converter reads bf16 through float32
    model_dir = write_checkpoint(preset, 0, tmp_path_factory.mktemp("ckpt") / preset)
    path, _ = eng.convert_to_gguf(model_dir, SOURCE, outtype, tmp_path_factory.mktemp("cache"))
    ref, got = load_config(model_dir), load_config(path)
    same = ("architecture", "serialisation", "notes", "max_position_embeddings", "eos_token_ids",
            "use_bidirectional_attention")
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
    path, _ = eng.convert_to_gguf(model_dir, SOURCE, "f32", tmp_path_factory.mktemp("cache"))
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
    path, _ = eng.convert_to_gguf(drafter_dir, SOURCE, "f32", tmp_path_factory.mktemp("cache"))
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


def _mmproj(preset: str, tmp_path_factory):
    """(the preset's directory, the vision projector GGUF llama.cpp's converter makes of it: --mmproj, F32). The
    converter wants image_mean / image_std in processor_config.json, which the synthetic checkpoints leave out:
    0 and 1, the oracle's x / 255 preprocessing."""
    import json
    import subprocess
    import sys

    from refimpl.synth import write_checkpoint

    if SOURCE is None:
        pytest.skip("llama.cpp converter sources missing (scripts/build-llama-cpp.sh)")
    root = tmp_path_factory.mktemp("mmproj")
    model_dir = write_checkpoint(preset, 0, root / preset)
    src = eng.make_tokenizer_json(model_dir, root / "converter-input", 512)
    processor = json.loads((src / "processor_config.json").read_text(encoding="utf-8"))
    processor["image_processor"].update(image_mean=[0.0] * 3, image_std=[1.0] * 3)
    (src / "processor_config.json").write_text(json.dumps(processor), encoding="utf-8")
    out = root / "mmproj.gguf"
    run = subprocess.run([sys.executable, str(SOURCE / "convert_hf_to_gguf.py"), str(src), "--mmproj", "--outtype",
                          "f32", "--outfile", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return model_dir, out


@pytest.mark.parametrize("preset", ["e2b-vision-mini", "31b-vision-mini"])
def test_a_vision_projector_gguf_is_the_checkpoints_tower(preset, tmp_path_factory):
    """The mmproj GGUF of the E-series tower (clipped linears) and of the 26B/31B one (standardize): its config (from
    its keys, its shapes and llama.cpp's fixed values) is config.json's, every tensor the checkpoint's (the patch
    embedder back from channels first, the clip bounds back to scalars), the soft tokens of an image the same."""
    from refimpl.gguf_mmproj import load_mmproj_vision_tower
    from refimpl.vision import load_vision_tower, vision_tower

    model_dir, path = _mmproj(preset, tmp_path_factory)
    (wg, cg), (wd, cd) = load_mmproj_vision_tower(path), load_vision_tower(model_dir)
    assert cg == cd
    assert sorted(wg.store.names) == sorted(n for n in wd.store.names if n.startswith(("model.vision_tower.",
                                                                                       "model.embed_vision.")))
    for name in wg.store.names:
        assert np.array_equal(wg.store.get(name), wd.store.get(name)), name
    rng = np.random.default_rng(3)
    pixels = rng.random((36, 3 * cd.patch_size**2))
    positions = np.array([(x, y) for y in range(6) for x in range(6)])
    _close(vision_tower(pixels, positions, wd, cd), vision_tower(pixels, positions, wg, cg))
    with pytest.raises(RefimplError, match="not a vision projector GGUF"):
        load_mmproj_vision_tower(eng.convert_to_gguf(model_dir, SOURCE, "f32", tmp_path_factory.mktemp("c"))[0])

