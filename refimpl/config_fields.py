"""Reading config files and their typed fields, for the text config (config.py) and the towers' sections
(vision.py, audio.py): one JSON file read with its problems named, one field checked for its type and range, a
tower's section found; every problem is one ConfigError (InputError for a user's media file) naming the file and
the field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .errors import ConfigError, InputError
from .gguf_io import is_gguf

_REQUIRED = object()


def get_field(d: dict, key: str, kind: type | tuple, default: Any = _REQUIRED, where: str = "config.json") -> Any:
    """``d[key]`` checked to be of ``kind`` (an int is accepted as a float, a bool never as an int);
    ``default`` when absent or null, ConfigError naming ``where`` when absent without a default."""
    if key not in d or (d[key] is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise ConfigError(f"{where}: required field '{key}' is missing; add it to the config")
        return default
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if int in kinds and isinstance(value, bool):
        ok = bool in kinds
    elif float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
        value = float(value)
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{where}: field '{key}' must be {names}, got {value!r}; fix the value in the config")
    return value


def check_positive(value: int, key: str, where: str) -> int:
    """``value`` when > 0, else ConfigError naming field ``key`` of ``where``."""
    if value <= 0:
        raise ConfigError(f"{where}: field '{key}' must be positive, got {value}")
    return value


def required_positive(d: dict, key: str, where: str) -> int:
    """The required positive integer ``d[key]`` (``get_field`` then ``check_positive``)."""
    return check_positive(get_field(d, key, int, where=where), key, where)


def check_positive_float(value: float, key: str, where: str) -> None:
    """ConfigError unless ``value`` is a finite number > 0."""
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{where}: '{key}' must be a positive number, got {value}")


def token_ids(value: Any, key: str, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ConfigError(f"{where}: field '{key}' must be an integer or a list of integers, got {value!r}")
    return tuple(items)


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, for messages: "an array", "a string", ..."""
    kinds = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"),
             (dict, "an object"))
    return "null" if value is None else next(name for kind, name in kinds if isinstance(value, kind))


def tower_section(raw: Any, key: str, embedder: str, missing: str, where: str) -> tuple[dict, int, str]:
    """(the ``key`` section, e.g. ``vision_config``, of a Gemma4ForConditionalGeneration config.json; the
    text hidden_size, the width of the tower's ``embedder`` projection; the section's name for
    messages). ConfigError naming the problem; ``missing`` says why a checkpoint may lack the section."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level")
    section = raw.get(key)
    if section is None:
        raise ConfigError(f"{where}: no '{key}'; this checkpoint has no {missing}")
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: '{key}' must be an object")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: 'text_config' must be an object holding the text hidden_size ({embedder}'s width)")
    text_hidden = required_positive(text, "hidden_size", f"{where} text_config")
    return section, text_hidden, f"{where} {key}"


def read_config_json(model_dir: str | Path) -> tuple[Path, Any]:
    """(path, parsed content) of a checkpoint directory's config.json; ConfigError naming the problem."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if is_gguf(model_dir):
        raise ConfigError(f"{model_dir}: a GGUF file holds the text model only; the image and audio towers are read "
                          "from a checkpoint directory (config.json and safetensors)")
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: not a directory; pass a checkpoint directory holding config.json")
    if not path.is_file():
        raise ConfigError(f"{path}: not found; a checkpoint directory must hold config.json")
    return path, read_json(path)


def read_media_file(path: str | Path, what: str, kind: str) -> bytes:
    """The bytes of a user-given media file; InputError for a missing path, a directory or a read error.
    ``what``: "image" or "audio"; ``kind``: what to pass instead ("an image file", "a .wav file")."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} file {path} does not exist; check the path")
    if path.is_dir():
        raise InputError(f"{what} path {path} is a directory; pass the path of {kind}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise InputError(f"{what} file {path} cannot be read ({e.strerror or e})") from None


def read_json(path: Path) -> Any:
    """A JSON file's content; ConfigError naming the file for unreadable or invalid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({e})") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
