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
    assert err == f"error: {tmp_path / 'x'} already exists and is not an empty directory; choose another --out\n"
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
    assert np.array_equal(logits, full[[0, 5, 10]])
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
    (["logits", "--tokens", "2,999"], "error: token id 999 is outside the vocabulary [0, 512)\n"),
    (["logits", "--tokens", "2,x"], "error: --tokens must be comma-separated integers, got '2,x'\n"),
    (["logits", "--tokens", "2,3", "--rows", "5"], "error: row 5 is outside the 2 tokens of this call\n"),
    (["logits", "--tokens", "2,3", "--chat"], "error: --chat applies to --prompt, not to --tokens\n"),
    (["generate", "--tokens", "2", "--max-new-tokens", "-1"], "error: max_new_tokens must be >= 0, got -1\n"),
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
    assert err == f"error: {bare} has no tokenizer.model; pass token ids with --tokens instead of --prompt\n"
    # token ids still work without a tokenizer
    code, out, _ = run(capsys, "logits", "--model", str(bare), "--tokens", "2,5", "--out", str(tmp_path / "o"))
    assert code == 0 and ' "' not in out  # no pieces to show


def test_missing_model_directory(tmp_path, capsys):
    code, _, err = run(capsys, "inspect", "--model", str(tmp_path / "nope"))
    assert code == 2
    assert err == f"error: {tmp_path / 'nope'}: not a directory; pass a checkpoint directory holding config.json\n"


def test_console_entry_point_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "refimpl", "synth", "--preset", "nope", "--out", "x"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr
    assert "Traceback" not in done.stderr
