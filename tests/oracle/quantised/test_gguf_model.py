"""A Gemma 4 GGUF file as the oracle's checkpoint (issue 45): ``Gemma4(path.gguf)`` and ``refimpl --model
FILE.gguf``. Shown by independent paths: a GGUF written at F32 from a bundled checkpoint gives the checkpoint's
logits; at F16 / BF16 / Q8_0 / Q4_0 / Q5_0 the logits of a safetensors checkpoint holding the values gguf-py
decodes from the same blocks; its config equals config.json's. Bad metadata and tensors: one line, exit 2,
nothing written."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import gguf.quants as gguf_quants
import numpy as np
import pytest
from gguf_writer import T, converter_name, decoded_checkpoint, metadata, write_gguf

from refimpl import Gemma4, load_config
from refimpl.errors import RefimplError
from refimpl.safetensors_io import TensorStore, write_safetensors
from refimpl.weights import expected_tensors

PRESETS = ("e2b-mini", "e4b-mini", "26b-a4b-mini", "31b-mini", "all-features")
IDS = list(range(3, 40))
A = "gemma4"


def _close(a: np.ndarray, b: np.ndarray) -> None:
    """Equal up to float64 rounding (a few ulps of the largest logit)."""
    assert a.shape == b.shape
    assert float(np.max(np.abs(a - b))) <= 1e-12 * max(1.0, float(np.max(np.abs(a))))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """(preset, outtype) -> a GGUF of that preset, written once."""
    root, made = tmp_path_factory.mktemp("gguf"), {}

    def get(preset_dirs, preset: str, outtype: T = T.F32) -> Path:
        if (preset, outtype) not in made:
            made[preset, outtype] = write_gguf(preset_dirs[preset], root / f"{preset}-{outtype.name}.gguf", outtype)
        return made[preset, outtype]
    return get


def _decoded_checkpoint(model_dir: Path, path: Path, out: Path) -> Path:
    """``model_dir``'s config with the values gguf-py decodes from the GGUF ``path`` (float32: exact for F16, BF16,
    Q8_0, Q4_0 and Q5_0)."""
    return decoded_checkpoint(model_dir, path, out, lambda t: gguf_quants.dequantize(t.data, t.tensor_type))


@pytest.mark.parametrize("preset", PRESETS)
def test_an_f32_gguf_gives_the_checkpoints_logits(preset, preset_dirs, ggufs):
    path = ggufs(preset_dirs, preset)
    want = Gemma4(preset_dirs[preset]).forward(IDS, rows="all")
    _close(want, Gemma4(path).forward(IDS, rows="all"))
    _close(want[[5, 36]], Gemma4(path).forward(IDS, rows=[5, 36]))  # the pruned and streamed paths too


@pytest.mark.parametrize("preset", PRESETS)
def test_the_config_is_config_jsons(preset, preset_dirs, ggufs):
    ref, got = load_config(preset_dirs[preset]), load_config(ggufs(preset_dirs, preset))
    # not in a GGUF: the serialisation and notes (the vision-block mask is gguf_config's rule, equal here)
    same = ("architecture", "serialisation", "notes", "max_position_embeddings", "eos_token_ids")
    assert dataclasses.replace(got, **{k: getattr(ref, k) for k in same}) == ref
    assert got.eos_token_ids == ref.eos_token_ids[:1]  # the GGUF keeps one eos id (and an eot id when written)


@pytest.mark.parametrize("outtype", [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q5_0])
@pytest.mark.parametrize("preset", ["e2b-mini", "26b-a4b-mini"])
def test_a_quantised_gguf_gives_the_logits_of_its_decoded_values(preset, outtype, preset_dirs, ggufs, tmp_path):
    path = ggufs(preset_dirs, preset, outtype)
    decoded = _decoded_checkpoint(preset_dirs[preset], path, tmp_path / "decoded")
    model = Gemma4(path)
    assert outtype.name in model.weights.storage_dtypes
    _close(Gemma4(decoded).forward(IDS, rows="all"), model.forward(IDS, rows="all"))
    _close(Gemma4(decoded).forward(IDS[:9], rows="last"), model.forward(IDS[:9], rows="last"))


def _refused(preset_dirs, tmp_path, message: str, **edits) -> None:
    path = write_gguf(preset_dirs["e2b-mini"], tmp_path / "bad.gguf", **edits)
    with pytest.raises(RefimplError) as err:
        Gemma4(path)
    assert str(err.value) == message.format(path=path)
    out = tmp_path / "out.safetensors"
    run = subprocess.run([sys.executable, "-m", "refimpl", "logits", "--model", str(path), "--tokens", "2,5",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (2, "", f"refimpl: error: {message.format(path=path)}\n")
    assert not out.exists()


MISSING = "is missing; is this a Gemma 4 GGUF written by llama.cpp's convert_hf_to_gguf.py?"
BAD_GGUFS = {
    "missing key": ({"kv": {f"{A}.embedding_length": None}},
                    f"{{path}}: metadata key '{A}.embedding_length' {MISSING}"),
    "ill-typed key": ({"kv": {f"{A}.block_count": "ten"}},
                      f"{{path}}: metadata key '{A}.block_count' must be an integer, got 'ten'"),
    "zero key": ({"kv": {f"{A}.attention.head_count": 0}},
                 f"{{path}}: metadata key '{A}.attention.head_count' must be at least 1, got 0"),
    "negative eps": ({"kv": {f"{A}.attention.layer_norm_rms_epsilon": -1.0}},
                     f"{{path}}: metadata key '{A}.attention.layer_norm_rms_epsilon' must be a positive number, "
                     "got -1.0"),
    "short pattern": ({"kv": {f"{A}.attention.sliding_window_pattern": [True, False]}},
                      f"{{path}}: metadata key '{A}.attention.sliding_window_pattern' must hold one value per "
                      "layer (10 = gemma4.block_count), got 2"),
    "ints as pattern": ({"kv": {f"{A}.attention.sliding_window_pattern": [1] * 10}},
                        f"{{path}}: metadata key '{A}.attention.sliding_window_pattern' must be a boolean or a list "
                        "of them, got [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"),
    "odd widths": ({"kv": {f"{A}.feed_forward_length": [128] * 9 + [64]}},
                   f"{{path}}: metadata key '{A}.feed_forward_length' is [128, 128, 128, 128, 128, 128, 128, 128, "
                   "128, 64]; Gemma 4 has one width, or twice it on the KV-shared layers (from layer 5) with "
                   "use_double_wide_mlp"),
    "all shared": ({"kv": {f"{A}.attention.shared_kv_layers": 10}},
                   f"{{path}}: metadata key '{A}.attention.shared_kv_layers' is 10, not below gemma4.block_count "
                   "(10)"),
    "partial sliding rope": ({"kv": {f"{A}.rope.dimension_count_swa": 8}},
                             f"{{path}}: metadata key '{A}.rope.dimension_count_swa' is 8, not 16; Gemma 4 layers "
                             "use one head dim for K and V and rotate all of it (the full layers' partial rotation "
                             "is rope_freqs.weight)"),
    "other architecture": ({"arch": "llama"},
                           "{path}: architecture 'llama', not 'gemma4'; the oracle reads Gemma 4 text models"),
    "drafter": ({"arch": "gemma4-assistant"},
                "{path}: an MTP drafter GGUF (architecture 'gemma4-assistant'); pass it as the drafter, and the "
                "target model's GGUF (architecture 'gemma4') as the model"),
    "no embedding": ({"drop": ("token_embd.weight",)},
                     "{path}: no tensor 'token_embd.weight'; a Gemma 4 text GGUF holds its embedding table"),
    "missing tensor": ({"drop": ("blk.3.ffn_up.weight",)},
                       "{path}: the weights do not match its metadata:\n  missing tensor "
                       "'model.layers.3.mlp.up_proj.weight' (expected shape [128, 64])"),
}


@pytest.mark.parametrize("case", BAD_GGUFS)
def test_bad_metadata_and_tensors_are_refused_in_one_line(case, preset_dirs, tmp_path):
    edits, message = BAD_GGUFS[case]
    if "\n" in message:  # a list of problems: the library's message, the CLI prints it as it is
        path = write_gguf(preset_dirs["e2b-mini"], tmp_path / "bad.gguf", **edits)
        with pytest.raises(RefimplError) as err:
            Gemma4(path)
        assert str(err.value) == message.format(path=path)
        return
    _refused(preset_dirs, tmp_path, message, **edits)


def test_a_type_the_oracle_does_not_decode_is_named(preset_dirs, tmp_path):
    path = write_gguf(preset_dirs["e2b-mini"], tmp_path / "k.gguf", types={"blk.0.attn_q.weight": T.IQ4_NL})
    with pytest.raises(RefimplError) as err:
        Gemma4(path)
    assert str(err.value) == (
        f"{path}: the weights do not match its metadata:\n  tensor 'blk.0.attn_q.weight' "
        "(model.layers.0.self_attn.q_proj.weight) is of ggml type IQ4_NL, which the oracle does not decode (it "
        "decodes F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16)")


@pytest.mark.parametrize("freqs, message", [
    ([1.0, 0.5] + [1e30] * 14, "{path}: rope_freqs.weight is not n entries of 1.0 followed by 1e30 (the converter's "
                               "encoding of Gemma 4's proportional RoPE); the oracle reads no other frequency factors"),
    ([1e30] * 16, "{path}: rope_freqs.weight is not n entries of 1.0 followed by 1e30 (the converter's encoding of "
                  "Gemma 4's proportional RoPE); the oracle reads no other frequency factors"),
    ([1.0] * 32, "{path}: rope_freqs.weight has shape [32], expected [16] (half of gemma4.attention.key_length, 32)"),
])
def test_a_rope_freqs_the_converter_does_not_write_is_refused(freqs, message, preset_dirs, tmp_path, monkeypatch):
    import gguf_writer

    monkeypatch.setattr(gguf_writer, "rope_freqs", lambda d: np.array(freqs, dtype=np.float32))
    _refused(preset_dirs, tmp_path, message)


def test_the_cli_reads_a_gguf(preset_dirs, ggufs, tmp_path):
    path = ggufs(preset_dirs, "e2b-mini")
    out = tmp_path / "l.safetensors"
    run = subprocess.run([sys.executable, "-m", "refimpl", "logits", "--model", str(path), "--tokens", "2,5,6,7",
                          "--rows", "all", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = TensorStore(out).get("logits")
    _close(Gemma4(preset_dirs["e2b-mini"]).forward([2, 5, 6, 7], rows="all"), got)
    run = subprocess.run([sys.executable, "-m", "refimpl", "inspect", "--model", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith(f"{path}: Gemma4ForCausalLM (GGUF metadata)"), run.stderr
    run = subprocess.run([sys.executable, "-m", "refimpl", "logits", "--model", str(path), "--prompt", "hi",
                          "--out", str(tmp_path / "p.safetensors")], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (2, f"refimpl: error: {path}: the GGUF file holds no vocabulary "
                                               "(tokenizer.ggml.tokens) and no tokenizer.model lies beside it; pass "
                                               "token ids with --tokens instead of --prompt\n")


def test_the_writer_writes_what_the_spec_lists(preset_dirs):
    """The helper's keys are the converter's (the quantised-weights spec §3.2), so the tests above read what the
    converter writes; llama.cpp's converter itself is compared in test_llama_cpp_converter_agrees."""
    kv = metadata(preset_dirs["e2b-mini"])
    assert kv[f"{A}.feed_forward_length"] == [128] * 5 + [256] * 5  # double wide on the KV-shared layers
    assert kv[f"{A}.attention.sliding_window_pattern"] == ([True] * 4 + [False]) * 2  # (4 sliding, 1 full) x 2


@pytest.mark.parametrize("rows", [1, 16, 17])
def test_streamed_product_on_threads_equals_the_decoded_product(rows, preset_dirs, ggufs, monkeypatch):
    """The products stream a Q8_0 weight's blocks of rows on each thread (at most FEW_ROWS rows of x) or decode it
    into a buffer (more): both equal x @ W.T with W decoded whole by GGUFFile.get, on one thread or three."""
    import refimpl.weights as weights
    from refimpl.gguf_io import GGUFFile
    from refimpl.threads import use_threads

    path = ggufs(preset_dirs, "e2b-mini", T.Q8_0)
    w = Gemma4(path).weights
    monkeypatch.setattr(weights, "STREAM_VALUES", 300)  # 4 rows of 64 per block: many blocks
    name = "model.layers.7.mlp.gate_proj.weight"  # a double-wide [256, 64] Q8_0 weight
    assert w.store.infos[name].dtype == "Q8_0"
    x = np.random.default_rng(3).standard_normal((rows, 64))
    W = GGUFFile(path).get("blk.7.ffn_gate.weight")
    want = x @ W.T
    by_threads = {}
    for threads in (1, 3):
        with use_threads(threads):
            by_threads[threads] = w.product(x, name)
            assert np.max(np.abs(by_threads[threads] - want)) < 1e-12
            assert np.max(np.abs(w.product(x, name, 10, 50) - want[:, 10:50])) < 1e-12  # rows of W
            assert np.array_equal(w.store.read(name, 3, 200), W[3:200])  # decoding rounds nothing
    assert np.max(np.abs(by_threads[1] - by_threads[3])) < 1e-12


def test_forward_reads_tables_by_rows_and_the_head_in_chunks(preset_dirs, ggufs, monkeypatch):
    """No embedding table of a GGUF is decoded whole: the PLE table and the embeddings are gathered by rows, the
    head decoded HEAD_CHUNK rows at a time (here 100)."""
    from refimpl.gguf_store import GGUFStore

    model = Gemma4(ggufs(preset_dirs, "e2b-mini", T.Q8_0))
    reads, gathers = [], []
    real_read, real_rows = GGUFStore.read, GGUFStore.rows

    def read(self, name, start=0, stop=None, dtype=np.float64, out=None):
        got = real_read(self, name, start, stop, dtype, out)
        reads.append((name, start, got.shape[0]))
        return got

    monkeypatch.setattr(GGUFStore, "read", read)
    monkeypatch.setattr(GGUFStore, "rows", lambda self, name, index, dtype=np.float64:
                        gathers.append(name) or real_rows(self, name, index, dtype))
    monkeypatch.setattr("refimpl.model.HEAD_CHUNK", 100)
    model.forward(IDS, rows="all")
    tables = [(n, a, r) for n, a, r in reads if "embed_tokens" in n]
    assert all(n == "model.embed_tokens.weight" for n, _, _ in tables)
    assert [(a, r) for _, a, r in tables] == [(0, 100), (100, 100), (200, 100), (300, 100), (400, 100), (500, 12)]
    assert {"model.embed_tokens.weight", "model.embed_tokens_per_layer.weight"} <= set(gathers)


def _rounded(values: np.ndarray, qtype: T) -> np.ndarray:
    """float32 values rounded to F16 or BF16 (nearest, ties to even) and back, written out here from the formats."""
    x = values.astype(np.float32)
    if qtype == T.F16:
        return x.astype(np.float16).astype(np.float64)
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("outtype", [T.F16, T.BF16])
def test_an_f16_or_bf16_gguf_is_the_checkpoint_rounded_to_that_type(outtype, preset_dirs, ggufs, tmp_path):
    """The weights the converter stores as F16 / BF16 (2-D, not the router), rounded to that type by hand: the GGUF
    gives that checkpoint's logits."""
    from gguf_writer import converter_type

    model_dir = preset_dirs["e4b-mini"]
    store = TensorStore(model_dir)
    cfg = load_config(model_dir)
    tensors = {}
    for name in expected_tensors(cfg):
        values = store.get("model." + name)
        kept = converter_type(converter_name(name, cfg.num_hidden_layers), values.ndim, outtype) == T.F32
        tensors["model." + name] = values if kept else _rounded(values, outtype)
    (tmp_path / "r").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "r" / "config.json")
    write_safetensors(tmp_path / "r" / "model.safetensors", tensors, "F32")
    _close(Gemma4(tmp_path / "r").forward(IDS, rows="all"), Gemma4(ggufs(preset_dirs, "e4b-mini", outtype)).forward(
        IDS, rows="all"))


@pytest.mark.parametrize("cut, message", [
    (lambda raw: raw[:len(raw) // 2], "runs past the end of the file"),
    (lambda raw: raw[:7000], "truncated: dimension 0 of blk.5.ffn_up.weight needs 8 bytes, 3 are left"),
    (lambda raw: raw[:100], "the header claims 161 tensors and 24 KV pairs, more than the file can hold"),
    (lambda raw: raw[:8] + (2**40).to_bytes(8, "little") + raw[16:], "the header claims 1099511627776 tensors"),
    (lambda raw: b"GGUX" + raw[4:], "not a GGUF file (it starts with b'GGUX', not b'GGUF')"),
])
def test_a_broken_gguf_is_one_line_and_exit_2_from_the_cli(cut, message, preset_dirs, ggufs, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(cut(ggufs(preset_dirs, "e2b-mini").read_bytes()))
    for command in (["logits", "--tokens", "2,5", "--out", str(tmp_path / "o.safetensors")],
                    ["generate", "--tokens", "2,5", "--max-new-tokens", "2"], ["inspect"]):
        run = subprocess.run([sys.executable, "-m", "refimpl", command[0], "--model", str(bad), *command[1:]],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and run.stdout == "" and message in run.stderr, (command, run.stderr)
        assert run.stderr.startswith(f"refimpl: error: {bad}: ") and run.stderr.count("\n") == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_a_gguf_chat_template_and_the_tokenizer_beside_it(preset_dirs, tmp_path):
    """--prompt --chat on a GGUF: the tokenizer.model beside the file encodes, the file's tokenizer.chat_template
    renders: the same ids and logits as the checkpoint directory with that template as chat_template.jinja."""
    pytest.importorskip("jinja2")
    from refimpl.cli import main

    template = ("{{ bos_token }}{% for m in messages %}<|turn>gemma {{ m['role'] }}\n{{ m['content'] | trim }}<turn|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    src = preset_dirs["e2b-mini"]
    (tmp_path / "g").mkdir()
    shutil.copy(src / "tokenizer.model", tmp_path / "g" / "tokenizer.model")
    path = write_gguf(src, tmp_path / "g" / "m.gguf", kv={"tokenizer.chat_template": template})
    shutil.copytree(src, tmp_path / "d")
    (tmp_path / "d" / "chat_template.jinja").write_text(template, encoding="utf-8")
    got = {}
    for name, model in (("d", tmp_path / "d"), ("g", path)):
        out = tmp_path / f"{name}.safetensors"
        assert main(["logits", "--model", str(model), "--prompt", "  the table ", "--chat", "--out", str(out)]) == 0
        got[name] = TensorStore(out)
    assert np.array_equal(got["d"].get("tokens"), got["g"].get("tokens"))
    from refimpl.tokenizer import Tokenizer

    text = Tokenizer.from_dir(path).decode(got["g"].get("tokens").tolist())
    assert text == "<|turn>gemma user\nthe table<turn|>\n<|turn>model\n"  # rendered by the file's template
    _close(got["d"].get("logits"), got["g"].get("logits"))


@pytest.mark.parametrize("argv", [["generate", "--model", "{dir}", "--drafter", "{path}", "--out", "{out}"],
                                  ["check", "--backend", "refimpl", "--drafter", "{path}"]])
def test_the_gate_says_a_drafter_gguf_is_not_a_checkpoint_directory(argv, preset_dirs, ggufs, tmp_path):
    """--drafter FILE.gguf on generate / check: one line and exit 2, saying where a drafter GGUF is read, not "no
    such directory". (A GGUF --model makes and checks sets: tests/gate/generate/test_quantised_sets.py.)"""
    path = ggufs(preset_dirs, "e2b-mini")
    args = [a.format(path=path, dir=preset_dirs["e2b-mini"], out=tmp_path / "set") for a in argv]
    run = subprocess.run([sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.endswith(f"--drafter {path}: a GGUF file; a set's MTP drafter is a checkpoint directory "
                               "(config.json and safetensors); the oracle reads a drafter GGUF with "
                               "refimpl.assistant.Drafter\n") and run.stderr.count("\n") == 1, run.stderr
    assert not (tmp_path / "set").exists()


def _projector(path, meta: dict, tensors: dict, arch: str = "clip") -> None:
    from gguf_writer import add_kv

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        add_kv(w, key, value)
    for name, x in tensors.items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("meta, tower, says", [
    ({"clip.has_vision_encoder": True, "clip.vision.projector_type": "gemma3"}, "vision",
     "vision projector type 'gemma3'; the oracle reads Gemma 4's ('gemma4v' and 'gemma4uv')"),
    ({"clip.has_audio_encoder": True, "clip.audio.projector_type": "qwen2a"}, "audio",
     "audio projector type 'qwen2a'; the oracle reads Gemma 4's ('gemma4a' and 'gemma4ua')"),
    ({"clip.has_vision_encoder": True, "clip.vision.projector_type": "gemma4v"}, "audio",
     "the projector holds no audio tower (clip.has_audio_encoder is not true)"),
    ({"clip.has_vision_encoder": True}, "vision",
     "metadata key 'clip.vision.projector_type' is missing or not a string"),
    ({"clip.has_vision_encoder": True, "clip.vision.projector_type": "gemma4uv", "clip.vision.patch_size": 4}, "vision",
     "'v.patch_embd.weight' takes 3 values per patch, but patch size 4 x merge 3 makes 432 (3 x 12^2)"),
    ({"clip.has_audio_encoder": True, "clip.audio.projector_type": "gemma4ua"}, "audio",
     "no tensor 'mm.a.input_projection.weight'; a Gemma 4 audio projector holds it"),
])
def test_a_projector_the_oracle_does_not_read_is_refused(tmp_path, meta, tower, says):
    """Other projector types, a missing tower, a patch width that is not the geometry's: one line naming the
    file."""
    from refimpl.gguf_mmproj import load_mmproj_tower

    path = tmp_path / "mmproj.gguf"
    _projector(path, meta, {"v.patch_embd.weight": np.zeros((4, 3), dtype=np.float32)})
    with pytest.raises(RefimplError) as err:
        load_mmproj_tower(path, tower)
    assert str(err.value) == f"{path}: {says}"


def test_a_text_gguf_is_not_a_projector(tmp_path):
    from refimpl.gguf_mmproj import load_mmproj_tower

    path = tmp_path / "text.gguf"
    _projector(path, {}, {"token_embd.weight": np.zeros((4, 3), dtype=np.float32)}, arch="gemma4")
    with pytest.raises(RefimplError) as err:
        load_mmproj_tower(path, "audio")
    assert str(err.value) == (f"{path}: not a projector GGUF (architecture 'clip', from convert_hf_to_gguf.py "
                              "--mmproj); its architecture is 'gemma4'")
