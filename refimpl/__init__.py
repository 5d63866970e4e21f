"""Exact pure-NumPy reference (float64 by default) of the Gemma 4 text decoder.

    from refimpl import Gemma4
    model = Gemma4("path/to/checkpoint")            # config.json + safetensors (+ tokenizer.model)
    logits = model.forward([2, 17, 300], rows="last")

See docs/refimpl.md.
"""

import os as _os

# OpenBLAS's idle worker threads spin for about 2^28 cycles after each BLAS call. The oracle alternates
# BLAS products with its own weight-decoding threads on the same cores, and the spinning threads halve
# the decoding rate; 2^4 cycles lets them sleep at once. It only takes effect when set before NumPy
# loads OpenBLAS (when this package is imported first, as by its commands); a value already set is kept.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


from .config import TextConfig, load_config, parse_config
from .errors import ConfigError, InputError, RefimplError, TokenizerError, WeightsError
from .generate import greedy_generate, score_continuation
from .model import Gemma4, KVCache, Trace
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "Gemma4", "KVCache", "Trace", "TextConfig", "Tokenizer", "load_config", "parse_config",
    "greedy_generate", "score_continuation", "RefimplError", "ConfigError", "WeightsError",
    "TokenizerError", "InputError", "__version__",
]
