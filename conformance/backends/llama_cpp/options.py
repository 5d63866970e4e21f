"""The llama.cpp backend's options (KV cache type, outtype, library, multi-sequence decode) checked, and what
they mean for the run: the configuration's name, its default profile and shipped expectations, the capabilities
it claims, the activation convention of a GGUF checkpoint."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from refimpl import RefimplError, load_config
from refimpl.errors import check_choice

from ...check.profiles import PROFILES
from ...protocol.types import BackendError, Capabilities
from .mtp import CONVENTION as MTP_CONVENTION

EXPECTATIONS_DIR = Path(__file__).resolve().parent / "expectations"


KV_TYPES = {"f16": 1, "f32": 0}  # ggml_type: GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1


OUTTYPES = ("f32", "f16", "bf16", "q8_0")


LIBS = ("stock", "exact-gelu")


MULTI_DECODE = ("interleaved", "batched")


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"llama-cpp backend: {name} must be true or false, got {value!r}")


def check_options(kv_type: Any = "f16", lib: Any = "stock", threads: Any = 2, flash_attn: Any = False,
                  outtype: Any = "f32", swa_full: Any = True, kv_unified: Any = False,
                  multi_decode: Any = "interleaved", embeddings: Any = False,
                  default_profile: Any = None, verbose: Any = False, traces: Any = True) -> dict[str, Any]:
    """Validate the options shared by the engine and the subprocess backend; ValueError on a bad one."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"llama-cpp backend: kv_type must be 'f16' or 'f32', got {kv_type!r}")
    if not isinstance(lib, str) or not lib:
        raise ValueError(f"llama-cpp backend: lib must be 'stock', 'exact-gelu' or a directory holding "
                         f"libllama.so, got {lib!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"llama-cpp backend: threads must be a positive integer, got {threads!r}")
    check_choice("outtype", outtype, OUTTYPES, who="llama-cpp backend", error=ValueError)
    check_choice("multi_decode", multi_decode, MULTI_DECODE, who="llama-cpp backend", error=ValueError)
    if default_profile is not None:
        check_choice("default_profile", default_profile, PROFILES, who="llama-cpp backend", error=ValueError)
    return {"kv_type": kv_type, "lib": lib, "threads": threads, "flash_attn": _bool("flash_attn", flash_attn),
            "outtype": outtype, "swa_full": _bool("swa_full", swa_full), "kv_unified": _bool("kv_unified", kv_unified),
            "multi_decode": multi_decode, "embeddings": _bool("embeddings", embeddings),
            "default_profile": default_profile, "verbose": _bool("verbose", verbose), "traces": _bool("traces", traces)}


def default_profile_for(kv_type: str, lib_kind: str, outtype: str = "f32", flash_attn: bool = False) -> str:
    """The profile a configuration is graded with by default (see the module docstring)."""
    if outtype == "q8_0":
        return "q8"
    if outtype in ("f16", "bf16"):
        return "bf16"
    if kv_type == "f32" and lib_kind == "exact-gelu" and not flash_attn:
        return "fp32"
    # f16 KV (either library); the stock library with an f32 KV cache: its fp16 GELU table rounds
    # every MLP activation to float16, the "stock llama.cpp" case of the fp16-kv profile; flash
    # attention: build_attn_mha casts an f32 K/V view to f16 before ggml_flash_attn_ext, so the
    # attention reads float16 K and V whatever the cache type
    return "fp16-kv"


def config_name(kv_type: str, lib_kind: str, flash_attn: bool = False, outtype: str = "f32",
                swa_full: bool = True, kv_unified: bool = False, embeddings: bool = False) -> str:
    name = f"llama-cpp-{kv_type}kv"
    if lib_kind == "exact-gelu":
        name += "-exact-gelu"
    elif lib_kind == "custom":
        name += "-custom-lib"
    if outtype != "f32":
        name += f"-{outtype.replace('_', '')}"
    if flash_attn:
        name += "-fa"
    if not swa_full:
        name += "-swa-small"
    if kv_unified:
        name += "-kv-unified"
    if embeddings:
        name += "-embd"
    return name


def expectations_for(name: str) -> Path | None:
    p = EXPECTATIONS_DIR / f"{name}.json"
    return p if p.is_file() else None


# platform.machine() -> the ggml CPU kernel path its build quantises activations with (refimpl/ggml_act.PATHS)
KERNEL_PATHS = {"x86_64": "x86", "amd64": "x86", "aarch64": "arm", "arm64": "arm"}


def activation_convention(kv_type: str = "f32", flash_attn: bool = False, lib_kind: str = "exact-gelu") -> str:
    """The activation convention ggml's CPU kernels follow on this machine: the x86 SIMD quantisers on x86-64, the
    NEON ones on 64-bit ARM (refimpl/ggml_act.py), with the fp16 K/V cache's roundings for ``kv_type`` f16 and the
    stock library's fp16 GELU table (``/gelu-table``); none on other machines, with flash attention (its fp16
    accumulators) or with a library of unknown build (``lib`` a directory)."""
    path = KERNEL_PATHS.get(platform.machine().lower())
    if path is None or flash_attn or lib_kind not in ("exact-gelu", "stock"):
        return "none"
    return f"ggml-cpu/{path}" + ("/f16-kv" if kv_type == "f16" else "") + ("/gelu-table" if lib_kind == "stock" else "")


def capabilities_for(default_profile: str, embeddings: bool, traces: bool = True, kv_type: str = "f32",
                     flash_attn: bool = False, lib_kind: str = "exact-gelu") -> Capabilities:
    """A GGUF file given as the checkpoint is loaded as it is (``weight_formats`` gguf), its products following
    ggml's CPU activation convention (``activation_conventions``)."""
    return Capabilities(
        full_forward=True, last_plain=True, last_seq_id=True, last_embeddings=embeddings,
        embedding_convention="scaled", interior_rows=True, output_rows=True, ubatch=True,
        chunked_prefill=True, multi_sequence=True, decode=True, hidden_states=True,
        mtp=True, mtp_generate=True, mtp_conventions=MTP_CONVENTION, traces=traces, default_profile=default_profile,
        weight_formats="safetensors,gguf",
        activation_conventions=activation_convention(kv_type, flash_attn, lib_kind),
    )


def gguf_text_config(path: Path) -> dict:
    """The config keys ``open`` checks, of a GGUF file given as the checkpoint (refimpl reads its metadata)."""
    try:
        cfg = load_config(path)
    except RefimplError as e:
        raise BackendError(f"llama-cpp backend: cannot read the GGUF file {path}: {e}") from e
    return {"vocab_size": cfg.vocab_size, "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input}
