"""Hostile or broken inputs end in one error line and a non-zero exit, never a traceback, a silent
overwrite or a non-finite golden (issue 15): ``logits --out`` over existing files and the checkpoint,
image decompression bombs, a huge ``num_hidden_layers``, NaN/inf weights, a ``generation_config.json``
that is not an object, placeholder ids outside the vocabulary."""

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import wave
import zlib

import numpy as np
import pytest
import strict_device
from helpers import micro_checkpoint, micro_config

from conformance.cli import main as conformance_main
from refimpl.cli import main
from refimpl.errors import TokenizerError
from refimpl.model import Gemma4
from refimpl.safetensors_io import TensorStore, write_safetensors
from refimpl.synth import write_checkpoint
from refimpl.tokenizer import Tokenizer


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_conformance(capsys, *argv):
    code = conformance_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    return write_checkpoint("e2b-mini", 0, tmp_path_factory.mktemp("robust") / "e2b")


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory):
    return write_checkpoint("e2b-vision-mini", 0, tmp_path_factory.mktemp("robust") / "vision")


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------------------------
# 9. logits --out: no silent overwrite, never into the checkpoint


def test_logits_out_refuses_an_existing_file_without_force(tmp_path, text_ckpt, capsys, monkeypatch):
    out = tmp_path / "golden.safetensors"
    out.write_text("keep me")
    monkeypatch.setattr(Gemma4, "forward", lambda *a, **k: pytest.fail("the forward ran before --out was checked"))
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", out)
    assert code == 2
    assert err == f"refimpl: error: --out {out} already exists; pass --force to overwrite it, or choose another path\n"
    assert out.read_text() == "keep me"
    monkeypatch.undo()
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", out, "--force")
    assert code == 0, err
    assert TensorStore(out).raw("tokens").tolist() == [2, 5]


def test_logits_out_is_written_whole_or_not_at_all(tmp_path, text_ckpt, capsys, monkeypatch):
    """An interrupt while the logits are written (gigabytes for --rows all at real size) leaves no truncated
    file and keeps the one --force was replacing; a link is written through; a missing directory is said
    before the forward."""
    out = tmp_path / "golden.safetensors"
    out.write_text("keep me")

    def interrupted(path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half a header")
        raise KeyboardInterrupt

    monkeypatch.setattr("refimpl.cli.write_safetensors", interrupted)
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", out, "--force")
    assert code == 130 and err == "refimpl: interrupted by SIGINT\n"
    assert out.read_text() == "keep me" and [p.name for p in tmp_path.iterdir()] == ["golden.safetensors"]
    monkeypatch.undo()
    link = tmp_path / "link.safetensors"
    link.symlink_to(out)
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", link, "--force")
    assert code == 0, err
    assert link.is_symlink() and TensorStore(out).raw("tokens").tolist() == [2, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden.safetensors", "link.safetensors"]
    missing = tmp_path / "no" / "o.safetensors"
    monkeypatch.setattr(Gemma4, "forward", lambda *a, **k: pytest.fail("the forward ran before --out was checked"))
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", missing)
    assert code == 2
    assert err == f"refimpl: error: --out {missing}: the directory {missing.parent} does not exist; create it first\n"


def test_logits_out_never_writes_into_the_model_directory(tmp_path, text_ckpt, capsys):
    model = copy_ckpt(text_ckpt, tmp_path / "ckpt")
    before = {p.name: sha(p) for p in model.iterdir()}
    for out, extra in ((model / "model.safetensors", ["--force"]), (model / "new.safetensors", []),
                       (model / "sub" / ".." / "model.safetensors", ["--force"])):
        code, _, err = run(capsys, "logits", "--model", model, "--tokens", "2,5", "--out", out, *extra)
        assert code == 2
        assert err == (f"refimpl: error: --out {out} is inside the model directory {model}; refimpl never writes into "
                       "a checkpoint, choose a path outside it\n")
    # a symbolic link outside the directory that points at the checkpoint's weights
    link = tmp_path / "link.safetensors"
    link.symlink_to(model / "model.safetensors")
    code, _, err = run(capsys, "logits", "--model", model, "--tokens", "2,5", "--out", link, "--force")
    assert code == 2
    assert err == (f"refimpl: error: --out {link} is inside the model directory {model}; refimpl never writes into a "
                   "checkpoint, choose a path outside it\n")
    assert {p.name: sha(p) for p in model.iterdir()} == before


def test_logits_out_refuses_a_directory(tmp_path, text_ckpt, capsys):
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", tmp_path, "--force")
    assert code == 2
    assert err == f"refimpl: error: --out {tmp_path} is a directory; pass the path of the .safetensors file to write\n"


# ----------------------------------------------------------------------------------------------
# 10. decompression bombs: the pixel count is checked from the header, before decoding


def png_bytes(width, height, idat, depth=8, ctype=0):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, ctype, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def small_png(path, height=30, width=40):
    raw = b"".join(b"\x00" + bytes(range(width)) for _ in range(height))
    path.write_bytes(png_bytes(width, height, zlib.compress(raw)))
    return path


def bomb_message(path, height, width, limit=89_478_485):
    return (f"image {path} is {height}x{width} (HxW), {height * width} pixels: more than the limit of {limit} pixels "
            "that guards against decompression bombs; set REFIMPL_MAX_IMAGE_PIXELS to a larger number of pixels "
            "to read it")


def test_png_bomb_is_refused_from_its_header_before_decompression(tmp_path, vision_ckpt, capsys, monkeypatch):
    # a valid PNG declaring 100000 x 100000 grey pixels (10 GB decoded) with a tiny compressed stream:
    # the limit must fire before zlib runs (without it the reader reports the stream as truncated)
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_bytes(100_000, 100_000, zlib.compress(b"\x00" * 1000)))
    monkeypatch.setattr("refimpl.image._inflate", lambda *a: pytest.fail("the PNG was decompressed"))
    code, _, err = run(capsys, "logits", "--model", vision_ckpt, "--tokens", "2,5", "--image", bomb,
                       "--out", tmp_path / "o.safetensors")
    assert code == 2
    assert err == f"refimpl: error: {bomb_message(bomb, 100_000, 100_000)}\n"
    assert not (tmp_path / "o.safetensors").exists()


def test_image_pixel_limit_is_set_by_the_environment(tmp_path, vision_ckpt, capsys, monkeypatch):
    png = small_png(tmp_path / "small.png")  # 30 x 40 = 1200 pixels
    ppm = tmp_path / "small.ppm"
    ppm.write_bytes(b"P6 40 30 255\n" + bytes(30 * 40 * 3))
    argv = ["logits", "--model", vision_ckpt, "--tokens", "2,5", "--out", tmp_path / "o.safetensors", "--force"]
    monkeypatch.setenv("REFIMPL_MAX_IMAGE_PIXELS", "1000")
    for image in (png, ppm):
        code, _, err = run(capsys, *argv, "--image", image)
        assert code == 2
        assert err == f"refimpl: error: {bomb_message(image, 30, 40, 1000)}\n"
    monkeypatch.setenv("REFIMPL_MAX_IMAGE_PIXELS", "1200")
    for image in (png, ppm):
        code, out, err = run(capsys, *argv, "--image", image)
        assert code == 0, err
        assert f"image 0 {image}: 30x40 (HxW)" in out
    monkeypatch.setenv("REFIMPL_MAX_IMAGE_PIXELS", "lots")
    code, _, err = run(capsys, *argv, "--image", png)
    assert code == 2
    assert err == ("refimpl: error: REFIMPL_MAX_IMAGE_PIXELS='lots': the image size limit must be a positive whole "
                   "number of pixels\n")


def test_pillow_bomb_is_refused_with_the_same_limit(tmp_path, vision_ckpt, capsys):
    pytest.importorskip("PIL")
    # a 24-bit BMP header declaring 100000 x 100000 pixels and no pixel data: Pillow opens it lazily
    width = height = 100_000
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    bmp = tmp_path / "bomb.bmp"
    bmp.write_bytes(b"BM" + struct.pack("<IHHI", 14 + len(info), 0, 0, 14 + len(info)) + info)
    code, _, err = run(capsys, "logits", "--model", vision_ckpt, "--tokens", "2,5", "--image", bmp,
                       "--out", tmp_path / "o.safetensors")
    assert code == 2
    assert err == f"refimpl: error: {bomb_message(bmp, height, width)}\n"


def test_conformance_generate_refuses_an_image_bomb(tmp_path, vision_ckpt, capsys):
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_bytes(100_000, 100_000, zlib.compress(b"\x00" * 1000)))
    code, _, err = run_conformance(capsys, "generate", "--model", vision_ckpt, "--image", bomb,
                                   "--out", tmp_path / "set", "--workers", "1", "-q")
    assert code == 2
    assert err == f"conformance: error: {bomb_message(bomb, 100_000, 100_000)}\n"
    assert not (tmp_path / "set").exists()


# ----------------------------------------------------------------------------------------------
# 11. sizes are bounded by the checkpoint's tensors before per-layer lists are derived


def test_num_hidden_layers_beyond_the_checkpoint_is_refused_before_deriving_layers(tmp_path, capsys):
    model = micro_checkpoint(tmp_path / "m", micro_config(), 0)  # 3 layers
    for layers in (100_000, 10**9):  # 10^9 without layer_types once built a 7.9 GB list
        raw = json.loads((model / "config.json").read_text())
        raw["num_hidden_layers"] = layers
        raw.pop("layer_types", None)
        (model / "config.json").write_text(json.dumps(raw))
        for argv in (["inspect"], ["logits", "--tokens", "2,5", "--out", tmp_path / "o.safetensors"]):
            code, _, err = run(capsys, argv[0], "--model", model, *argv[1:])
            assert code == 2
            assert err == (f"refimpl: error: {model / 'config.json'}: 'num_hidden_layers' is {layers}, but the "
                           "checkpoint's tensors hold 3 decoder layers; set num_hidden_layers to the number of layers "
                           "the weights hold\n")


# ----------------------------------------------------------------------------------------------
# 13. generation_config.json that is not an object; placeholder ids outside the vocabulary


@pytest.mark.parametrize("content, kind", [("[1, 2]", "an array"), ('"eos"', "a string"), ("null", "null")])
def test_generation_config_must_be_an_object(tmp_path, text_ckpt, capsys, content, kind):
    model = copy_ckpt(text_ckpt, tmp_path / "ckpt")
    (model / "generation_config.json").write_text(content)
    for argv in (["inspect"], ["generate", "--tokens", "2,5", "--max-new-tokens", "1"]):
        code, _, err = run(capsys, argv[0], "--model", model, *argv[1:])
        assert code == 2
        assert err == (f"refimpl: error: {model / 'generation_config.json'}: expected a JSON object at the top level, "
                       f"got {kind}; fix or remove generation_config.json\n")


def test_an_integer_too_long_for_python_is_invalid_json(tmp_path, text_ckpt, capsys):
    model = copy_ckpt(text_ckpt, tmp_path / "ckpt")
    cfg = json.loads((model / "config.json").read_text())
    text = json.dumps(cfg).replace('"vocab_size": ', '"vocab_size": ' + "9" * 5000 + ", \"_was\": ", 1)
    (model / "config.json").write_text(text)
    code, _, err = run(capsys, "inspect", "--model", model)
    assert code == 2
    assert err.startswith(f"refimpl: error: {model / 'config.json'}: not valid JSON (Exceeds the limit (4300 digits)")
    assert err.count("\n") == 1


@pytest.mark.parametrize("key", ["image_token_id", "boi_token_id", "eoi_token_id"])
def test_image_ids_outside_the_vocabulary_are_refused(tmp_path, vision_ckpt, capsys, key):
    model = copy_ckpt(vision_ckpt, tmp_path / "ckpt")
    raw = json.loads((model / "config.json").read_text())
    raw[key] = 100_000  # the vocabulary is 512
    (model / "config.json").write_text(json.dumps(raw))
    png = small_png(tmp_path / "small.png")
    message = (f"{model / 'config.json'}: '{key}' is 100000, outside the text vocabulary [0, 512); image prompts "
               "need it inside (fix the id, or the text vocab_size)\n")
    for prompt in (["--prompt", "hi"], ["--prompt", "hi", "--chat"], ["--tokens", "2,5"]):
        code, _, err = run(capsys, "logits", "--model", model, *prompt, "--image", png,
                           "--out", tmp_path / "o.safetensors")
        assert code == 2
        assert err == f"refimpl: error: {message}"
    code, _, err = run_conformance(capsys, "generate", "--model", model, "--image", png, "--out", tmp_path / "set",
                                   "--workers", "1", "-q")
    assert code == 2
    assert err == f"conformance: error: {message}"


@pytest.mark.parametrize("key", ["audio_token_id", "eoa_token_index"])
def test_audio_ids_outside_the_vocabulary_are_refused(tmp_path, capsys, key):
    model = write_checkpoint("e2b-audio-mini", 0, tmp_path / "ckpt")
    raw = json.loads((model / "config.json").read_text())
    raw[key] = 100_000
    (model / "config.json").write_text(json.dumps(raw))
    wav = tmp_path / "a.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(bytes(2 * 1600))  # 0.1 s of silence
    code, _, err = run(capsys, "logits", "--model", model, "--prompt", "hi", "--audio", wav,
                       "--out", tmp_path / "o.safetensors")
    assert code == 2
    assert err == (f"refimpl: error: {model / 'config.json'}: '{key}' is 100000, outside the text vocabulary [0, 512); "
                   "audio prompts need it inside (fix the id, or the text vocab_size)\n")


def test_tokenizer_piece_outside_its_pieces_is_an_error(text_ckpt):
    tok = Tokenizer.from_dir(text_ckpt)
    with pytest.raises(TokenizerError) as e:
        tok.piece(100_000)
    assert str(e.value) == f"{text_ckpt / 'tokenizer.model'}: token id 100000 is outside the tokenizer's 512 pieces"


# ----------------------------------------------------------------------------------------------
# 12. NaN / inf: refused with the first place and tensor where they appear, never written as goldens


def poisoned(src, dst, changes, dtype="F32"):
    """A copy of checkpoint ``src`` with ``changes`` {tensor: (flat index, value)} applied, stored as ``dtype``."""
    shutil.copytree(src, dst)
    store = TensorStore(src)
    tensors = {name: np.array(store.get(name, np.float64)) if store.infos[name].dtype != "U8" else store.raw(name)
               for name in store.names}
    for name, (index, value) in changes.items():
        tensors[name].flat[index] = value
    write_safetensors(dst / "model.safetensors", tensors, dtype)
    return dst


CORRUPT = "; the checkpoint is corrupt (re-download or re-convert it)"


@pytest.mark.parametrize(("dtype", "device"), [("F32", "cpu"), ("BF16", "cpu"), ("BF16", "cuda")])
def test_nan_weight_names_the_layer_and_tensor(tmp_path, text_ckpt, capsys, monkeypatch, dtype, device):
    """cuda: on the device (CuPy stood in for, tests/strict_device.py) the layers' checks are read after the last
    layer; the first layer that is not finite is still the one named."""
    if device == "cuda":
        strict_device.install(monkeypatch)
    model = poisoned(text_ckpt, tmp_path / "nan", {"model.layers.3.mlp.up_proj.weight": (7, np.nan)}, dtype)
    out = tmp_path / "o.safetensors"
    message = (f"{model}: the residual stream after layer 3 is not finite: tensor 'model.layers.3.mlp.up_proj.weight' "
               f"(model.safetensors) holds 1 NaN/inf value{CORRUPT}\n")
    code, _, err = run(capsys, "logits", "--model", model, "--tokens", "2,5,7", "--rows", "all", "--out", out,
                       "--device", device)
    assert (code, err) == (2, f"refimpl: error: {message}")
    assert not out.exists()
    code, _, err = run(capsys, "generate", "--model", model, "--tokens", "2,5,7", "--max-new-tokens", "2",
                       "--device", device)
    assert (code, err) == (2, f"refimpl: error: {message}")


@pytest.mark.parametrize("tensor, index, value, named", [
    # the embedding row of token 5 (row 1 of the prompt)
    ("model.embed_tokens.weight", 5 * 64 + 3, np.inf,
     "the embedding of token 5 (row 1) is not finite: row 5 of tensor 'model.embed_tokens.weight'"),
    # a row the prompt does not read: only the tied head sees it
    ("model.embed_tokens.weight", 300 * 64, np.nan, "the logits are not finite: tensor 'model.embed_tokens.weight'"),
    # +inf in the head: the softcap would turn it into a finite +30
    ("model.embed_tokens.weight", 300 * 64, np.inf, "the logits are not finite: tensor 'model.embed_tokens.weight'"),
    ("model.norm.weight", 0, -np.inf, "the final norm's output is not finite: tensor 'model.norm.weight'"),
    ("model.per_layer_model_projection.weight", 11, np.nan,
     "the per-layer inputs of token 2 (row 0) are not finite: tensor 'model.per_layer_model_projection.weight'"),
], ids=["embedding-row", "head-nan", "head-inf", "final-norm", "ple"])
def test_inf_embedding_row_norm_and_ple_are_named(tmp_path, text_ckpt, capsys, tensor, index, value, named):
    model = poisoned(text_ckpt, tmp_path / "ckpt", {tensor: (index, value)})
    code, _, err = run(capsys, "logits", "--model", model, "--tokens", "2,5,7", "--out", tmp_path / "o.safetensors",
                       "--force")
    assert (code, err) == (2, f"refimpl: error: {model}: {named} (model.safetensors) holds 1 NaN/inf value{CORRUPT}\n")


def test_overflow_with_finite_weights_is_refused_in_one_line(tmp_path, text_ckpt):
    scale = {f"model.layers.{i}.layer_scalar": (0, 1e30) for i in range(2)}  # 1e60 overflows float32
    model = poisoned(text_ckpt, tmp_path / "big", scale)
    # a process of its own: NumPy's overflow warnings would go to its stderr
    done = subprocess.run([sys.executable, "-m", "refimpl", "logits", "--model", str(model), "--tokens", "2,5,7",
                           "--dtype", "float32", "--out", str(tmp_path / "o.safetensors")],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"refimpl: error: {model}: the residual stream after layer 1 is not finite, but the weights "
                           "read there are: the values overflowed float32\n")


def test_nan_vision_weight_names_the_tower_tensor(tmp_path, vision_ckpt, capsys):
    name = "model.embed_vision.embedding_projection.weight"
    model = poisoned(vision_ckpt, tmp_path / "nan", {name: (0, np.nan)})
    code, _, err = run(capsys, "logits", "--model", model, "--tokens", "2,5", "--image", small_png(tmp_path / "a.png"),
                       "--out", tmp_path / "o.safetensors")
    assert (code, err) == (2, f"refimpl: error: {model}: the vision tower's soft tokens are not finite: tensor "
                              f"'{name}' (model.safetensors) holds 1 NaN/inf value{CORRUPT}\n")


def test_conformance_generate_never_publishes_a_nan_golden(tmp_path, text_ckpt, capsys):
    model = poisoned(text_ckpt, tmp_path / "nan", {"model.layers.6.self_attn.o_proj.weight": (1, np.nan)})
    code, _, err = run_conformance(capsys, "generate", "--model", model, "--out", tmp_path / "set", "--workers", "1",
                                   "-q")
    assert (code, err) == (2, f"conformance: error: {model}: the residual stream after layer 6 is not finite: tensor "
                              f"'model.layers.6.self_attn.o_proj.weight' (model.safetensors) holds 1 NaN/inf "
                              f"value{CORRUPT}\n")
    assert not (tmp_path / "set").exists()
