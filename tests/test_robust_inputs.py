"""Hostile or broken inputs end in one error line and a non-zero exit, never a traceback, a silent
overwrite or a non-finite golden (issue 15): ``logits --out`` over existing files and the checkpoint,
image decompression bombs, a huge ``num_hidden_layers``, NaN/inf weights, a ``generation_config.json``
that is not an object, placeholder ids outside the vocabulary."""

import hashlib
import json
import shutil

import numpy as np
import pytest

from conformance.cli import main as conformance_main
from refimpl.cli import main
from refimpl.model import Gemma4
from refimpl.safetensors_io import TensorStore, write_safetensors
from refimpl.synth import write_checkpoint


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
    assert err == f"error: --out {out} already exists; pass --force to overwrite it, or choose another path\n"
    assert out.read_text() == "keep me"
    monkeypatch.undo()
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", out, "--force")
    assert code == 0, err
    assert TensorStore(out).raw("tokens").tolist() == [2, 5]


def test_logits_out_never_writes_into_the_model_directory(tmp_path, text_ckpt, capsys):
    model = copy_ckpt(text_ckpt, tmp_path / "ckpt")
    before = {p.name: sha(p) for p in model.iterdir()}
    for out, extra in ((model / "model.safetensors", ["--force"]), (model / "new.safetensors", []),
                       (model / "sub" / ".." / "model.safetensors", ["--force"])):
        code, _, err = run(capsys, "logits", "--model", model, "--tokens", "2,5", "--out", out, *extra)
        assert code == 2
        assert err == (f"error: --out {out} is inside the model directory {model}; refimpl never writes into a "
                       "checkpoint, choose a path outside it\n")
    # a symbolic link outside the directory that points at the checkpoint's weights
    link = tmp_path / "link.safetensors"
    link.symlink_to(model / "model.safetensors")
    code, _, err = run(capsys, "logits", "--model", model, "--tokens", "2,5", "--out", link, "--force")
    assert code == 2
    assert err == (f"error: --out {link} is inside the model directory {model}; refimpl never writes into a "
                   "checkpoint, choose a path outside it\n")
    assert {p.name: sha(p) for p in model.iterdir()} == before


def test_logits_out_refuses_a_directory(tmp_path, text_ckpt, capsys):
    code, _, err = run(capsys, "logits", "--model", text_ckpt, "--tokens", "2,5", "--out", tmp_path, "--force")
    assert code == 2
    assert err == f"error: --out {tmp_path} is a directory; pass the path of the .safetensors file to write\n"
