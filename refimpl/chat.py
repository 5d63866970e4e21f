"""Chat prompts: the checkpoint's own chat template, rendered as transformers' ``apply_chat_template``
renders it, or the hand-written Gemma 4 format (``Tokenizer.encode_chat``) when the checkpoint has none.

**Where the template is found** (transformers' order): ``chat_template.jinja`` in the checkpoint
directory; else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates
``[{"name": ..., "template": ...}]``, of which the one named ``default`` is used); else the processor's
legacy ``chat_template.json`` (``{"chat_template": ...}``). For a GGUF file: its ``tokenizer.chat_template``.

**How it is rendered** (transformers' ``_compile_jinja_template`` / ``render_jinja_template``): jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks=True, lstrip_blocks=True``, the ``loopcontrols``
extension and a ``{% generation %}`` block that renders its body; the globals ``raise_exception``,
``strftime_now``, ``namespace`` and ``dict`` and transformers' ``tojson`` filter (no HTML escaping). The
variables are ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (both None) and the
tokenizer's special tokens: ``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``,
``cls_token``, ``mask_token``, any other ``*_token`` string and the named ``extra_special_tokens`` of
``tokenizer_config.json`` (a string or an ``AddedToken`` object's ``content``); ``bos_token``,
``eos_token``, ``unk_token``, ``pad_token`` and ``mask_token`` default to ``tokenizer.model``'s pieces.
The rendered text is encoded with ``Tokenizer.encode_rendered`` (special tokens split out by id, no
``<bos>`` added: the template writes it), as transformers tokenizes it with ``add_special_tokens=False``.

jinja2 (3.1.6 or later, the version transformers requires: older ones have known sandbox escapes) is
imported only when a template is found. Without it, ``ChatPrompt.warning`` says that the template was not
used and why, and the hand-written format is used. A template that does not compile, fails to render or
calls ``raise_exception`` raises ``ChatTemplateError`` with a one-line message.

Multimodal content follows transformers' processors: a user turn's ``content`` is a list of items,
``{"type": "image"}`` / ``{"type": "audio"}`` and ``{"type": "text", "text": ...}``; the hand-written
format writes each media item as its placeholder piece (``<|image|>``, ``<|audio|>``) in place.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from .errors import ChatTemplateError, TokenizerError
from .gguf_io import is_gguf, open_gguf
from .tokenizer import Tokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GGUF_TEMPLATE_KEY = "tokenizer.chat_template"  # a GGUF file's chat template (the converter copies it there)
LEGACY_PROCESSOR_TEMPLATE_FILE = "chat_template.json"
MIN_JINJA2 = (3, 1, 6)
INSTALL_HINT = "pip install 'gemma4-conformance[chat]'"
# transformers' SPECIAL_TOKENS_ATTRIBUTES
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PLACEHOLDERS = {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}  # Gemma 4's, for the fallback


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # where it was found: a file, or "DIR/tokenizer_config.json (chat_template)"
    variables: dict[str, str] = field(default_factory=dict)  # the special tokens the template sees
    specials: tuple[str, ...] = ()  # strings split out of the rendered text as single tokens


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    template: str | None  # the source of the template used; None: the hand-written Gemma 4 format
    warning: str | None = None  # set when the checkpoint has a template that could not be used


def user_turn(text: str, media: tuple[str, ...] | list[str] = ()) -> list[dict]:
    """One user message: ``text`` alone, or, with media item types (``"image"``, ``"audio"``) to put in
    front of the text, the content list transformers' processors pass: the media items, then the text."""
    if not media:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": kind} for kind in media] + [{"type": "text", "text": text}]}]


# ----------------------------------------------------------------------------------------------
# finding the template


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def _token_string(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick(value: object, where: str) -> str | None:
    """The default template of a ``chat_template`` entry (a string, or named templates)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    named = None
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
    elif isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        named = value
    if named is None:
        raise ChatTemplateError(f"{where}: chat_template must be a string or a list of "
                                '{"name": ..., "template": ...} objects')
    if "default" not in named:
        raise ChatTemplateError(f"{where}: chat_template holds named templates ({', '.join(sorted(named))}) but "
                                "none named 'default', the one --chat uses")
    return named["default"]


def find_chat_template(model_dir: str | Path, tok: Tokenizer) -> ChatTemplate | None:
    """The checkpoint's chat template with the special tokens it sees, or None when it has none."""
    model_dir = Path(model_dir)
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_path}: must hold a JSON object")

    text, source = None, None
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    legacy_path = model_dir / LEGACY_PROCESSOR_TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            text, source = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except UnicodeDecodeError as e:
            raise ChatTemplateError(f"{jinja_path}: not UTF-8 text ({e.reason})") from None
    elif config.get("chat_template") is not None:
        source = f"{config_path} (chat_template)"
        text = _pick(config["chat_template"], str(config_path))
    elif is_gguf(model_dir) and isinstance(open_gguf(model_dir).metadata.get(GGUF_TEMPLATE_KEY), str):
        text, source = open_gguf(model_dir).metadata[GGUF_TEMPLATE_KEY], f"{model_dir} ({GGUF_TEMPLATE_KEY})"
    elif legacy_path.is_file():
        legacy = _read_json(legacy_path)
        if not isinstance(legacy, dict):
            raise ChatTemplateError(f"{legacy_path}: must hold a JSON object with chat_template")
        source = f"{legacy_path} (chat_template)"
        text = _pick(legacy.get("chat_template"), str(legacy_path))
    if text is None:
        return None

    variables: dict[str, str] = {}
    for key, value in config.items():
        if key in NAMED_SPECIAL_TOKENS or key.endswith("_token"):
            token = _token_string(value)
            if token is not None:
                variables[key] = token
    extra = config.get("extra_special_tokens")
    specials = []
    if isinstance(extra, dict):
        variables.update({k: t for k, v in extra.items() if isinstance(k, str) and (t := _token_string(v)) is not None})
    elif isinstance(extra, list):
        specials += [t for v in extra if (t := _token_string(v)) is not None]
    sp = tok.sp
    defaults = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id(), "pad_token": sp.pad_id()}
    for key, i in defaults.items():
        if key not in variables and i >= 0:
            variables[key] = sp.IdToPiece(i)
    if "mask_token" not in variables and tok.has_piece("<mask>"):
        variables["mask_token"] = "<mask>"
    added = config.get("added_tokens_decoder")
    if isinstance(added, dict):
        specials += [t for v in added.values() if (t := _token_string(v)) is not None]
    specials += list(variables.values())
    return ChatTemplate(text, source, variables, tuple(dict.fromkeys(specials)))


# ----------------------------------------------------------------------------------------------
# rendering


def _import_jinja2():
    """(the jinja2 module, None), or (None, why it cannot be used)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
        import jinja2.utils
    except ImportError:
        return None, f"jinja2 is not installed ({INSTALL_HINT})"
    version = getattr(jinja2, "__version__", "0")
    if tuple(int(n) for n in re.findall(r"\d+", version)[:3]) < MIN_JINJA2:
        return None, (f"jinja2 {version} is older than 3.1.6, which has known sandbox escapes "
                      f"(pip install -U 'jinja2>=3.1.6')")
    return jinja2, None


def _environment(jinja2):
    """The sandboxed environment of transformers' ``_compile_jinja_template``."""

    class Raised(jinja2.exceptions.TemplateError):
        """What the template's raise_exception raises."""

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask tracking in transformers): the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """``dict(...)`` without attribute access to the type."""
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` refusing underscore-prefixed attributes."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot store the attribute {name!r}")

    def raise_exception(message):
        raise Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env, Raised


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def render_chat_template(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = True,
                         jinja2=None) -> str:
    """The template rendered for ``messages``; ChatTemplateError (one line) when it does not compile,
    fails to render or raises. ``jinja2``: the module (imported here when not given)."""
    if jinja2 is None:
        jinja2, why = _import_jinja2()
        if jinja2 is None:
            raise ChatTemplateError(f"{template.source}: cannot render the chat template: {why}")
    env, raised = _environment(jinja2)
    where = template.source
    try:
        compiled = env.from_string(template.text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: the chat template does not compile: line {e.lineno}: "
                                f"{_one_line(e.message)}") from None
    except Exception as e:  # noqa: BLE001 - a template is untrusted input: never a traceback
        raise ChatTemplateError(f"{where}: the chat template does not compile: {type(e).__name__}: "
                                f"{_one_line(e)}") from None
    try:
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **template.variables)
    except raised as e:
        raise ChatTemplateError(f"{where}: the chat template raised an exception: {_one_line(e.message)}") from None
    except Exception as e:  # noqa: BLE001 - whatever Jinja raises is the template's error
        raise ChatTemplateError(f"{where}: the chat template failed to render: {type(e).__name__}: "
                                f"{_one_line(e)}") from None


# ----------------------------------------------------------------------------------------------
# encoding


def _flatten(messages: list[dict], placeholders: dict[str, str]) -> list[dict]:
    """Messages for the hand-written format: list content joined, media items as placeholder pieces."""
    flat = []
    for n, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for item in content:
                kind = item.get("type") if isinstance(item, dict) else None
                if kind == "text" and isinstance(item.get("text"), str):
                    parts.append(item["text"])
                elif kind in placeholders:
                    parts.append(placeholders[kind])
                else:
                    raise TokenizerError(f"chat message {n} has a content item the Gemma 4 chat format cannot "
                                         f"write: {item!r}")
            message = {**message, "content": "".join(parts)}
        flat.append(message)
    return flat


def encode_conversation(tok: Tokenizer, model_dir: str | Path, messages: list[dict],
                        add_generation_prompt: bool = True,
                        placeholders: dict[str, str] | None = None) -> ChatPrompt:
    """Token ids of ``messages`` through the checkpoint's chat template, or through the hand-written
    Gemma 4 format when it has none or jinja2 cannot be used (then ``warning`` says so).
    ``placeholders``: the piece the hand-written format writes for each media item type (default:
    Gemma 4's ``<|image|>``, ``<|audio|>``, ``<|video|>``)."""
    placeholders = {**PLACEHOLDERS, **(placeholders or {})}
    template = find_chat_template(model_dir, tok)
    warning = None
    if template is not None:
        jinja2, why = _import_jinja2()
        if jinja2 is not None:
            text = render_chat_template(template, messages, add_generation_prompt, jinja2=jinja2)
            ids = tok.encode_rendered(text, template.specials)
            if not ids:
                raise ChatTemplateError(f"{template.source}: the chat template rendered nothing")
            return ChatPrompt(ids, template.source)
        warning = (f"{template.source}: the checkpoint's chat template was not used: {why}; "
                   "the hand-written Gemma 4 chat format was used instead")
    return ChatPrompt(tok.encode_chat(_flatten(messages, placeholders), add_generation_prompt), None, warning)
