"""Old import path of ``conformance.backends.llama_cpp.backend``: this name is that module (kept for code written
against it; docs/architecture.md, "Migration")."""

import sys

from .llama_cpp import backend as _module

sys.modules[__name__] = _module
