"""``--backend openai``: grade a running OpenAI-compatible completions server (vLLM, SGLang, llama.cpp's
``llama-server``, llama-cpp-python's server, ollama, mlx-lm's server) from the top-k logprobs it returns.

    conformance check --backend openai --backend-option url=http://127.0.0.1:8080/v1 \\
        --backend-option model=NAME --fixtures SET --profile q4 [--concurrency 8]

The API key, when the server wants one, is read from the environment variable named by ``api_key_env``
(``OPENAI_API_KEY`` by default), never from a flag, so it never lands in a report.

Every row is one completion at temperature 0 with ``logprobs=top_k`` (``conformance.check.topk`` grades it):
a prompt's last row is the first generated token's distribution; interior and every-row cases need the server's
prompt logprobs (vLLM ``prompt_logprobs``, or ``echo`` where the server answers it); a chunked prefill is its
cumulative prompts, piece by piece, so that a prefix cache carries the state from one to the next; decode steps
are the server's own greedy continuation as long as it generates the case's tokens, then the prompt extended by
one token at a time (teacher forcing through the server's prefix cache); several sequences are sent at once.
What the server serves is probed at creation (``probe``) and stated as the backend's capabilities.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from refimpl.errors import check_choice
from refimpl.tokenizer import Tokenizer

from ...check.topk import PAD
from ...protocol.types import BackendError, Capabilities, Request, Response, TopLogprobs
from .http import Http, ServerError, ServerTimeout
from .probe import PROMPT_ROWS, PROMPTS, probe
from .replies import Completion, Keys, Row, parse_completion

ORDERS = ("prefix", "given")


def _split_url(url: str) -> tuple[str, str]:
    """(the API base, ending in /v1; the server's root) of ``url``."""
    if not url or not url.startswith(("http://", "https://")):
        raise BackendError(f"openai backend: url must be the server's address, http://HOST:PORT/v1, got {url!r}")
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base, base[: -len("/v1")]


class OpenAIBackend:
    """A running server, graded from its top-k logprobs (module doc)."""

    name = "openai"

    def __init__(self, url: str = "", model: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 top_k: int = 20, timeout: float = 120.0, prompts: str = "auto", prompt_rows: str = "auto",
                 order: str = "prefix", default_profile: str = "fp32", activations: str = "none",
                 cache_prompt: bool = True):
        for key, value, allowed in (("prompts", prompts, PROMPTS), ("prompt_rows", prompt_rows, PROMPT_ROWS),
                                    ("order", order, ORDERS)):
            check_choice(key, value, allowed, who="openai backend", error=BackendError)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 1000:
            raise BackendError(f"openai backend: top_k must be an integer in [1, 1000], got {top_k!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise BackendError(f"openai backend: timeout must be a positive number of seconds, got {timeout!r}")
        self.base, self.root = _split_url(url)
        self.http = Http("", os.environ.get(api_key_env) or None, float(timeout))
        self.top_k, self.order, self.cache_prompt = top_k, order, bool(cache_prompt)
        self.keys = Keys(None)
        self.texts: dict[tuple[int, ...], str] = {}  # text mode: a prompt's ids -> the text that round-trips
        self.bos = 2  # text mode: the <bos> the server adds to a text prompt (the checkpoint's, read at open)
        self.lock = threading.Lock()
        try:
            self.probed = probe(self.http, self.base, self.root, model, top_k, prompts, prompt_rows)
        except ServerError as e:
            raise BackendError(f"openai backend: {e}") from None
        rows = self.probed.prompt_rows is not None
        self.capabilities = Capabilities(
            full_forward=rows, last_plain=True, interior_rows=rows, output_rows=rows, chunked_prefill=True,
            multi_sequence=True, decode=True, top_logprobs=True, default_profile=default_profile,
            weight_formats="safetensors,mlx-affine,gguf", activation_conventions=str(activations))
        self.pool: ThreadPoolExecutor | None = None
        self.futures: dict[Request, Future] = {}
        self.case_timeout: float | None = None

    # -- the harness's calls -------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        """Text mode: the server's text of every token of the checkpoint's vocabulary (how its replies are keyed)."""
        if self.probed.prompts != "text":
            return
        tok = Tokenizer.from_dir(model_dir)
        if tok is None:
            raise BackendError(f"openai backend: text prompts need the checkpoint's tokenizer, {model_dir} has none")
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(self._token_text, range(tok.vocab_size)))
        self.keys, self.bos = Keys(texts), int(tok.bos_id)

    def run(self, request: Request) -> Response:
        future = self.futures.pop(request, None)
        if future is not None:
            return future.result()
        return self._serve(request)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool, self.futures = None, {}

    def set_case_timeout(self, seconds: float) -> None:
        """A case's completions give up together once ``seconds`` have passed since its first (nothing to restart:
        the next case goes on). Calls outside a case (the vocabulary's texts at ``open``) keep ``timeout``."""
        self.case_timeout = float(seconds)

    def _left(self, deadline: float | None) -> float | None:
        """Seconds left of the case's time (None: no case timeout); ServerTimeout once none is."""
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerTimeout(f"the case's calls to the server took longer than {self.case_timeout:g} s "
                                "(--case-timeout)")
        return left

    def refuses(self, request: Request) -> str | None:
        """Why this server cannot be asked ``request`` exactly (text mode: a prompt whose text does not come back as
        its ids), or None."""
        if self.probed.prompts != "text":
            return None
        targets = _targets(request) if request.kind in ("full", "last", "prefill") else []
        if any(0 in rows or len(p) == 1 for p, rows in targets):
            return ("row 0 (the row after <bos> alone): a text-prompt server gives no logprobs for a prompt's first "
                    "token, nor for an empty prompt")
        for ids in _sent_prompts(request):
            try:
                self._text(list(ids))
            except ServerError as e:
                return str(e)
        return None

    def prefetch(self, requests: list[Request], concurrency: int) -> None:
        """Send ``requests`` now, ``concurrency`` at a time (``order=prefix``: sorted by prompt, so that each prompt
        follows the ones it extends and a prefix cache reuses their blocks); ``run`` then takes each answer."""
        self.close()
        todo = sorted(set(requests), key=_whole_prompt) if self.order == "prefix" else requests
        self.pool = ThreadPoolExecutor(max(1, int(concurrency)), thread_name_prefix="openai")
        for request in todo:
            if request not in self.futures:
                self.futures[request] = self.pool.submit(self._serve, request)

    # -- one request -----------------------------------------------------------------------------------

    def _serve(self, request: Request) -> Response:
        deadline = None if self.case_timeout is None else time.monotonic() + self.case_timeout
        if request.kind == "multi":
            def one(i: int):
                seq = tuple(request.sequences[i])
                return self._sequence([(seq, (len(seq) - 1,))], tuple(request.decode[i]) if request.decode else (),
                                      deadline)

            with ThreadPoolExecutor(len(request.sequences)) as pool:  # sent at once: the server batches them
                parts = list(pool.map(one, range(len(request.sequences))))
            calls = sum(p[2]["calls"] for p in parts)
            return Response(None, logprobs=_top([p[0][0] for p in parts], self.top_k),
                            decode_logprobs=[_top(p[1], self.top_k) for p in parts] if request.decode else None,
                            executed={"calls": calls, "sequences": len(parts), **self._path()})
        rows, dec, info = self._sequence(_targets(request), tuple(request.decode), deadline)
        return Response(None, logprobs=_top(rows, self.top_k),
                        decode_logprobs=_top(dec, self.top_k) if request.decode else None,
                        executed={**info, **self._path()})

    def _path(self) -> dict:
        return {"server": self.probed.model, "prompts": self.probed.prompts,
                "prompt_rows": self.probed.prompt_rows or "none"}

    def _sequence(self, targets: list[tuple[tuple[int, ...], tuple[int, ...]]], decode: tuple[int, ...],
                  deadline: float | None):
        """The rows of one sequence: per target (a prompt, its rows to return) one completion; then its decode
        steps. (rows, decode rows, executed)."""
        rows: list[Row] = []
        calls, last = 0, None
        for i, (prompt, wanted) in enumerate(targets):
            more = len(decode) if i == len(targets) - 1 else 0
            last = self._complete(prompt, 1 + more, any(r < len(prompt) - 1 for r in wanted), deadline)
            calls += 1
            for r in wanted:
                if r not in last.rows and r < len(prompt) - 1:  # a prompt row the reply leaves out (echo's first)
                    rows.append(_row(self._complete(prompt[:r + 1], 1, False, deadline), r, prompt[:r + 1]))
                    calls += 1
                else:
                    rows.append(_row(last, r, prompt))
        prompt = targets[-1][0]
        T, dec, generated = len(prompt), [], 0
        while generated < len(decode) and generated < len(last.generated) and \
                last.generated[generated] == decode[generated] and T + generated in last.rows:
            dec.append(last.rows[T + generated])
            generated += 1
        for i in range(generated, len(decode)):
            fed = prompt + tuple(decode[:i + 1])
            dec.append(_row(self._complete(fed, 1, False, deadline), len(fed) - 1, fed))
            calls += 1
        return rows, dec, {"calls": calls, "decode_generated": generated, "decode_forced": len(decode) - generated}

    def _complete(self, ids: tuple[int, ...], max_tokens: int, prompt_rows: bool,
                  deadline: float | None = None) -> Completion:
        p = self.probed
        body = {"model": p.model, "prompt": list(ids) if p.prompts == "ids" else self._text(list(ids)),
                "max_tokens": max_tokens, "temperature": 0, "logprobs": self.top_k, "n": 1, "stream": False,
                # llama-server, vLLM: a greedy <eos> still answers its row
                "cache_prompt": self.cache_prompt, "ignore_eos": True}
        if p.prompts == "ids":
            body["return_tokens_as_token_ids"] = True
        if prompt_rows:
            body.update({"prompt_logprobs": self.top_k} if p.prompt_rows == "prompt_logprobs" else {"echo": True})
        reply = self.http.post(self.base + "/completions", body, self._left(deadline))
        got = parse_completion(reply, len(ids), self.keys,
                               echo=prompt_rows and p.prompt_rows == "echo")
        if got.prompt_tokens is not None and got.prompt_tokens != len(ids):
            raise ServerError(f"a reply for another request: its prompt has {got.prompt_tokens} tokens, this "
                              f"request's {len(ids)}")
        if len(ids) - 1 not in got.rows:
            why = (" (its text is an incomplete UTF-8 character, whose logprobs llama-server holds back)"
                   if got.text.endswith("\ufffd") else "")
            raise ServerError(f"the reply has no logprobs for its first generated token (row {len(ids) - 1}): "
                              f"logprobs missing{why}")
        return got

    # -- text mode ---------------------------------------------------------------------------------------

    def _detokenize_path(self) -> str:
        """The server's detokenize endpoint, beside its tokenize one (llama-cpp-python's extras, or llama-server's)."""
        return "/extras/detokenize" if self.probed.tokenizer == "/extras/tokenize" else "/detokenize"

    def _text(self, ids: list[int]) -> str:
        """The text the server turns back into exactly ``ids`` (its <bos> added by the server); ServerError when
        there is none."""
        key = tuple(ids)
        with self.lock:
            if key in self.texts:
                return self.texts[key]
        body_ids = ids[1:] if ids and ids[0] == self.bos else ids
        detok, tokenizer = self._detokenize_path(), self.probed.tokenizer
        reply = self.http.post(self.root + detok, {"tokens": body_ids})
        text = reply.get("text", reply.get("content")) if isinstance(reply, dict) else None
        if not isinstance(text, str):
            raise ServerError(f"POST {self.root}{detok}: no text in the reply")
        field = "input" if tokenizer == "/extras/tokenize" else "content"
        back = self.http.post(self.root + tokenizer, {field: text, "add_special": True}).get("tokens")
        if back != ids:
            raise ServerError(f"the prompt's text does not come back as its ids through the server's tokenizer "
                              f"({len(ids)} ids, {len(back or [])} back; the server takes text prompts only)")
        with self.lock:
            self.texts[key] = text
        return text

    def _token_text(self, i: int) -> str:
        """The server's text of token ``i`` as its replies key it ('' where the bytes are not UTF-8 alone)."""
        try:
            reply = self.http.post(self.root + self._detokenize_path(), {"tokens": [i]})
        except ServerError as e:
            if "HTTP 500" in str(e):  # a byte that is not UTF-8 on its own: the replies key it ''
                return ""
            raise
        return str(reply.get("text", reply.get("content", "")))


def _sent_prompts(request: Request) -> list[tuple[int, ...]]:
    """Every prompt serving ``request`` sends: each completion's prompt, and each decode step's extension."""
    if request.kind == "multi":
        seqs = [(tuple(s), tuple(request.decode[i]) if request.decode else ()) for i, s in enumerate(request.sequences)]
        targets = [[(s, ())] for s, _ in seqs]
    else:
        targets = [_targets(request)]
        seqs = [(targets[0][-1][0], tuple(request.decode))]
    out = [p for t in targets for p, _ in t]
    for prompt, decode in seqs:
        out += [prompt + decode[:i + 1] for i in range(len(decode))]
    return out


def _whole_prompt(request: Request) -> tuple[int, ...]:
    """The request's (first) sequence extended by its decode tokens: what ``order=prefix`` sorts by."""
    if request.kind == "multi":
        return tuple(request.sequences[0]) + (tuple(request.decode[0]) if request.decode else ())
    tokens = tuple(request.tokens) or tuple(t for p in request.pieces for t in p.tokens)
    return tokens + tuple(request.decode)


def _targets(request: Request) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, its rows to return) per completion of a ``full``, ``last`` or ``prefill`` request."""
    if request.kind == "full":
        return [(tuple(request.tokens), tuple(range(len(request.tokens))))]
    if request.kind == "last":
        return [(tuple(request.tokens), (request.last_pos,))]
    if request.kind != "prefill":
        raise ServerError(f"the openai backend does not serve {request.kind!r} requests")
    out, prompt = [], ()
    for piece in request.pieces:
        at = len(prompt)
        prompt = prompt + tuple(piece.tokens)
        out.append((prompt, tuple(at + r for r in piece.rows)))
    return out


def _row(got: Completion, r: int, prompt: tuple[int, ...]) -> Row:
    if r not in got.rows:
        raise ServerError(f"the reply has no logprobs for row {r} of its {len(prompt)}-token prompt")
    return got.rows[r]


def _top(rows: list[Row], k: int) -> TopLogprobs:
    """Rows as one TopLogprobs: each row's ``k`` most likely entries (a server may add the sampled or prompt token's
    own entry beyond its top k: vLLM's prompt_logprobs, llama-cpp-python), the shorter rows padded with id -1."""
    width = min(k, max((len(r.ids) for r in rows), default=0))
    ids = np.full((len(rows), width), PAD, dtype=np.int64)
    lps = np.full((len(rows), width), -np.inf)
    for i, r in enumerate(rows):
        best = np.argsort(-np.asarray(r.logprobs, dtype=np.float64), kind="stable")[:width]
        ids[i, :len(best)], lps[i, :len(best)] = np.asarray(r.ids)[best], np.asarray(r.logprobs)[best]
    return TopLogprobs(ids, lps, unnamed=[sorted(r.unnamed) for r in rows])
