"""``python -m conformance.serve``: the reference server of the subprocess protocol as a command. It loads a
Python backend through the registry and serves it over stdin/stdout (``conformance.backends.subprocess.server``),
so the harness's ``subprocess`` backend (and ``conformance check --isolate``) can drive it like a foreign engine.

    python -m conformance.serve --backend NAME|module:attr [--backend-option KEY=VALUE ...]
                                [--backend-options-json OBJECT] [--format raw|safetensors]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .backends.subprocess.server import serve
from .protocol.types import BackendError
from .registry import load_backend
from .registry import parse_option as registry_parse_option


def parse_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE as the conformance CLI reads it: VALUE is a JSON number, true/false or null, else a string."""
    try:
        return registry_parse_option(text)
    except ValueError as e:
        raise SystemExit(f"conformance.serve: --backend-option {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.serve",
                                     description="Serve a Python backend over the subprocess protocol.")
    parser.add_argument("--backend", required=True, help="a registered name or module:attr")
    parser.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--backend-options-json", metavar="OBJECT", default="{}",
                        help="the backend's options as one JSON object (merged under --backend-option)")
    parser.add_argument("--format", choices=("raw", "safetensors"), default="raw",
                        help="how logits files are written (default raw)")
    args = parser.parse_args(argv)

    # Keep the real stdout for replies only; file descriptor 1 (and sys.stdout) now go to stderr, so
    # nothing printed by the backend or a C library it loads can corrupt the reply stream.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    try:
        options = json.loads(args.backend_options_json)
        if not isinstance(options, dict):
            raise ValueError(f"got {type(options).__name__}")
    except ValueError as exc:
        sys.stderr.write(f"conformance.serve: error: --backend-options-json must be a JSON object ({exc})\n")
        return 2
    options.update(parse_option(o) for o in args.backend_option)
    try:
        backend = load_backend(args.backend, **options)
    except BackendError as exc:
        sys.stderr.write(f"conformance.serve: error: {exc}\n")
        return 2
    return serve(backend, sys.stdin, replies, format=args.format)


if __name__ == "__main__":
    sys.exit(main())
