"""Reading a completions reply: the top-k logprobs of each row it carries, whatever the server's dialect.

Row ``r`` of a prompt is the distribution after its token ``r`` (what predicts token ``r + 1``); a reply to a
prompt of ``T`` tokens carries row ``T - 1`` as its first generated position, rows ``T, T + 1, ...`` as the
next ones, and the prompt's own rows where the server returns prompt logprobs. Dialects:

``content``          llama.cpp's ``llama-server``: ``choices[0].logprobs.content[i]`` with ``id``, ``logprob`` and
                     ``top_logprobs`` (each with ``id`` and ``logprob``).
``legacy``           the OpenAI completions format (vLLM, llama-cpp-python, SGLang): ``choices[0].logprobs`` with
                     ``tokens`` and ``top_logprobs`` (a dict per position, token -> logprob); with ``echo`` the
                     prompt's positions come first. Tokens are ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)
                     or text, which ``Keys`` names (several ids can share a text: those stay unnamed).
``prompt_logprobs``  vLLM's ``choices[0].prompt_logprobs``: per prompt token a dict ``"id" -> {"logprob": ...}``
                     (None for the first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .http import ServerError

ID_PREFIX = "token_id:"


@dataclass
class Row:
    """One row's top-k as the server gave it: the ids it names, their logprobs, and the ids it cannot name."""

    ids: list[int]
    logprobs: list[float]
    unnamed: set[int] = field(default_factory=set)


@dataclass
class Completion:
    rows: dict[int, Row]  # row index within prompt + generated tokens -> its top-k
    generated: list[int | None]  # the generated tokens (None: text shared by several ids)
    prompt_tokens: int | None  # usage.prompt_tokens
    text: str = ""  # choices[0].text


class Keys:
    """Token ids of the keys of a ``legacy`` reply: ``token_id:N``, else a text looked up in ``texts`` (id -> the
    server's text of that token; None: the server keys by ids only)."""

    def __init__(self, texts: list[str] | None = None):
        self.by_text: dict[str, list[int]] = {}
        for i, t in enumerate(texts or ()):
            self.by_text.setdefault(t, []).append(i)
        self.texts = texts is not None

    def resolve(self, key: str) -> tuple[int | None, tuple[int, ...]]:
        """(the id, or None where the key names several or none; the ids it may stand for)."""
        if key.startswith(ID_PREFIX) and key[len(ID_PREFIX):].isdigit():
            i = int(key[len(ID_PREFIX):])
            return i, (i,)
        if not self.texts:
            raise ServerError(f"the reply keys its logprobs by text ({key!r}), not by token id: pass the server "
                              "return_tokens_as_token_ids (vLLM) or use --backend-option prompts=text")
        ids = self.by_text.get(key, [])
        return (ids[0] if len(ids) == 1 else None), tuple(ids)


def _row_of_dict(tops: dict, keys: Keys) -> Row:
    row = Row([], [])
    for key, value in tops.items():
        lp = float(value["logprob"] if isinstance(value, dict) else value)
        if isinstance(value, dict) and str(key).lstrip("-").isdigit():  # prompt_logprobs: keyed by id
            i, could = int(key), ()
        else:
            i, could = keys.resolve(str(key))
        if i is None:
            row.unnamed.update(could)
        else:
            row.ids.append(i)
            row.logprobs.append(lp)
    return row


def _content(items: list, T: int) -> tuple[dict[int, Row], list[int | None]]:
    rows, generated = {}, []
    for g, item in enumerate(items):
        generated.append(int(item["id"]))
        tops = item["top_logprobs"]
        rows[T - 1 + g] = Row([int(t["id"]) for t in tops], [float(t["logprob"]) for t in tops])
    return rows, generated


def _legacy(lp: dict, T: int, n_generated: int | None, keys: Keys) -> tuple[dict[int, Row], list[int | None]]:
    """Entry e scores the token at position e + (T + G - n) (the entries end with the G generated tokens): its row
    is that position minus one; with ``echo`` the prompt's entries come first (the first of them None)."""
    tops, tokens = lp["top_logprobs"], lp.get("tokens") or []
    n = len(tops)
    G = n if n_generated is None else n_generated
    shift = T + G - n
    rows, generated = {}, []
    for e, entry in enumerate(tops):
        position = e + shift
        if position >= T:
            generated.append(keys.resolve(str(tokens[e]))[0] if e < len(tokens) else None)
        if entry is not None and position >= 1:
            rows[position - 1] = _row_of_dict(entry, keys)
    return rows, generated


def parse_completion(reply: Any, T: int, keys: Keys, echo: bool = False) -> Completion:
    """The rows of a reply to a prompt of ``T`` tokens. ServerError (one line) when it has none or is malformed."""
    try:
        choice = reply["choices"][0]
        lp = choice.get("logprobs")
        usage = reply.get("usage") or {}
        prompt_tokens = usage.get("prompt_tokens")
        rows: dict[int, Row] = {}
        generated: list[int | None] = []
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            made = usage.get("completion_tokens")
            if isinstance(made, int) and made != len(lp["content"]):  # rows would be read at the wrong places
                raise ServerError(f"the reply has logprobs for {len(lp['content'])} of its {made} generated tokens "
                                  "(llama-server holds back an incomplete UTF-8 character's)")
            rows, generated = _content(lp["content"], T)
        elif isinstance(lp, dict) and isinstance(lp.get("top_logprobs"), list):
            rows, generated = _legacy(lp, T, usage.get("completion_tokens") if echo else None, keys)
        pl = choice.get("prompt_logprobs")
        if isinstance(pl, list):
            for j, entry in enumerate(pl):
                if entry is not None and j >= 1:
                    rows.setdefault(j - 1, _row_of_dict(entry, keys))
    except ServerError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise ServerError(f"malformed completions reply ({type(e).__name__}: {e})") from None
    text = choice.get("text") if isinstance(choice.get("text"), str) else ""
    return Completion(rows, generated, int(prompt_tokens) if isinstance(prompt_tokens, int) else None, text)
