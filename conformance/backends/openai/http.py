"""The HTTP side of the ``openai`` backend: JSON over an OpenAI-compatible server, every failure one line.

Only the standard library (urllib): grading a server needs no client package. Each call has the backend's
timeout (the case timeout under ``--case-timeout``); nothing waits past it.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from ...protocol.types import CaseTimeout

MAX_SHOWN = 200  # characters of a server's error body quoted in a message


class ServerError(RuntimeError):
    """The server could not be reached or its answer cannot be used (one line: what, where)."""


class ServerTimeout(ServerError, CaseTimeout):
    """The server did not answer within the timeout (the case's, under ``--case-timeout``)."""


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


class Http:
    """JSON calls to ``root`` (the server's address without its ``/v1``), with an optional API key sent as a
    bearer token (never written into a report)."""

    def __init__(self, root: str, api_key: str | None, timeout: float):
        self.root = root.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def get(self, path: str) -> Any:
        return self._call(urllib.request.Request(self.root + path, method="GET", headers=self.headers()))

    def post(self, path: str, body: dict, timeout: float | None = None) -> Any:
        """``timeout``: this call's limit when shorter than the client's (what is left of a case's time)."""
        data = json.dumps(body).encode("utf-8")
        headers = {**self.headers(), "Content-Type": "application/json"}
        return self._call(urllib.request.Request(self.root + path, data=data, method="POST", headers=headers), timeout)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _call(self, req: urllib.request.Request, timeout: float | None = None) -> Any:
        where = f"{req.get_method()} {req.full_url}"
        limit = self.timeout if timeout is None else min(self.timeout, timeout)
        try:
            with urllib.request.urlopen(req, timeout=limit) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as e:
            body = e.read().decode("utf-8", errors="replace") if e.fp is not None else ""
            raise ServerError(f"{where}: HTTP {e.code} {e.reason}: {_clip(body) or '(no body)'}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise ServerTimeout(f"{where}: no answer within {limit:.3g} s") from None
            raise ServerError(f"{where}: cannot reach the server ({e.reason})") from None
        except (socket.timeout, TimeoutError):
            raise ServerTimeout(f"{where}: no answer within {limit:.3g} s") from None
        except (ConnectionError, http.client.HTTPException) as e:
            raise ServerError(f"{where}: the connection failed ({type(e).__name__}: {e})") from None
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ServerError(f"{where}: malformed JSON in the reply ({e}): "
                              f"{_clip(raw.decode('utf-8', errors='replace'))}") from None
