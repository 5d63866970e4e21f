"""Prompts files (``conformance generate --prompts FILE.jsonl``): one JSON object a line, validated with the
line number, and encoded into token ids with the checkpoint's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from refimpl.chat import encode_conversation
from refimpl.errors import RefimplError


class PromptError(ValueError):
    """A bad prompts file or prompt entry (a usage error, not an integrity one); names the file and line."""


_PROMPT_KEYS = {"text", "messages", "tokens"}
_PROMPT_OPTIONAL = {"id", "chat"}


def check_prompt(entry: Any, where: str) -> dict:
    """One prompt entry -> {"kind": text|messages|tokens, "value": ..., "id": str|None, "chat": bool}."""
    if isinstance(entry, str):
        entry = {"text": entry}
    elif isinstance(entry, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in entry):
        entry = {"tokens": list(entry)}
    if not isinstance(entry, dict):
        raise PromptError(f"{where}: a prompt must be a JSON object with one of 'text', 'messages', 'tokens'")
    kinds = sorted(_PROMPT_KEYS & set(entry))
    unknown = sorted(set(entry) - _PROMPT_KEYS - _PROMPT_OPTIONAL)
    if unknown:
        raise PromptError(f"{where}: unknown key '{unknown[0]}' (allowed: text, messages, tokens, id, chat)")
    if len(kinds) != 1:
        raise PromptError(f"{where}: a prompt needs exactly one of 'text', 'messages', 'tokens'"
                          + (f" (got {', '.join(kinds)})" if kinds else ""))
    kind = kinds[0]
    value = entry[kind]
    pid = entry.get("id")
    if pid is not None and not isinstance(pid, str):
        raise PromptError(f"{where}: 'id' must be a string")
    chat = entry.get("chat", False)
    if not isinstance(chat, bool):
        raise PromptError(f"{where}: 'chat' must be true or false")
    if chat and kind != "text":
        raise PromptError(f"{where}: 'chat' only applies to 'text' (use 'messages' for a conversation)")
    if kind == "text":
        if not isinstance(value, str) or not value:
            raise PromptError(f"{where}: 'text' must be a non-empty string")
    elif kind == "messages":
        if not isinstance(value, list) or not value:
            raise PromptError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        for n, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise PromptError(f"{where}: message {n} must be an object with string 'role' and 'content'")
    else:
        if (not isinstance(value, list) or not value
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
            raise PromptError(f"{where}: 'tokens' must be a non-empty list of non-negative integers")
    return {"kind": kind, "value": value, "id": pid, "chat": chat, "where": where}


def load_prompts(path: str | Path) -> list[dict]:
    """Read a prompts JSONL file: one JSON object per line (blank lines are skipped), each with exactly
    one of ``text`` (raw text; ``"chat": true`` renders it as one user turn), ``messages`` (a chat
    conversation) or ``tokens`` (ids used as given), and an optional ``id``. PromptError names the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"{path}: cannot be read ({e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(entry, dict):
            raise PromptError(f"{where}: a prompt must be a JSON object with one of 'text', 'messages', 'tokens'")
        out.append(check_prompt(entry, where))
    if not out:
        raise PromptError(f"{path}: holds no prompt")
    return out


def prompt_entries(prompts) -> list[dict]:
    if prompts is None:
        return []
    if isinstance(prompts, (str, Path)):
        return load_prompts(prompts)
    return [check_prompt(p, f"prompt {n}") for n, p in enumerate(prompts)]


def chat_ids(tokenizer, model_dir: str | Path | None, messages: list[dict], where: str) -> list[int]:
    """A conversation's token ids through the checkpoint's own chat template (``refimpl.chat``), or the hand-written
    Gemma 4 format when it has none. Golden ids follow the checkpoint: a template that cannot be used (jinja2
    missing) is a PromptError, never a silent fallback."""
    if model_dir is None:
        return tokenizer.encode_chat(messages)
    try:
        prompt = encode_conversation(tokenizer, model_dir, messages)
    except RefimplError as e:
        raise PromptError(f"{where}: {e}") from None
    if prompt.warning is not None:
        raise PromptError(f"{where}: {prompt.warning.split('; the hand-written')[0]}: install jinja2 "
                          "(pip install 'gemma4-conformance[chat]') so that the set follows the checkpoint's template")
    return prompt.ids


def encode_prompt(p: dict, tokenizer, vocab: int, model_dir: str | Path | None = None) -> list[int]:
    """A prompt's token ids; chat prompts through ``model_dir``'s chat template when it has one (``chat_ids``)."""
    where = p["where"]
    if p["kind"] == "tokens":
        ids = list(p["value"])
    else:
        if tokenizer is None:
            raise PromptError(f"{where}: the model directory has no tokenizer.model, so only 'tokens' prompts work")
        try:
            if p["kind"] == "messages":
                ids = chat_ids(tokenizer, model_dir, p["value"], where)
            elif p["chat"]:
                ids = chat_ids(tokenizer, model_dir, [{"role": "user", "content": p["value"]}], where)
            else:
                ids = tokenizer.encode(p["value"])
        except PromptError:
            raise
        except Exception as e:  # noqa: BLE001 - TokenizerError and friends: report with the line
            raise PromptError(f"{where}: {e}") from None
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise PromptError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids


