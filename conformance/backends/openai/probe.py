"""What an OpenAI-compatible server can be graded on, found out by asking it (at the backend's creation).

``probe`` sends a few tiny completions: a prompt of token ids (refused by servers that take text only, such as
llama-cpp-python's), ``prompt_logprobs`` (vLLM), then ``echo`` with logprobs (llama-cpp-python with
``--logits_all``), and reads which of them come back with the rows they ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

from .http import Http, ServerError
from .replies import Keys, parse_completion

PROBE_IDS = [2, 10, 11, 12]  # <bos> and three ids every Gemma 4 vocabulary has
PROBE_TEXT = "The quick brown fox"  # the probe's prompt for a server that takes text only
PROMPTS = ("auto", "ids", "text")
PROMPT_ROWS = ("auto", "prompt_logprobs", "echo", "off")


@dataclass
class Probed:
    model: str
    prompts: str  # "ids" or "text"
    prompt_rows: str | None  # "prompt_logprobs", "echo" or None (the server returns no prompt rows)
    tokenizer: str | None  # text prompts: the server's tokenize endpoint ("/extras/tokenize" or "/tokenize")


def served_model(http: Http, base: str, model: str | None) -> str:
    """The model to ask for: ``model`` when the server lists it, the only one it lists when none is given."""
    reply = http.get(base + "/models")
    try:
        names = [str(m["id"]) for m in reply["data"]]
    except (KeyError, TypeError) as e:
        raise ServerError(f"GET {base}/models: not a model list ({type(e).__name__}: {e})") from None
    if model is None:
        if len(names) != 1:
            raise ServerError(f"the server at {base} serves {len(names)} models ({', '.join(names) or 'none'}): "
                              "pick one with --backend-option model=NAME")
        return names[0]
    if model not in names:
        raise ServerError(f"the server at {base} does not serve {model!r} (it serves: {', '.join(names) or 'none'})")
    return model


def _body(model: str, prompt, k: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": k, "n": 1,
            "stream": False, **extra}


def _takes_ids(http: Http, base: str, model: str, k: int) -> bool:
    try:
        reply = http.post(base + "/completions", _body(model, PROBE_IDS, k, return_tokens_as_token_ids=True))
    except ServerError as e:
        if ": HTTP " in str(e):  # it answered, refusing the ids (422, or llama-cpp-python's 500 for a validation error)
            return False
        raise
    try:
        got = parse_completion(reply, len(PROBE_IDS), Keys(None))
    except ServerError:
        return False  # takes ids, answers text keys: graded in text mode
    if len(PROBE_IDS) - 1 not in got.rows:
        raise ServerError(f"POST {base}/completions: the reply has no logprobs for the generated token; the server "
                          "must return logprobs (vLLM: --max-logprobs; llama-server answers them by default)")
    return True


def _tokenizer_path(http: Http, root: str) -> str:
    for path, body in (("/extras/tokenize", {"input": "a"}), ("/tokenize", {"content": "a"})):
        try:
            http.post(root + path, body)
            return path
        except ServerError:
            continue
    raise ServerError(f"the server at {root} takes text prompts only and has no tokenize endpoint (/extras/tokenize, "
                      "/tokenize): exact token ids cannot be sent")


def _text_probe(http: Http, root: str, tokenizer: str) -> tuple[str, int]:
    """(a text prompt, its number of tokens as the server counts them, <bos> included)."""
    field = "input" if tokenizer == "/extras/tokenize" else "content"
    tokens = http.post(root + tokenizer, {field: PROBE_TEXT, "add_special": True}).get("tokens")
    if not isinstance(tokens, list) or len(tokens) < 3:
        raise ServerError(f"POST {root}{tokenizer}: no token list for {PROBE_TEXT!r}")
    return PROBE_TEXT, len(tokens)


def _prompt_rows(http: Http, base: str, model: str, prompt, T: int, k: int, keys: Keys, want: str) -> str | None:
    tries = [("prompt_logprobs", {"prompt_logprobs": k}), ("echo", {"echo": True})]
    for name, extra in tries:
        if want not in ("auto", name):
            continue
        try:
            reply = http.post(base + "/completions", _body(model, prompt, k, **extra))
            got = parse_completion(reply, T, keys, echo=name == "echo")
        except ServerError:
            continue
        if all(r in got.rows for r in range(1, T)):
            return name
    if want not in ("auto", "off"):
        raise ServerError(f"the server does not return prompt logprobs through {want}")
    return None


def probe(http: Http, base: str, root: str, model: str | None, k: int, prompts: str, prompt_rows: str) -> Probed:
    """What the server serves."""
    name = served_model(http, base, model)
    takes_ids = prompts != "text" and _takes_ids(http, base, name, k)
    if prompts == "ids" and not takes_ids:
        raise ServerError(f"the server at {base} refuses token-id prompts (prompts=ids)")
    mode = "ids" if takes_ids else "text"
    tokenizer = _tokenizer_path(http, root) if mode == "text" else None
    prompt, T = (PROBE_IDS, len(PROBE_IDS)) if mode == "ids" else _text_probe(http, root, tokenizer)
    keys = Keys(None) if mode == "ids" else Keys([])
    rows = None if prompt_rows == "off" else _prompt_rows(http, base, name, prompt, T, k, keys, prompt_rows)
    return Probed(name, mode, rows, tokenizer)
