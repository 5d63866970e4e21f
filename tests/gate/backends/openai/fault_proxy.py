"""A fault-injecting HTTP proxy between the gate and a real OpenAI-compatible server (the openai backend's tests).

``FaultProxy(upstream, fault)`` listens on the loopback address and forwards every call to ``upstream``; on
``POST /v1/completions``, after the first three (the backend's probe), it plants ``fault``:

``shift``          the row before: the prompt's last token is cut before forwarding (through the server's own
                   tokenizer) and the reply's ``usage.prompt_tokens`` put back, so the answer looks like the request's
``drop``           every third completion: the connection is closed with no reply
``reorder``        replies of requests in flight together are swapped (a reply waits up to 0.5 s for a partner)
``stale``          each completion is answered with the previous completion's reply (a reply for another request)
``malformed``      the reply's JSON is cut in the middle
``http500``        HTTP 500 with an error body
``hang``           the reply comes 3 s late
``no-logprobs``    the reply's ``choices[0].logprobs`` removed
``fewer``          the reply's last generated position removed (fewer tokens than asked)
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("shift", "drop", "reorder", "stale", "malformed", "http500", "hang", "no-logprobs", "fewer")


def send_raw(handler: BaseHTTPRequestHandler, status: int, raw: bytes) -> None:
    """Answer ``handler``'s request with ``raw`` as a JSON body (the oracle server's too)."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class FaultProxy:
    def __init__(self, upstream: str, fault: str, spare: int = 3):
        """``spare``: the first completions pass untouched (the backend's probe: a server that misbehaves later)."""
        assert fault in FAULTS, fault
        self.upstream, self.fault = upstream.rstrip("/").removesuffix("/v1"), fault  # the server's root
        self.spare = spare
        self.count = 0
        self.lock = threading.Lock()
        self.previous: bytes | None = None
        self.waiting: list = []  # reorder: (reply, event, box) of a request waiting for a partner
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                try:
                    with urllib.request.urlopen(proxy.upstream + self.path, timeout=60) as r:
                        self._send(r.status, r.read())
                except urllib.error.HTTPError as e:
                    self._send(e.code, e.read())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._send(*_post(proxy.upstream + self.path, body))
                    return
                answer = proxy.completion(body)
                if answer is None:  # drop: no reply at all
                    self.close_connection = True
                    return
                self._send(*answer)

            def _send(self, status: int, raw: bytes):
                send_raw(self, status, raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.handle_error = lambda request, address: None  # a client that gave up (hang): no traceback
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def completion(self, body: dict) -> tuple[int, bytes] | None:
        with self.lock:
            self.count += 1
            n = self.count
        f = self.fault if n > self.spare else None
        if f == "drop" and n % 3 == 0:
            return None
        if f == "http500":
            return 500, b'{"error": {"message": "injected failure"}}'
        if f == "shift":
            body = self._cut_last(body)
        status, raw = _post(self.upstream + "/v1/completions", body)
        if status != 200:
            return status, raw
        reply = json.loads(raw)
        if f == "shift":
            reply["usage"]["prompt_tokens"] += 1
        elif f == "no-logprobs":
            reply["choices"][0].pop("logprobs", None)
        elif f == "fewer":
            lp = reply["choices"][0]["logprobs"]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset", "content"):
                if isinstance(lp.get(key), list) and lp[key]:
                    lp[key].pop()
        raw = json.dumps(reply).encode()
        if f == "hang":
            time.sleep(3)
        if f == "malformed":
            return 200, raw[: len(raw) // 2]
        if f == "stale":
            with self.lock:
                raw, self.previous = (self.previous or raw), raw
        if f == "reorder":
            return 200, self._swap(raw)
        return 200, raw

    def _cut_last(self, body: dict) -> dict:
        body = copy.deepcopy(body)
        if isinstance(body["prompt"], list):
            body["prompt"] = body["prompt"][:-1]
            return body
        _, raw = _post(self.upstream + "/extras/tokenize", {"input": body["prompt"]})
        tokens = json.loads(raw)["tokens"]
        _, raw = _post(self.upstream + "/extras/detokenize", {"tokens": tokens[1:-1]})
        body["prompt"] = json.loads(raw)["text"]
        return body

    def _swap(self, raw: bytes) -> bytes:
        """This reply goes to a request in flight beside it, and that one's comes here (alone for 0.5 s: its own)."""
        with self.lock:
            if self.waiting:
                other_raw, event, box = self.waiting.pop()
                box.append(raw)
                event.set()
                return other_raw
            event, box = threading.Event(), []
            self.waiting.append((raw, event, box))
        if event.wait(0.5):
            return box[0]
        with self.lock:
            if (raw, event, box) in self.waiting:
                self.waiting.remove((raw, event, box))
                return raw
        event.wait()
        return box[0]
