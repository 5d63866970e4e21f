"""Old import path of ``conformance.backends.mlx_lm.backend``: this name is that module (kept for code written
against it; docs/architecture.md, "Migration")."""

import sys

from .mlx_lm import backend as _module

sys.modules[__name__] = _module
