"""The ``refimpl`` command line: synth determinism, inspect, logits files, generate, and error exits."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from refimpl.cli import main
from refimpl.generate import greedy_generate
from refimpl.model import Gemma4
from refimpl.safetensors_io import TensorStore, write_safetensors
from refimpl.synth import make_weights
from refimpl.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def e2b(preset_dirs):
    return preset_dirs["e2b-mini"]


def digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_synth_is_byte_for_byte_deterministic(tmp_path, capsys):
    for name in ("a", "b"):
        code, out, _ = run(capsys, "synth", "--preset", "all-features", "--seed", "7", "--out", str(tmp_path / name))
        assert code == 0 and "wrote all-features" in out
    a, b = digest(tmp_path / "a"), digest(tmp_path / "b")
    assert a == b
    assert set(a) == {"config.json", "model.safetensors", "tokenizer.model"}
    run(capsys, "synth", "--preset", "all-features", "--seed", "8", "--out", str(tmp_path / "c"))
    c = digest(tmp_path / "c")
    assert c["model.safetensors"] != a["model.safetensors"]
    assert c["tokenizer.model"] == a["tokenizer.model"] and c["config.json"] == a["config.json"]


def test_synth_bf16_halves_the_weights_and_keeps_the_config_loadable(tmp_path, capsys):
    code, _, _ = run(capsys, "synth", "--preset", "31b-mini", "--out", str(tmp_path / "bf"), "--dtype", "bf16")
    assert code == 0
    store = TensorStore(tmp_path / "bf")
    assert {info.dtype for info in store.infos.values()} == {"BF16"}
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert np.isfinite(Gemma4(tmp_path / "bf").forward([2, 5, 9])).all()


def test_synth_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    code, _, err = run(capsys, "synth", "--preset", "e2b-mini", "--out", str(tmp_path / "x"))
    assert code == 2
    assert err == (f"refimpl: error: {tmp_path / 'x'} already exists and is not an empty directory; choose another "
                   "--out\n")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_inspect_prints_the_derived_layer_table(e2b, capsys):
    code, out, _ = run(capsys, "inspect", "--model", str(e2b))
    assert code == 0
    lines = [line.split() for line in out.splitlines()]
    # layer 9: full, head dim 32, 1 KV head, reads layer 4, double-wide 256
    assert ["9", "full", "32", "1", "4", "256", "proportional", "theta=1e+06", "prf=0.25"] in lines
    assert ["3", "sliding", "16", "1", "own", "128", "default", "theta=10000"] in lines
    assert "positional rule" not in out  # the presets agree with llama.cpp's rule

    code, out, _ = run(capsys, "inspect", "--model", str(e2b), "--json")
    table = json.loads(out)
    assert [r["kv_source"] for r in table["layers"]] == [0, 1, 2, 3, 4, 3, 3, 3, 3, 4]
    assert [r["ffn_width"] for r in table["layers"]] == [128] * 5 + [256] * 5
    assert table["fixed_rule_disagreements"] == []


def test_inspect_flags_the_llama_cpp_sharing_rule(tmp_path, capsys):
    # the last two KV-owning layers are (full, sliding): llama.cpp / JAX's positional rule picks the
    # wrong producers (spec 4.6; real-backends.md 2.5 "altpat"), the HF rule picks 3 and 2
    S, F = "sliding_attention", "full_attention"
    config = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 6, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 8, "global_head_dim": 8, "intermediate_size": 16,
              "layer_types": [S, S, F, S, S, F], "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path / "model.safetensors", {"model." + k: v for k, v in make_weights(config, 0).items()})
    code, out, _ = run(capsys, "inspect", "--model", str(tmp_path))
    assert code == 0
    lines = [line.split() for line in out.splitlines()]
    assert ["4", "sliding", "8", "1", "3*", "16", "default", "theta=10000"] in lines
    assert ["5", "full", "8", "1", "2*", "16", "proportional", "theta=1e+06", "prf=0.25"] in lines
    assert ("the llama.cpp / JAX positional rule (full -> first_shared-1, sliding -> first_shared-2) would read "
            "layer 2 for layer 4, layer 3 for layer 5") in out


def test_logits_file_holds_the_requested_rows(tmp_path, e2b, capsys):
    out_file = tmp_path / "l.safetensors"
    code, out, _ = run(capsys, "logits", "--model", str(e2b), "--tokens", "2,17,300,45,99,3,8,250,1,77,123",
                       "--rows", "0,5,-1", "--out", str(out_file), "--top-k", "3")
    assert code == 0
    store = TensorStore(out_file)
    assert store.infos["logits"].dtype == "F64"
    logits = store.get("logits")
    assert store.raw("rows").tolist() == [0, 5, 10]
    full = Gemma4(e2b).forward([2, 17, 300, 45, 99, 3, 8, 250, 1, 77, 123])
    assert np.max(np.abs(logits - full[[0, 5, 10]])) < 1e-12  # rows pruned before the shared layers: BLAS rounding
    summary = [line for line in out.splitlines() if line.startswith("  row ")]
    assert len(summary) == 3
    top = int(np.argmax(full[5]))
    assert summary[1].startswith(f"  row 5: {top} ")


def test_logits_from_a_chat_prompt_match_the_tokenizer(tmp_path, e2b, capsys):
    out_file = tmp_path / "c.safetensors"
    code, _, _ = run(capsys, "logits", "--model", str(e2b), "--prompt", "hello", "--chat", "--out", str(out_file))
    assert code == 0
    ids = Tokenizer.from_dir(e2b).encode_chat([{"role": "user", "content": "hello"}])
    store = TensorStore(out_file)
    assert store.raw("tokens").tolist() == ids
    assert np.array_equal(store.get("logits"), Gemma4(e2b).forward(ids, rows="last"))


def test_logits_float32(tmp_path, e2b, capsys):
    out_file = tmp_path / "f.safetensors"
    code, _, _ = run(capsys, "logits", "--model", str(e2b), "--tokens", "2,5", "--dtype", "float32",
                     "--out", str(out_file))
    assert code == 0 and TensorStore(out_file).infos["logits"].dtype == "F32"


def test_generate_streams_the_greedy_continuation(e2b, capsys):
    code, out, err = run(capsys, "generate", "--model", str(e2b), "--tokens", "2,17,300", "--max-new-tokens", "6")
    assert code == 0
    expected = greedy_generate(Gemma4(e2b), [2, 17, 300], 6)
    assert f"new: {','.join(map(str, expected.tokens))}" in err
    assert out == Tokenizer.from_dir(e2b).decode(expected.tokens) + "\n"


@pytest.mark.parametrize("argv, message", [
    (["logits", "--tokens", "2,999"], "refimpl: error: token id 999 is outside the vocabulary [0, 512)\n"),
    (["logits", "--tokens", "2,x"], "refimpl: error: --tokens must be comma-separated integers, got '2,x'\n"),
    (["logits", "--tokens", "2,3", "--rows", "5"], "refimpl: error: row 5 is outside the 2 tokens of this call\n"),
    (["logits", "--tokens", "2,3", "--chat"], "refimpl: error: --chat applies to --prompt, not to --tokens\n"),
    (["generate", "--tokens", "2", "--max-new-tokens", "-1"], "refimpl: error: max_new_tokens must be >= 0, got -1\n"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, e2b, capsys, argv, message):
    extra = ["--out", str(tmp_path / "o.safetensors")] if argv[0] == "logits" else []
    code, _, err = run(capsys, argv[0], "--model", str(e2b), *argv[1:], *extra)
    assert code == 2
    assert err == message


def test_prompt_without_tokenizer_asks_for_token_ids(tmp_path, e2b, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(e2b / name)
    code, _, err = run(capsys, "logits", "--model", str(bare), "--prompt", "hi", "--out", str(tmp_path / "o"))
    assert code == 2
    assert err == f"refimpl: error: {bare} has no tokenizer.model; pass token ids with --tokens instead of --prompt\n"
    # token ids still work without a tokenizer
    code, out, _ = run(capsys, "logits", "--model", str(bare), "--tokens", "2,5", "--out", str(tmp_path / "o"))
    assert code == 0 and ' "' not in out  # no pieces to show


def test_top_k_beyond_a_smaller_tokenizer(tmp_path, e2b, micro_factory, capsys):
    """A vocabulary larger than the tokenizer (the published-shape synthetic checkpoints: 262,144 ids, a 512-piece
    tokenizer): the top-k lines show "-" for the ids beyond it, and the run exits 0 (it used to fail after writing
    the logits)."""
    from helpers import micro_config

    model = micro_factory(micro_config(vocab_size=600))
    (model / "tokenizer.model").symlink_to(e2b / "tokenizer.model")
    code, out, err = run(capsys, "logits", "--model", str(model), "--tokens", "2,5", "--top-k", "600",
                         "--out", str(tmp_path / "o.safetensors"))
    assert (code, err) == (0, "")
    shown = out.splitlines()[1].split(": ", 1)[1].split(", ")
    assert len(shown) == 600 and sum(" - " in item for item in shown) == 88  # ids 512 .. 599
    assert all(" - " not in item for item in shown if int(item.split()[0]) < 512)


def test_missing_model_directory(tmp_path, capsys):
    code, _, err = run(capsys, "inspect", "--model", str(tmp_path / "nope"))
    assert code == 2
    assert err == (f"refimpl: error: {tmp_path / 'nope'}: not a directory; pass a checkpoint directory holding "
                   "config.json\n")


def test_console_entry_point_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "refimpl", "synth", "--preset", "nope", "--out", "x"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr
    assert "Traceback" not in done.stderr


# ----------------------------------------------------------------------------------------------
# image prompts: --image on logits and generate

from refimpl.generate import greedy_generate_multimodal  # noqa: E402 - this section's imports, with its tests
from refimpl.image import load_image_processor_settings, preprocess_image, read_image  # noqa: E402 - see above
from refimpl.multimodal import expand_image_placeholders, load_multimodal_tokens, multimodal_logits  # noqa: E402 - see above
from refimpl.vision import load_vision_tower, vision_tower  # noqa: E402 - this section's imports, with its tests


def write_png(path, pixels):
    """An 8-bit RGB PNG (filter 0 on every row) from uint8 [h, w, 3], with numpy + zlib only."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    h, w, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


def image_metadata(path):
    """The "images" entry of a safetensors file's __metadata__ (a JSON string)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["images"])


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(5)
    return [write_png(root / "wide.png", rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)),
            write_png(root / "tall.png", rng.integers(0, 256, (40, 20, 3), dtype=np.uint8))]


def preprocessed(model_dir, paths, max_soft_tokens=None):
    """read_image -> preprocess_image with the checkpoint's processor settings."""
    _, cfg = load_vision_tower(model_dir)
    s = load_image_processor_settings(model_dir, cfg)
    return [preprocess_image(read_image(p), s.patch_size, s.pooling_kernel_size, max_soft_tokens or s.max_soft_tokens)
            for p in paths]


def direct_soft_tokens(model_dir, paths):
    """read_image -> preprocess_image -> vision_tower, without the command line."""
    weights, cfg = load_vision_tower(model_dir)
    pre = preprocessed(model_dir, paths)
    return [vision_tower(p.pixel_values, p.positions, weights, cfg) for p in pre], pre


@pytest.mark.parametrize("preset, n_images", [("e2b-vision-mini", 1), ("e2b-vision-mini", 2), ("31b-vision-mini", 2)])
def test_logits_with_images_equal_multimodal_logits(tmp_path, preset_dirs, pngs, capsys, preset, n_images):
    model_dir = preset_dirs[preset]
    prompt = "look <|image|> and <|image|> now" if n_images == 2 else "what is <|image|>?"
    paths = pngs[:n_images]
    out_file = tmp_path / "img.safetensors"
    images = [a for p in paths for a in ("--image", str(p))]
    code, out, err = run(capsys, "logits", "--model", str(model_dir), "--prompt", prompt, *images,
                         "--rows", "all", "--out", str(out_file), "--top-k", "1")
    assert code == 0, err
    mm = load_multimodal_tokens(model_dir)
    ids = Tokenizer.from_dir(model_dir).encode(prompt)
    assert ids.count(mm.image_token_id) == n_images
    soft, pre = direct_soft_tokens(model_dir, paths)
    expanded = expand_image_placeholders(ids, [p.num_soft_tokens for p in pre], mm)
    expected = multimodal_logits(Gemma4(model_dir), expanded, soft, mm, rows="all")
    store = TensorStore(out_file)
    assert np.array_equal(store.get("logits"), expected)  # bit for bit
    assert store.raw("tokens").tolist() == expanded.tolist()
    assert store.raw("rows").tolist() == list(range(len(expanded)))
    info = image_metadata(out_file)
    starts = np.flatnonzero(expanded == mm.boi_token_id) + 1
    assert [i["soft_tokens"] for i in info] == [p.num_soft_tokens for p in pre] == [s.shape[0] for s in soft]
    assert [i["rows"] for i in info] == [[int(a), int(a) + p.num_soft_tokens - 1]
                                         for a, p in zip(starts, pre, strict=True)]
    lines = out.splitlines()
    total = sum(p.num_soft_tokens for p in pre)
    assert lines[0].startswith(f"{len(expanded)} tokens ({total} soft tokens of {n_images} image")
    assert lines[1] == (f"  image 0 {paths[0]}: 30x50 (HxW) resized to "
                        f"{pre[0].pixels.shape[0]}x{pre[0].pixels.shape[1]}, {pre[0].num_soft_tokens} soft tokens at "
                        f"rows {starts[0]}-{starts[0] + pre[0].num_soft_tokens - 1}")
    assert sum(line.startswith("  row ") for line in lines) == len(expanded)


def test_images_without_a_placeholder_go_in_front_of_the_text(tmp_path, preset_dirs, pngs, capsys):
    model_dir = preset_dirs["e2b-vision-mini"]
    tok, mm = Tokenizer.from_dir(model_dir), load_multimodal_tokens(model_dir)
    m0, m1 = (p.num_soft_tokens for p in preprocessed(model_dir, pngs))
    one = [mm.boi_token_id] + [mm.image_token_id] * m0 + [mm.eoi_token_id]
    two = one + [mm.boi_token_id] + [mm.image_token_id] * m1 + [mm.eoi_token_id]

    def tokens_of(*argv, images=pngs):
        out_file = tmp_path / "t.safetensors"
        code, _, err = run(capsys, "logits", "--model", str(model_dir), *argv,
                           *[a for p in images for a in ("--image", str(p))], "--out", str(out_file), "--force")
        assert code == 0, err
        store = TensorStore(out_file)
        return store.raw("tokens").tolist(), store.get("logits")

    # plain text: right after <bos>, the same prompt as writing the placeholders there
    ids, logits = tokens_of("--prompt", "describe")
    assert ids == [tok.bos_id] + two + tok.encode("describe", add_bos=False)
    ids2, logits2 = tokens_of("--prompt", "<|image|><|image|>describe")
    assert ids2 == ids and np.array_equal(logits2, logits)
    # chat: at the start of the user turn's content, as the chat template places image items
    ids, _ = tokens_of("--prompt", "describe", "--chat", images=pngs[:1])
    chat = tok.encode_chat([{"role": "user", "content": "<|image|>describe"}])
    assert ids == expand_image_placeholders(chat, [m0], mm).tolist()
    first = chat.index(mm.image_token_id)  # <bos><|turn>user\n, then the image, then the text
    assert chat[:first] == [tok.bos_id, tok.piece_id("<|turn>")] + tok.encode("user\n", add_bos=False)
    text = tok.encode("describe", add_bos=False)
    assert chat[first + 1 : first + 1 + len(text)] == text
    # token ids: after a leading <bos>, else at the very front
    ids, _ = tokens_of("--tokens", f"{tok.bos_id},50,60", images=pngs[:1])
    assert ids == [tok.bos_id] + one + [50, 60]
    ids, _ = tokens_of("--tokens", "50,60", images=pngs[:1])
    assert ids == one + [50, 60]


@pytest.mark.parametrize("preset", ["e2b-vision-mini", "31b-vision-mini"])
def test_generate_with_an_image_equals_argmax_of_full_forwards(preset_dirs, pngs, capsys, preset):
    model_dir = preset_dirs[preset]
    model, mm = Gemma4(model_dir), load_multimodal_tokens(model_dir)
    soft, pre = direct_soft_tokens(model_dir, pngs)
    ids = expand_image_placeholders([2, 9, 40, 9, 41], [p.num_soft_tokens for p in pre], mm).tolist()
    result = greedy_generate_multimodal(model, ids, soft, mm, 5, stop_ids=())
    # independent path: no cache, one full forward over the growing sequence per step
    grown = list(ids)
    for _ in range(5):
        grown.append(int(np.argmax(multimodal_logits(model, grown, soft, mm, rows="last")[0])))
    assert result.tokens == grown[len(ids):] and not result.stopped
    assert not set(result.tokens) & set(mm.placeholders)

    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--tokens", "2,9,40,9,41",
                       "--image", str(pngs[0]), "--image", str(pngs[1]), "--max-new-tokens", "5")
    assert code == 0
    stops = [i for i, t in enumerate(result.tokens) if t in model.cfg.eos_token_ids]
    expected = result if not stops else type(result)(result.tokens[: stops[0] + 1], True, [])
    total = sum(p.num_soft_tokens for p in pre)
    assert err.splitlines()[-1].startswith(
        f"[{len(ids)} prompt tokens ({total} soft tokens of 2 images), {len(expected.tokens)} new: "
        f"{','.join(map(str, expected.tokens))}; ")
    assert err.splitlines()[0].startswith(f"  image 0 {pngs[0]}: 30x50 (HxW) resized to ")


def test_max_soft_tokens_sets_the_image_budget(tmp_path, preset_dirs, pngs, capsys):
    model_dir = preset_dirs["e2b-vision-mini"]
    out_file = tmp_path / "b.safetensors"
    code, _, _ = run(capsys, "logits", "--model", str(model_dir), "--prompt", "x", "--image", str(pngs[1]),
                     "--max-soft-tokens", "140", "--out", str(out_file))
    assert code == 0
    pre = preprocessed(model_dir, pngs[1:], max_soft_tokens=140)
    info = image_metadata(out_file)
    assert info[0]["soft_tokens"] == pre[0].num_soft_tokens > 70
    assert info[0]["resized"] == list(pre[0].pixels.shape[:2])


@pytest.mark.parametrize("preset, argv, message", [
    ("e2b-mini", ["--prompt", "hi", "--image", "{a}"],
     "refimpl: error: {model} has no vision tower (config.json has no vision_config); --image needs an image-text "
     "checkpoint (Gemma4ForConditionalGeneration or Gemma4UnifiedForConditionalGeneration with its vision weights)\n"),
    ("e2b-vision-mini", ["--prompt", "hi", "--image", "{tmp}/missing.png"],
     "refimpl: error: image file {tmp}/missing.png does not exist; check the path\n"),
    ("e2b-vision-mini", ["--prompt", "hi", "--image", "{tmp}"],
     "refimpl: error: image path {tmp} is a directory; pass the path of an image file\n"),
    ("e2b-vision-mini", ["--prompt", "hi", "--image", "{tmp}/notes.txt"],
     "refimpl: error: {tmp}/notes.txt is not a recognised image (it starts with b'hello th'); pass a PNG, PPM/PGM, "
     "JPEG, WebP or another format Pillow can open\n"),
    ("e2b-vision-mini", ["--prompt", "<|image|> vs <|image|>", "--image", "{a}"],
     "refimpl: error: the prompt holds 2 image placeholder(s) (9, the <|image|> token) but 1 image(s) were given; put "
     "one placeholder where each image goes, in order\n"),
    ("e2b-vision-mini", ["--tokens", "2,9,50", "--image", "{a}", "--image", "{b}"],
     "refimpl: error: the prompt holds 1 image placeholder(s) (9, the <|image|> token) but 2 image(s) were given; put "
     "one placeholder where each image goes, in order\n"),
    ("e2b-vision-mini", ["--prompt", "<|image><|image|><image|>", "--image", "{a}"],
     "refimpl: error: the prompt already holds begin/end-of-image markers (<|image> / <image|>); write one bare "
     "<|image|> where each image goes and refimpl expands it to <|image> + <|image|> x M + <image|>\n"),
    ("e2b-vision-mini", ["--tokens", "2,9,8", "--image", "{a}"],
     "refimpl: error: the prompt already holds begin/end-of-image markers (<|image> / <image|>); write one bare "
     "<|image|> where each image goes and refimpl expands it to <|image> + <|image|> x M + <image|>\n"),
    ("e2b-vision-mini", ["--tokens", "2,9,13", "--image", "{a}"],
     "refimpl: error: the prompt holds 1 video placeholder(s) (13, the <|video|> token) but 0 video(s) were given; "
     "put one placeholder where each video goes, in order\n"),
    ("e2b-vision-mini", ["--tokens", "2,9,12", "--image", "{a}"],
     "refimpl: error: the prompt holds 1 audio placeholder(s) (12, the <|audio|> token) but 0 audio clip(s) were "
     "given; put one placeholder where each clip goes, in order\n"),
    ("e2b-vision-mini", ["--tokens", "2,9", "--max-soft-tokens", "140"],
     "refimpl: error: --max-soft-tokens applies to --image\n"),
])
@pytest.mark.parametrize("command", ["logits", "generate"])
def test_bad_image_input_is_one_error_line_and_exit_2(tmp_path, preset_dirs, pngs, capsys, command, preset, argv,
                                                     message):
    (tmp_path / "notes.txt").write_text("hello there")
    fill = dict(a=pngs[0], b=pngs[1], tmp=tmp_path, model=preset_dirs[preset])
    extra = ["--out", str(tmp_path / "o.safetensors")] if command == "logits" else []
    code, out, err = run(capsys, command, "--model", str(preset_dirs[preset]), *[a.format(**fill) for a in argv],
                         *extra)
    assert (code, err) == (2, message.format(**fill))
    assert not (tmp_path / "o.safetensors").exists()


# ----------------------------------------------------------------------------------------------
# audio prompts: --audio on logits and generate (the e2b-audio-mini preset: boa 10, eoa 11, audio 12)

import wave  # noqa: E402 - this section's imports, with its tests
from types import SimpleNamespace  # noqa: E402 - this section's imports, with its tests

from refimpl.audio import audio_tower, load_audio_tower  # noqa: E402 - this section's imports, with its tests
from refimpl.audio_features import audio_features, load_audio_feature_settings, read_wav  # noqa: E402 - see above
from refimpl.cli_inputs import prompt_ids  # noqa: E402 - this section's imports, with its tests
from refimpl.multimodal import expand_audio_placeholders  # noqa: E402 - this section's imports, with its tests


def write_wav(path, seconds, rate=16_000, seed=0):
    """A 16-bit mono WAV (a tone plus noise) written by the standard library's ``wave`` module."""
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + np.random.default_rng(seed).normal(0, 0.05, n)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio")
    return [write_wav(root / "half.wav", 0.5, seed=1), write_wav(root / "short.wav", 0.3, seed=2),
            write_wav(root / "eight_k.wav", 0.5, rate=8000, seed=3)]


def direct_audio_soft_tokens(model_dir, paths):
    """read_wav -> audio_features (checkpoint settings) -> audio_tower, without the command line."""
    settings = load_audio_feature_settings(model_dir)
    weights, cfg = load_audio_tower(model_dir)
    feats = [audio_features(*read_wav(p), settings) for p in paths]
    return [audio_tower(f.features, f.mask, weights, cfg) for f in feats], feats


def audio_metadata(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["audio"])


@pytest.mark.parametrize("n_clips", [1, 2])
def test_logits_with_audio_equal_multimodal_logits(tmp_path, preset_dirs, wavs, capsys, n_clips):
    model_dir = preset_dirs["e2b-audio-mini"]
    prompt = "hear <|audio|> then <|audio|> now" if n_clips == 2 else "what is <|audio|>?"
    paths = wavs[:n_clips]
    out_file = tmp_path / "aud.safetensors"
    code, out, err = run(capsys, "logits", "--model", str(model_dir), "--prompt", prompt,
                         *[a for p in paths for a in ("--audio", str(p))], "--rows", "all", "--out", str(out_file),
                         "--top-k", "1")
    assert code == 0, err
    mm = load_multimodal_tokens(model_dir)
    assert (mm.boa_token_id, mm.eoa_token_id, mm.audio_token_id) == (10, 11, 12)
    ids = Tokenizer.from_dir(model_dir).encode(prompt)
    assert ids.count(mm.audio_token_id) == n_clips
    soft, feats = direct_audio_soft_tokens(model_dir, paths)
    counts = [s.shape[0] for s in soft]
    expanded = expand_audio_placeholders(ids, counts, mm)
    expected = multimodal_logits(Gemma4(model_dir), expanded, [], mm, rows="all", audio_soft_tokens=soft)
    store = TensorStore(out_file)
    assert np.array_equal(store.get("logits"), expected)  # bit for bit
    assert store.raw("tokens").tolist() == expanded.tolist()
    info = audio_metadata(out_file)
    starts = np.flatnonzero(expanded == mm.boa_token_id) + 1
    assert [i["soft_tokens"] for i in info] == counts == [13, 8][:n_clips]
    assert [i["rows"] for i in info] == [[int(a), int(a) + m - 1] for a, m in zip(starts, counts, strict=True)]
    assert [i["frames"] for i in info] == [f.mask.size for f in feats]
    lines = out.splitlines()
    assert lines[0].startswith(f"{len(expanded)} tokens ({sum(counts)} soft tokens of {n_clips} audio clip")
    assert lines[1] == (f"  audio 0 {paths[0]}: 0.500 s, {feats[0].mask.size} mel frames ({int(feats[0].mask.sum())} "
                        f"valid), {counts[0]} soft tokens at rows {starts[0]}-{starts[0] + counts[0] - 1}")
    assert sum(line.startswith("  row ") for line in lines) == len(expanded)


def test_audio_without_a_placeholder_goes_in_front_of_the_text(tmp_path, preset_dirs, wavs, capsys):
    model_dir = preset_dirs["e2b-audio-mini"]
    tok, mm = Tokenizer.from_dir(model_dir), load_multimodal_tokens(model_dir)
    clip = [mm.boa_token_id] + [mm.audio_token_id] * 13 + [mm.eoa_token_id]

    def tokens_of(*argv):
        out_file = tmp_path / "t.safetensors"
        code, _, err = run(capsys, "logits", "--model", str(model_dir), *argv, "--audio", str(wavs[0]),
                           "--out", str(out_file), "--force")
        assert code == 0, err
        store = TensorStore(out_file)
        return store.raw("tokens").tolist(), store.get("logits")

    ids, logits = tokens_of("--prompt", "describe")
    assert ids == [tok.bos_id] + clip + tok.encode("describe", add_bos=False)
    ids2, logits2 = tokens_of("--prompt", "<|audio|>describe")
    assert ids2 == ids and np.array_equal(logits2, logits)
    ids, _ = tokens_of("--prompt", "describe", "--chat")
    assert ids == expand_audio_placeholders(tok.encode_chat([{"role": "user", "content": "<|audio|>describe"}]),
                                            [13], mm).tolist()
    ids, _ = tokens_of("--tokens", f"{tok.bos_id},50,60")
    assert ids == [tok.bos_id] + clip + [50, 60]
    # with images too, the images come first, then the clips (each kind only when it has no placeholder)
    args = SimpleNamespace(tokens=f"{tok.bos_id},50", prompt=None, chat=False)
    assert prompt_ids(args, model_dir, 1, mm, tok.bos_id, 2)[0] == [tok.bos_id, 9, 12, 12, 50]
    args.tokens = f"{tok.bos_id},50,9"
    assert prompt_ids(args, model_dir, 1, mm, tok.bos_id, 1)[0] == [tok.bos_id, 12, 50, 9]
    args = SimpleNamespace(tokens=None, prompt="x", chat=False)
    assert prompt_ids(args, model_dir, 1, mm, tok.bos_id, 1)[0] == tok.encode("<|image|><|audio|>x")


def test_generate_with_audio_equals_argmax_of_full_forwards(preset_dirs, wavs, capsys):
    model_dir = preset_dirs["e2b-audio-mini"]
    model, mm = Gemma4(model_dir), load_multimodal_tokens(model_dir)
    soft, _ = direct_audio_soft_tokens(model_dir, wavs[:2])
    ids = expand_audio_placeholders([2, 12, 40, 12, 41], [s.shape[0] for s in soft], mm).tolist()
    result = greedy_generate_multimodal(model, ids, [], mm, 5, stop_ids=(), audio_soft_tokens=soft)
    grown = list(ids)
    for _ in range(5):  # independent path: no cache, one full forward over the growing sequence per step
        grown.append(int(np.argmax(multimodal_logits(model, grown, [], mm, rows="last", audio_soft_tokens=soft)[0])))
    assert result.tokens == grown[len(ids):] and not result.stopped

    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--tokens", "2,12,40,12,41",
                       "--audio", str(wavs[0]), "--audio", str(wavs[1]), "--max-new-tokens", "5")
    assert code == 0, err
    stops = [i for i, t in enumerate(result.tokens) if t in model.cfg.eos_token_ids]
    expected = result.tokens if not stops else result.tokens[: stops[0] + 1]
    assert err.splitlines()[-1].startswith(
        f"[{len(ids)} prompt tokens (21 soft tokens of 2 audio clips), {len(expected)} new: "
        f"{','.join(map(str, expected))}; ")
    assert err.splitlines()[0].startswith(f"  audio 0 {wavs[0]}: 0.500 s, ")


@pytest.mark.parametrize("preset, argv, message", [
    ("e2b-mini", ["--prompt", "hi", "--audio", "{a}"],
     "refimpl: error: {model} has no audio tower (config.json has no audio_config); --audio needs an audio-text "
     "checkpoint (Gemma4ForConditionalGeneration or Gemma4UnifiedForConditionalGeneration with its audio weights)\n"),
    ("e2b-audio-mini", ["--prompt", "hi", "--audio", "{tmp}/missing.wav"],
     "refimpl: error: audio file {tmp}/missing.wav does not exist; check the path\n"),
    ("e2b-audio-mini", ["--prompt", "hi", "--audio", "{tmp}/notes.txt"],
     "refimpl: error: {tmp}/notes.txt is not a WAV file (it does not start with 'RIFF....WAVE'); only RIFF/WAVE is "
     "read natively: convert it, e.g. `ffmpeg -i notes.txt -ar 16000 -ac 1 out.wav`\n"),
    ("e2b-audio-mini", ["--prompt", "hi", "--audio", "{c}"],
     "refimpl: error: audio file {c} is sampled at 8000 Hz but the checkpoint's feature extractor needs 16000 Hz (16 "
     "kHz); resample it to 16 kHz mono first, e.g. `ffmpeg -i in.wav -ar 16000 -ac 1 out.wav`\n"),
    ("e2b-audio-mini", ["--prompt", "<|audio|> vs <|audio|>", "--audio", "{a}"],
     "refimpl: error: the prompt holds 2 audio placeholder(s) (12, the <|audio|> token) but 1 audio clip(s) were "
     "given; put one placeholder where each clip goes, in order\n"),
    ("e2b-audio-mini", ["--tokens", "2,12,50", "--audio", "{a}", "--audio", "{b}"],
     "refimpl: error: the prompt holds 1 audio placeholder(s) (12, the <|audio|> token) but 2 audio clip(s) were "
     "given; put one placeholder where each clip goes, in order\n"),
    ("e2b-audio-mini", ["--prompt", "<|audio><|audio|><audio|>", "--audio", "{a}"],
     "refimpl: error: the prompt already holds begin/end-of-audio markers (<|audio> / <audio|>); write one bare "
     "<|audio|> where each clip goes and refimpl expands it to <|audio> + <|audio|> x M + <audio|>\n"),
    ("e2b-audio-mini", ["--tokens", "2,12,11", "--audio", "{a}"],
     "refimpl: error: the prompt already holds begin/end-of-audio markers (<|audio> / <audio|>); write one bare "
     "<|audio|> where each clip goes and refimpl expands it to <|audio> + <|audio|> x M + <audio|>\n"),
    ("e2b-audio-mini", ["--tokens", "2,12,13", "--audio", "{a}"],
     "refimpl: error: the prompt holds 1 video placeholder(s) (13, the <|video|> token) but 0 video(s) were given; "
     "put one placeholder where each video goes, in order\n"),
    ("e2b-audio-mini", ["--prompt", "hi", "--audio", "{a}", "--image", "{a}"],
     "refimpl: error: {model} has no vision tower (config.json has no vision_config); --image needs an image-text "
     "checkpoint (Gemma4ForConditionalGeneration or Gemma4UnifiedForConditionalGeneration with its vision weights)\n"),
    ("e2b-audio-mini", ["--prompt", "hi", "--audio", "{tiny}"],
     "refimpl: error: audio file {tiny} is too short (100 samples): it gives no soft token; pass at least 40 ms of "
     "audio\n"),
])
@pytest.mark.parametrize("command", ["logits", "generate"])
def test_bad_audio_input_is_one_error_line_and_exit_2(tmp_path, preset_dirs, wavs, capsys, command, preset, argv,
                                                     message):
    (tmp_path / "notes.txt").write_text("hello there")
    tiny = write_wav(tmp_path / "tiny.wav", 100 / 16_000)
    fill = dict(a=wavs[0], b=wavs[1], c=wavs[2], tmp=tmp_path, tiny=tiny, model=preset_dirs[preset])
    extra = ["--out", str(tmp_path / "o.safetensors")] if command == "logits" else []
    code, out, err = run(capsys, command, "--model", str(preset_dirs[preset]), *[a.format(**fill) for a in argv],
                         *extra)
    assert (code, err) == (2, message.format(**fill))
    assert not (tmp_path / "o.safetensors").exists()
