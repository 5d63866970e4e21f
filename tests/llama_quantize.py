"""llama.cpp's own quantiser (``llama_model_quantize``, what ``llama-quantize`` runs) through llama-cpp-python, for
the tests' GGUF files: an f32 GGUF made by llama.cpp's converter requantised to Q4_0, Q4_K_M, ... (no importance
matrix; llama.cpp's per-tensor rules choose each tensor's type, docs/quantised.md)."""

from __future__ import annotations

from pathlib import Path

# llama.h's LLAMA_FTYPE_MOSTLY_*
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def quantize(src: Path, out: Path, ftype: str, threads: int = 2) -> Path:
    """``src`` (a GGUF) quantised by llama.cpp to ``ftype`` into ``out``; RuntimeError when llama.cpp fails."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
    return out
