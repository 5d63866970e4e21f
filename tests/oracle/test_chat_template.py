"""``--chat`` renders the checkpoint's own chat template (``refimpl.chat``): found in ``chat_template.jinja``
or ``tokenizer_config.json``, rendered as transformers renders it, the hand-written Gemma 4 format
without one (or without jinja2, with a warning), and one ``error:`` line for a template that fails."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from refimpl.chat import ChatTemplate, find_chat_template, render_chat_template, user_turn
from refimpl.cli import main
from refimpl.cli_inputs import prompt_ids
from refimpl.multimodal import expand_image_placeholders, load_multimodal_tokens
from refimpl.safetensors_io import TensorStore
from refimpl.tokenizer import Tokenizer

pytest.importorskip("jinja2")

# gemma4-text-spec.md section 7: <bos>, then per message <|turn>{role}\n{content}<turn|>\n (assistant -> model,
# system/developer -> system), then <|turn>model\n as the generation prompt. Media items are written as their
# placeholder where they stand in the content list, as the hand-written format puts them at the start of the text.
SPEC_TEMPLATE = r"""{{- bos_token -}}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = 'model' -%}
    {%- elif message['role'] in ['system', 'developer'] -%}
        {%- set role = 'system' -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{- '<|turn>' + role + '\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{- '<|image|>' -}}
            {%- elif item['type'] == 'audio' -%}
                {{- '<|audio|>' -}}
            {%- elif item['type'] == 'text' -%}
                {{- item['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\n' -}}
{%- endif -%}
"""

SYSTEM_LINE = "You are terse."
# the spec's format with a system turn in front of the conversation
SYSTEM_TEMPLATE = SPEC_TEMPLATE.replace("{{- bos_token -}}",
                                        "{{- bos_token + '<|turn>system\\n" + SYSTEM_LINE + "<turn|>\\n' -}}", 1)

PROMPTS = ["hello", "What does the sliding window attention cache keep?", "café 漢字 naïve\n  two spaces ", ""]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def with_template(src: Path, dest: Path, template: str, where: str) -> Path:
    """A copy of the checkpoint ``src`` with ``template`` in chat_template.jinja ("jinja") or in
    tokenizer_config.json ("config", with bos_token written as an AddedToken object, as transformers saves it)."""
    shutil.copytree(src, dest)
    if where == "jinja":
        (dest / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config = {"chat_template": template, "bos_token": {"__type": "AddedToken", "content": "<bos>", "special": True},
                  "eos_token": "<eos>", "add_bos_token": False}
        (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return dest


def chat_tokens(capsys, tmp_path, model_dir, *argv):
    """(tokens, logits, stderr) of ``logits --chat``."""
    out_file = tmp_path / "chat.safetensors"
    code, _, err = run(capsys, "logits", "--model", str(model_dir), "--chat", *argv, "--out", str(out_file), "--force")
    assert code == 0, err
    store = TensorStore(out_file)
    return store.raw("tokens").tolist(), store.get("logits"), err


@pytest.fixture(scope="module", params=["jinja", "config"])
def spec_dirs(request, preset_dirs, tmp_path_factory):
    """{preset: copy with SPEC_TEMPLATE} for a text and an image checkpoint, per place of the template."""
    root = tmp_path_factory.mktemp(f"spec-{request.param}")
    return {preset: with_template(preset_dirs[preset], root / preset, SPEC_TEMPLATE, request.param)
            for preset in ("e2b-mini", "e2b-vision-mini", "e2b-audio-mini")}


# ----------------------------------------------------------------------------------------------
# the template is found and rendered as transformers renders it


def test_template_is_found_with_the_special_tokens(spec_dirs, preset_dirs):
    model_dir = spec_dirs["e2b-mini"]
    tok = Tokenizer.from_dir(model_dir)
    template = find_chat_template(model_dir, tok)
    assert template.text == SPEC_TEMPLATE
    assert template.source in (str(model_dir / "chat_template.jinja"),
                               f"{model_dir / 'tokenizer_config.json'} (chat_template)")
    assert template.variables["bos_token"] == "<bos>" and template.variables["eos_token"] == "<eos>"
    assert render_chat_template(template, user_turn("hi", ["image"])) == (
        "<bos><|turn>user\n<|image|>hi<turn|>\n<|turn>model\n")
    assert find_chat_template(preset_dirs["e2b-mini"], tok) is None  # the synthetic checkpoints ship none


def test_chat_template_jinja_takes_priority_over_tokenizer_config(preset_dirs, tmp_path):
    model_dir = with_template(preset_dirs["e2b-mini"], tmp_path / "both", SYSTEM_TEMPLATE, "config")
    (model_dir / "chat_template.jinja").write_text(SPEC_TEMPLATE, encoding="utf-8")
    template = find_chat_template(model_dir, Tokenizer.from_dir(model_dir))
    assert template.text == SPEC_TEMPLATE and template.source == str(model_dir / "chat_template.jinja")
    # named templates (tokenizer_config.json's list form): the one named "default"
    (model_dir / "chat_template.jinja").unlink()
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        {"name": "default", "template": SPEC_TEMPLATE}]}), encoding="utf-8")
    assert find_chat_template(model_dir, Tokenizer.from_dir(model_dir)).text == SPEC_TEMPLATE


# a template that uses what transformers' environment offers: whitespace control by trim_blocks/lstrip_blocks,
# namespace, loop controls, tojson, the generation block, special-token variables, tools/documents
FEATURES_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(images=0) %}
{% for message in messages %}
    {% if message['content'] is string %}
<|turn>{{ message['role'] }}
{{ message['content'] | trim }}<turn|>
    {% else %}
        {% for item in message['content'] %}
            {% if item['type'] == 'image' %}{% set ns.images = ns.images + 1 %}{% continue %}{% endif %}
{{ item | tojson }}
        {% endfor %}
    {% endif %}
{% endfor %}
{% generation %}images={{ ns.images }} tools={{ tools is none }} docs={{ documents is none }} {{ eos_token -}}
{% endgeneration %}
{% if add_generation_prompt %}
<|turn>model
{% endif %}"""


@pytest.mark.parametrize("template", [SPEC_TEMPLATE, SYSTEM_TEMPLATE, FEATURES_TEMPLATE])
@pytest.mark.parametrize("messages", [user_turn(" naïve <b>&\n "), user_turn("x", ["image", "image", "audio"])])
def test_rendering_matches_transformers(spec_dirs, template, messages):
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    model_dir = spec_dirs["e2b-mini"]
    found = find_chat_template(model_dir, Tokenizer.from_dir(model_dir))
    mine = render_chat_template(ChatTemplate(template, "t", found.variables), messages)
    theirs, _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True,
                                      **found.variables)
    assert mine == theirs[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_spec_template_gives_the_ids_of_the_hand_written_format(spec_dirs, preset_dirs, tmp_path, capsys, prompt):
    ids, logits, err = chat_tokens(capsys, tmp_path, spec_dirs["e2b-mini"], "--prompt", prompt)
    want, want_logits, _ = chat_tokens(capsys, tmp_path, preset_dirs["e2b-mini"], "--prompt", prompt)
    tok = Tokenizer.from_dir(preset_dirs["e2b-mini"])
    assert want == tok.encode_chat([{"role": "user", "content": prompt}])
    assert ids == want and np.array_equal(logits, want_logits)
    assert "warning" not in err


def test_spec_template_places_images_as_the_hand_written_format(spec_dirs, preset_dirs, tmp_path, capsys):
    png = tmp_path / "img.ppm"  # binary PPM, 50x30 (WxH), read natively
    pixels = np.random.default_rng(7).integers(0, 256, 30 * 50 * 3, dtype=np.uint8)
    png.write_bytes(b"P6\n50 30\n255\n" + pixels.tobytes())
    model_dir, bare = spec_dirs["e2b-vision-mini"], preset_dirs["e2b-vision-mini"]
    tok, mm = Tokenizer.from_dir(bare), load_multimodal_tokens(bare)
    for argv in (["--prompt", "describe"], ["--prompt", "compare <|image|> and <|image|>", "--image", str(png)],
                 ["--prompt", ""]):
        ids, logits, err = chat_tokens(capsys, tmp_path, model_dir, *argv, "--image", str(png))
        want, want_logits, _ = chat_tokens(capsys, tmp_path, bare, *argv, "--image", str(png))
        assert ids == want and np.array_equal(logits, want_logits), argv
        assert "warning" not in err
    # with no placeholder in the prompt: {"type": "image"} before the text item -> at the start of the user turn
    ids, _, _ = chat_tokens(capsys, tmp_path, model_dir, "--prompt", "describe", "--image", str(png))
    m = ids.count(mm.image_token_id)
    chat = tok.encode_chat([{"role": "user", "content": "<|image|>describe"}])
    assert ids == expand_image_placeholders(chat, [m], mm).tolist()
    assert ids[: ids.index(mm.boi_token_id)] == ([tok.bos_id, tok.piece_id("<|turn>")]
                                                 + tok.encode("user\n", add_bos=False))


def test_spec_template_places_images_then_clips(spec_dirs, preset_dirs):
    # the placeholder rule without running the towers: images first, then clips, each kind in front only
    # when the prompt has none of its placeholders
    model_dir, bare = spec_dirs["e2b-audio-mini"], preset_dirs["e2b-audio-mini"]
    mm = load_multimodal_tokens(bare)
    tok = Tokenizer.from_dir(bare)
    for prompt, images, clips in (("x", 1, 1), ("x", 2, 1), ("listen <|audio|> then", 1, 1), ("", 0, 2)):
        args = SimpleNamespace(tokens=None, prompt=prompt, chat=True)
        ids = prompt_ids(args, model_dir, images, mm, tok.bos_id, clips)[0]
        assert ids == prompt_ids(args, bare, images, mm, tok.bos_id, clips)[0]
        assert ids.count(mm.image_token_id) == images and ids.count(mm.audio_token_id) == clips


# ----------------------------------------------------------------------------------------------
# a different template is really used


@pytest.mark.parametrize("where", ["jinja", "config"])
def test_a_different_template_is_used(preset_dirs, tmp_path, capsys, where):
    model_dir = with_template(preset_dirs["e2b-mini"], tmp_path / "sys", SYSTEM_TEMPLATE, where)
    tok = Tokenizer.from_dir(model_dir)
    ids, _, err = chat_tokens(capsys, tmp_path, model_dir, "--prompt", "hello")
    assert ids == tok.encode_chat([{"role": "system", "content": SYSTEM_LINE}, {"role": "user", "content": "hello"}])
    assert ids != tok.encode_chat([{"role": "user", "content": "hello"}])
    assert tok.decode(ids) == f"<|turn>system\n{SYSTEM_LINE}<turn|>\n<|turn>user\nhello<turn|>\n<|turn>model\n"
    assert err == ""
    # generate uses the same prompt
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "hello", "--chat",
                       "--max-new-tokens", "1")
    assert code == 0 and err.startswith(f"[{len(ids)} prompt tokens")


def test_template_that_drops_image_items_is_refused(preset_dirs, tmp_path, capsys):
    text_only = SPEC_TEMPLATE.replace("{{- '<|image|>' -}}", "")
    model_dir = with_template(preset_dirs["e2b-vision-mini"], tmp_path / "noimg", text_only, "jinja")
    code, out, err = run(capsys, "logits", "--model", str(model_dir), "--prompt", "describe", "--chat",
                         "--image", str(tmp_path / "never-read.png"), "--out", str(tmp_path / "o.safetensors"))
    assert code == 2 and out == ""
    assert err == (f"refimpl: error: {model_dir / 'chat_template.jinja'}: the chat template wrote 0 image "
                   "placeholder(s) '<|image|>' for 1 image item(s); write the placeholders into --prompt, or pass the "
                   "token ids with --tokens\n")


# ----------------------------------------------------------------------------------------------
# without jinja2: the hand-written format and a one-line warning


def _no_jinja2(monkeypatch):
    for name in [m for m in sys.modules if m == "jinja2" or m.startswith("jinja2.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "jinja2", None)  # `import jinja2` raises ImportError


@pytest.mark.parametrize("command", ["logits", "generate"])
def test_without_jinja2_the_hand_written_format_is_used_with_a_warning(preset_dirs, tmp_path, capsys, monkeypatch,
                                                                       command):
    model_dir = with_template(preset_dirs["e2b-mini"], tmp_path / "sys", SYSTEM_TEMPLATE, "jinja")
    _no_jinja2(monkeypatch)
    warning = (f"warning: {model_dir / 'chat_template.jinja'}: the checkpoint's chat template was not used: jinja2 is "
               "not installed (pip install 'gemma4-conformance[chat]'); the hand-written Gemma 4 chat format was used "
               "instead\n")
    tok = Tokenizer.from_dir(model_dir)
    if command == "logits":
        ids, _, err = chat_tokens(capsys, tmp_path, model_dir, "--prompt", "hello")
        assert err == warning
        assert ids == tok.encode_chat([{"role": "user", "content": "hello"}])
    else:
        code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "hello", "--chat",
                           "--max-new-tokens", "1")
        assert code == 0 and err.startswith(warning)
        assert err[len(warning):].startswith(f"[{len(tok.encode_chat([{'role': 'user', 'content': 'hello'}]))} prompt")


def test_without_jinja2_images_still_go_to_the_start_of_the_user_turn(preset_dirs, tmp_path, monkeypatch, capsys):
    model_dir = with_template(preset_dirs["e2b-audio-mini"], tmp_path / "sys", SYSTEM_TEMPLATE, "config")
    mm = load_multimodal_tokens(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    _no_jinja2(monkeypatch)
    ids, _ = prompt_ids(SimpleNamespace(tokens=None, prompt="x", chat=True), model_dir, 1, mm, tok.bos_id, 1)
    assert ids == tok.encode_chat([{"role": "user", "content": "<|image|><|audio|>x"}])
    assert capsys.readouterr().err.startswith(f"warning: {model_dir / 'tokenizer_config.json'} (chat_template): ")


def test_an_old_jinja2_is_not_used(preset_dirs, tmp_path, capsys, monkeypatch):
    import jinja2

    model_dir = with_template(preset_dirs["e2b-mini"], tmp_path / "sys", SYSTEM_TEMPLATE, "jinja")
    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    ids, _, err = chat_tokens(capsys, tmp_path, model_dir, "--prompt", "hello")
    assert ids == Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": "hello"}])
    assert err == (f"warning: {model_dir / 'chat_template.jinja'}: the checkpoint's chat template was not used: jinja2 "
                   "3.1.5 is older than 3.1.6, which has known sandbox escapes (pip install -U 'jinja2>=3.1.6'); the "
                   "hand-written Gemma 4 chat format was used instead\n")


def test_jinja2_is_imported_only_for_a_template(preset_dirs, tmp_path):
    # a fresh interpreter: --chat on a checkpoint without a template never imports jinja2
    code = ("import sys; from refimpl.cli import main; "
            f"rc = main(['logits', '--model', {str(preset_dirs['e2b-mini'])!r}, '--prompt', 'hi', '--chat', "
            f"'--out', {str(tmp_path / 'o.safetensors')!r}]); "
            "print(rc, 'jinja2' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "0 False"


# ----------------------------------------------------------------------------------------------
# a template that fails: one error line, exit 2


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     "the chat template raised an exception: Conversation roles must alternate user/assistant"),
    ("{{ bos_token }}\n{% for message in messages %}\n{{ message['content'] }\n{% endfor %}",
     "the chat template does not compile: line 3: unexpected '}'"),
    ("{% if %}", "the chat template does not compile: line 1: Expected an expression, got 'end of statement block'"),
    ("{{ messages[3]['content'] }}",
     "the chat template failed to render: UndefinedError: list object has no element 3"),
    ("{{ ''.__class__.__mro__ }}",
     "the chat template failed to render: SecurityError: access to attribute '__class__' of 'str' object is unsafe."),
    ("{{ 1 + 'a' }}",
     "the chat template failed to render: TypeError: unsupported operand type(s) for +: 'int' and 'str'"),
    ("", "the chat template rendered nothing"),
])
@pytest.mark.parametrize("command", ["logits", "generate"])
def test_a_failing_template_is_one_error_line_and_exit_2(preset_dirs, tmp_path, capsys, template, message, command):
    model_dir = with_template(preset_dirs["e2b-mini"], tmp_path / "bad", template, "jinja")
    extra = ["--out", str(tmp_path / "o.safetensors")] if command == "logits" else ["--max-new-tokens", "1"]
    code, out, err = run(capsys, command, "--model", str(model_dir), "--prompt", "hello", "--chat", *extra)
    assert code == 2 and out == ""
    assert err == f"refimpl: error: {model_dir / 'chat_template.jinja'}: {message}\n"
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("config, message", [
    ({"chat_template": [{"name": "tool_use", "template": "x"}]},
     "{path}: chat_template holds named templates (tool_use) but none named 'default', the one --chat uses"),
    ({"chat_template": 5}, '{path}: chat_template must be a string or a list of {{"name": ..., "template": ...}} '
                           'objects'),
])
def test_a_malformed_template_entry_is_one_error_line(preset_dirs, tmp_path, capsys, config, message):
    model_dir = tmp_path / "cfg"
    shutil.copytree(preset_dirs["e2b-mini"], model_dir)
    path = model_dir / "tokenizer_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    code, _, err = run(capsys, "logits", "--model", str(model_dir), "--prompt", "hi", "--chat",
                       "--out", str(tmp_path / "o.safetensors"))
    assert code == 2
    assert err == f"refimpl: error: {message.format(path=path)}\n"
    path.write_text("{not json", encoding="utf-8")
    code, _, err = run(capsys, "logits", "--model", str(model_dir), "--prompt", "hi", "--chat",
                       "--out", str(tmp_path / "o.safetensors"))
    assert code == 2 and err == (f"refimpl: error: {path}: not valid JSON (Expecting property name enclosed in "
                                 "double quotes at line 1, column 2)\n")
