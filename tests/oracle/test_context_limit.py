"""The context limit (``max_position_embeddings``, refimpl/context.py): ``refimpl logits`` / ``refimpl generate``
and ``conformance generate`` (the --prompts bases, the built-in bases, the image bases) refuse a prompt past the
checkpoint's context before any forward, with one line naming the prompt, its length and the limit, exit 2;
``--allow-beyond-context`` runs it, and generate records it in the manifest. Also ``refimpl --version``."""

from __future__ import annotations

import json
import os
import re
from importlib import metadata

import pytest
from helpers import micro_config

import conformance.generate.jobs as jobs
from conformance.cli import main as conformance_main
from conformance.generate import generate_set
from refimpl.cli import main as refimpl_main
from refimpl.config import parse_config
from refimpl.errors import ConfigError, ContextLimitError
from refimpl.model import Gemma4
from refimpl.safetensors_io import TensorStore
from refimpl.synth import write_checkpoint

LIMIT = 60  # the micro checkpoints' context: the built-in bases (48 and 24 tokens) fit, a 58-token prompt does not


def _ids(n: int) -> str:
    return ",".join(["2"] + ["7"] * (n - 1))


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """A micro checkpoint whose config.json says max_position_embeddings = LIMIT (window 3)."""
    from helpers import micro_checkpoint

    return micro_checkpoint(tmp_path_factory.mktemp("ctx") / "m", micro_config(max_position_embeddings=LIMIT), 0)


@pytest.fixture
def no_forward(monkeypatch):
    """Any decoder forward fails the test: a refusal must come before it."""
    def boom(*a, **k):
        raise AssertionError("a forward ran before the context check")

    monkeypatch.setattr(Gemma4, "hidden_states", boom)
    monkeypatch.setattr(jobs, "base_rows_of", boom)


def run(capsys, main, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------------
# the config


def test_the_limit_is_read_from_the_config_and_checked():
    assert parse_config(micro_config(max_position_embeddings=LIMIT)).max_position_embeddings == LIMIT
    raw = micro_config()
    del raw["max_position_embeddings"]
    assert parse_config(raw).max_position_embeddings is None  # states none: no limit
    with pytest.raises(ConfigError, match="'max_position_embeddings' must be positive, got 0"):
        parse_config(micro_config(max_position_embeddings=0))


# ----------------------------------------------------------------------------------------------
# refimpl logits / generate


def test_refimpl_logits_refuses_a_prompt_past_the_context_before_any_forward(tight, tmp_path, capsys, no_forward):
    out = tmp_path / "l.safetensors"
    code, stdout, err = run(capsys, refimpl_main, "logits", "--model", str(tight), "--tokens", _ids(LIMIT + 1),
                            "--out", str(out))
    assert code == 2 and stdout == "" and not out.exists()
    assert err == (f"refimpl: error: the prompt is {LIMIT + 1} tokens long, beyond the checkpoint's context of {LIMIT} "
                   "tokens (max_position_embeddings in config.json); pass --allow-beyond-context to run it anyway\n")


def test_refimpl_logits_runs_up_to_the_limit_and_beyond_it_when_allowed(tight, tmp_path, capsys):
    code, _, err = run(capsys, refimpl_main, "logits", "--model", str(tight), "--tokens", _ids(LIMIT),
                       "--out", str(tmp_path / "at.safetensors"))
    assert code == 0, err
    out = tmp_path / "beyond.safetensors"
    code, stdout, err = run(capsys, refimpl_main, "logits", "--model", str(tight), "--tokens", _ids(LIMIT + 5),
                            "--rows", "all", "--out", str(out), "--allow-beyond-context")
    assert code == 0, err
    assert stdout.startswith(f"{LIMIT + 5} tokens, {LIMIT + 5} rows")
    assert tuple(TensorStore(out).infos["logits"].shape) == (LIMIT + 5, 64)


def test_refimpl_generate_counts_the_new_tokens(tight, capsys, no_forward):
    # the last of N new tokens is decoded from position prompt + N - 2: prompt + N - 1 positions
    code, _, err = run(capsys, refimpl_main, "generate", "--model", str(tight), "--tokens", _ids(LIMIT - 3),
                       "--max-new-tokens", "5")
    assert code == 2
    assert err.startswith(f"refimpl: error: the prompt ({LIMIT - 3} tokens) and --max-new-tokens 5 need {LIMIT + 1} "
                          f"positions, beyond the checkpoint's context of {LIMIT} tokens")
    code, _, err = run(capsys, refimpl_main, "generate", "--model", str(tight), "--tokens", _ids(LIMIT + 1),
                       "--max-new-tokens", "1")
    assert code == 2 and err.startswith(f"refimpl: error: the prompt is {LIMIT + 1} tokens long, beyond")


def test_refimpl_generate_fits_exactly_and_goes_beyond_when_allowed(tight, capsys):
    code, _, err = run(capsys, refimpl_main, "generate", "--model", str(tight), "--tokens", _ids(LIMIT - 3),
                       "--max-new-tokens", "4")
    assert code == 0, err
    code, _, err = run(capsys, refimpl_main, "generate", "--model", str(tight), "--tokens", _ids(LIMIT - 3),
                       "--max-new-tokens", "6", "--allow-beyond-context")
    assert code == 0, err
    assert re.search(rf"\[{LIMIT - 3} prompt tokens, \d new", err)


def test_refimpl_version(capsys):
    with pytest.raises(SystemExit) as e:
        refimpl_main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"refimpl {metadata.version('gemma4-conformance')} (gemma4-conformance)\n"


# ----------------------------------------------------------------------------------------------
# conformance generate


def _prompts(tmp_path, n: int):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"tokens": [2] + [7] * (n - 1)}) + "\n")
    return f


def test_generate_refuses_a_prompts_base_past_the_context(tight, tmp_path, capsys, no_forward):
    """A 58-token prompt fits, but its 3-token greedy continuation takes the base to 61 > 60 positions."""
    f = _prompts(tmp_path, LIMIT - 2)
    out = tmp_path / "sets" / "x"
    code, stdout, err = run(capsys, conformance_main, "generate", "--model", str(tight), "--prompts", str(f),
                            "--out", str(out), "--workers", "1")
    assert code == 2 and stdout == ""
    assert err == (f"conformance: error: {f} line 1 (base P0): the prompt is {LIMIT - 2} tokens long and with its "
                   f"3-token greedy continuation the base is {LIMIT + 1}, beyond the checkpoint's context of {LIMIT} "
                   "tokens (max_position_embeddings in config.json); pass --allow-beyond-context "
                   "(generate_set(allow_beyond_context=True)) to run it anyway\n")
    assert os.listdir(tmp_path / "sets") == []  # nothing left behind


def test_generate_refuses_a_long_prompt_on_a_preset(tmp_path, capsys, no_forward):
    """The miniatures' context is 4096: a 4201-token --prompts base is refused (after the model is written,
    before any forward), and nothing is left behind."""
    f = _prompts(tmp_path, 4201)
    out = tmp_path / "sets" / "x"
    code, _, err = run(capsys, conformance_main, "generate", "--preset", "31b-mini", "--prompts", str(f),
                       "--out", str(out), "--workers", "1", "-q")
    assert code == 2
    assert err.startswith(f"conformance: error: {f} line 1 (base P0): the prompt is 4201 tokens long and with its "
                          "3-token greedy continuation the base is 4204, beyond the checkpoint's context of 4096 "
                          "tokens")
    assert err.count("\n") == 1
    assert os.listdir(tmp_path / "sets") == []


def test_generate_refuses_a_built_in_base_past_the_context(micro_factory, tmp_path, no_forward):
    model = micro_factory(micro_config(max_position_embeddings=40))  # base A is 48 tokens
    with pytest.raises(ContextLimitError, match=r"^the built-in base A \(random\) is 48 tokens long, beyond the "
                                                r"checkpoint's context of 40 tokens"):
        generate_set(tmp_path / "x", model_dir=model, cases="text", workers=1)
    assert not (tmp_path / "x").exists() and not (tmp_path / ".x.partial").exists()


def test_generate_beyond_the_context_when_allowed_is_recorded(tight, tmp_path):
    out = generate_set(tmp_path / "beyond", model_dir=tight, prompts=[[2] + [7] * (LIMIT - 3)], cases="text",
                       workers=1, allow_beyond_context=True)
    m = json.loads((out / "manifest.json").read_text())
    assert m["bases"]["P0"]["length"] == LIMIT + 1
    assert m["oracle"]["beyond_context"] == {"max_position_embeddings": LIMIT, "bases": {"P0": LIMIT + 1}}
    # a run within the context records nothing
    fits = json.loads((generate_set(tmp_path / "fits", model_dir=tight, cases="text", workers=1)
                       / "manifest.json").read_text())
    assert "beyond_context" not in fits["oracle"]


def test_generate_cli_allow_beyond_context(tight, tmp_path, capsys):
    f = _prompts(tmp_path, LIMIT - 2)
    out = tmp_path / "cli"
    code, stdout, err = run(capsys, conformance_main, "generate", "--model", str(tight), "--prompts", str(f),
                            "--out", str(out), "--workers", "1", "--cases", "text", "--allow-beyond-context", "-q")
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["oracle"]["beyond_context"]["bases"] == {"P0": LIMIT + 1}


def test_generate_refuses_an_image_base_past_the_context_before_its_forward(tmp_path, no_forward):
    """An image base's length is known after its preprocessing: its job refuses it before the decoder runs."""
    model = write_checkpoint("e2b-vision-mini", 0, tmp_path / "v", dtype="f32")
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 20
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ContextLimitError, match=r"^image base I\d is \d+ tokens long, beyond the checkpoint's "
                                                r"context of 20 tokens"):
        generate_set(tmp_path / "x", model_dir=model, cases="images", workers=1)
    assert not (tmp_path / "x").exists()
