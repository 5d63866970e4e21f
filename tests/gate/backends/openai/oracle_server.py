"""An OpenAI-compatible completions server whose every row is the oracle's own float64 log-softmax, in one of the
dialects the openai backend reads (conformance/backends/openai/replies.py), for the backend's tests: a correct
reading of the dialect passes at exact-f64; a row read one place off fails.

``content``  llama-server: ``choices[0].logprobs.content[i].top_logprobs`` with ids; no prompt logprobs.
``vllm``     the legacy format keyed ``token_id:N`` (return_tokens_as_token_ids), prompt rows through
             ``prompt_logprobs`` (the prompt token's own entry added, as vLLM does).
``echo``     the legacy format keyed ``token_id:N``, prompt rows through ``echo`` (every prompt token listed, the
             first None, as the OpenAI API defines echo).
``shift``    (a fault) ``content``, but each generated row is the row before it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from fault_proxy import send_raw

from conformance.check.metrics import log_softmax

DIALECTS = ("content", "vllm", "echo", "shift")


class OracleServer:
    def __init__(self, model, dialect: str):
        assert dialect in DIALECTS
        self.model, self.dialect = model, dialect
        self.lock = threading.Lock()  # one forward at a time
        self.calls = 0
        self.auth: str | None = None  # the Authorization header of the last POST
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200 if self.path == "/v1/models" else 404, {"object": "list", "data": [{"id": "oracle"}]})

            def do_POST(self):
                server.auth = self.headers.get("Authorization")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._send(404, {"error": "no such endpoint"})
                    return
                if not isinstance(body.get("prompt"), list):
                    self._send(400, {"error": "prompt must be token ids"})
                    return
                self._send(200, server.complete(body))

            def _send(self, status: int, reply: dict):
                send_raw(self, status, json.dumps(reply).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _rows(self, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """(the n greedy tokens after ``ids``, the log-softmax of every row of ids + those tokens but the last)."""
        with self.lock:
            self.calls += 1
            seq = list(ids)
            for _ in range(n):
                logits = self.model.forward(seq, rows="all")
                seq.append(int(np.argmax(logits[-1])))
        return seq[len(ids):], np.stack([log_softmax(r) for r in logits])

    def complete(self, body: dict) -> dict:
        ids, n, k = [int(t) for t in body["prompt"]], int(body["max_tokens"]), int(body["logprobs"])
        T = len(ids)
        generated, lp = self._rows(ids, n)

        def top(r: int) -> list[int]:
            return [int(t) for t in np.argsort(-lp[r], kind="stable")[:k]]

        shift = 1 if self.dialect == "shift" else 0
        usage = {"prompt_tokens": T, "completion_tokens": n}
        if self.dialect in ("content", "shift"):
            content = [{"id": generated[g], "logprob": float(lp[T - 1 + g - shift, generated[g]]),
                        "top_logprobs": [{"id": t, "logprob": float(lp[T - 1 + g - shift, t])}
                                         for t in top(T - 1 + g - shift)]} for g in range(n)]
            return {"choices": [{"logprobs": {"content": content}}], "usage": usage}
        listed = list(range(T + n)) if self.dialect == "echo" and body.get("echo") else list(range(T, T + n))
        seq = ids + generated
        tokens = [f"token_id:{seq[p]}" for p in listed]
        tops = [None if p == 0 else {f"token_id:{t}": float(lp[p - 1, t]) for t in top(p - 1)} for p in listed]
        choice: dict = {"logprobs": {"tokens": tokens, "top_logprobs": tops}}
        if self.dialect == "vllm" and body.get("prompt_logprobs"):
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": float(lp[p - 1, t])} for t in {*top(p - 1), ids[p]}} for p in range(1, T)]
        return {"choices": [choice], "usage": usage}
