"""llama.cpp's staging API (``src/llama-ext.h``) through ctypes: what the engine needs beyond ``llama.h``.

``libllama`` exports these functions, but ``llama-ext.h`` declares them without ``extern "C"``, so they carry
C++ (Itanium ABI) names and llama-cpp-python 0.3.36 binds none of them. Their arguments are plain pointers,
ints and bools, passed the same way as from C, so ctypes calls them by their mangled names:

``llama_set_embeddings_nextn(ctx, value, masked)``
    Makes the context keep ``t_h_nextn``, the output of the final norm (the LM head's input: Gemma 4's graph,
    ``src/models/gemma4.cpp``, names it ``h_nextn`` and ``result_norm`` is its output rows). ``masked=false``
    keeps every token's row, in batch order, and leaves the graph as it is (the rows are pruned after the
    norm either way); ``masked=true`` keeps the output rows only, and Gemma 4's graph then prunes before
    the last layer's post-attention norm. The target uses ``false`` (as ``common/speculative.cpp`` does), a
    Gemma 4 assistant ``true`` (there ``h_nextn`` is its ``post_projection`` output, the next step's state).
``llama_get_embeddings_nextn_ith(ctx, i)``
    That row of batch index ``i`` (``n_embd_out`` floats), or NULL.
``llama_get_ctx_other(ctx)``
    The context a context was created against (``llama_context_params.ctx_other``): a Gemma 4 assistant's
    context shares the target's KV cache when this is the target's (``is_mem_shared`` in speculative.cpp).
"""

from __future__ import annotations

import ctypes

from ...protocol.types import BackendError

__all__ = ["Ext", "SYMBOLS"]

_CTX = ctypes.c_void_p
SYMBOLS = {  # name -> (mangled name, argtypes, restype)
    "llama_set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                                   [_CTX, ctypes.c_bool, ctypes.c_bool], None),
    "llama_get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                       [_CTX, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "llama_get_ctx_other": ("_Z19llama_get_ctx_otherP13llama_context", [_CTX], _CTX),
}


class Ext:
    """The staging functions of the ``libllama`` llama-cpp-python loaded (``llama_cpp.llama_cpp._lib``)."""

    def __init__(self, L):
        lib = getattr(getattr(L, "llama_cpp", None), "_lib", None)
        if lib is None:
            raise BackendError("llama-cpp backend: llama_cpp.llama_cpp._lib is missing; cannot reach llama-ext.h")
        for name, (mangled, argtypes, restype) in SYMBOLS.items():
            try:
                fn = getattr(lib, mangled)
            except AttributeError:
                raise BackendError(f"llama-cpp backend: {lib._name} exports no {name} ({mangled}, "
                                   f"src/llama-ext.h)") from None
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name, fn)
