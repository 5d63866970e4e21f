"""llama.cpp (through llama-cpp-python's low-level C API) as an in-process conformance backend.

``LlamaCppEngine`` drives llama.cpp the way a server built on ``libllama`` does. It is an ordinary
in-process backend (``conformance.protocol.Backend``); **run it through**
``conformance.backends.llama_cpp.backend.LlamaCppBackend`` (registered as ``llama-cpp``), which
serves it from a child process: a failed ``GGML_ASSERT`` aborts the whole process (for example
llama.cpp's positional KV-sharing rule on a checkpoint whose unshared-layer prefix does not end in
``[sliding, full]``: ``llama-kv-cache.cpp: GGML_ASSERT(map_layer_ids.find(il_reuse) != ...)``), and
only a child process turns that into an error for the one case.

Opening a checkpoint
    The Hugging Face directory is converted to GGUF with the converter vendored in llama-cpp-python's
    sdist (``vendor/llama.cpp/convert_hf_to_gguf.py``, run with ``sys.executable``), ``--outtype f32``
    by default. The converter needs a ``tokenizer.json``: when the directory has none, one is made
    from ``tokenizer.model`` in a temporary copy of the directory (weights symlinked) with
    ``transformers.GemmaTokenizer.from_pretrained(dir).save_pretrained(dir)``, and its size must equal
    the config's ``vocab_size``. The GGUF is cached by content (sha256 of config.json, the
    safetensors files, the tokenizer files, the converter's sources and the outtype) under
    ``$GEMMA4_CONFORMANCE_CACHE/gguf`` (default ``~/.cache/gemma4-conformance/gguf``), so only the
    first open of a checkpoint converts. The model is loaded with ``llama_model_load_from_file``.

Serving requests (low-level API, ``llama_batch_init`` / ``llama_decode`` / ``llama_get_logits_ith``)
    Every request gets a **fresh context** (``llama_init_from_model``; a new KV cache, nothing
    survives from an earlier request) sized for it: ``n_seq_max`` = the largest sequence id + 1,
    ``n_ctx_seq`` = the longest sequence rounded up to 256 (llama.cpp pads it so; without a unified
    KV cache ``n_ctx = n_ctx_seq * n_seq_max``, each sequence its own stream), ``n_batch`` = the
    largest batch, ``n_ubatch`` = ``request.ubatch`` (else ``n_batch``: the batch is one forward).

    * ``full``: one batch, the logits flag on every token.
    * ``last``: one batch, the flag on row ``last_pos`` only (an interior row is gathered by
      llama.cpp's ``inp_out_ids`` before the last layers and the head). ``plain`` uses sequence 0;
      ``seq_id`` puts ``request.seq_id`` in the batch (``None``: sequence 0).
    * ``prefill``: each piece is one batch (one ``llama_decode``) with the flags on its rows only;
      llama.cpp splits it into micro-batches of ``n_ubatch`` itself, so micro-batches with no output
      still write K/V. Positions continue across pieces.
    * ``multi``: all sequences in **one** batch, each token tagged with its sequence id (the
      request's ids), the flag on the last token of each.
    * decode: one-token batches with the flag on, at position ``P + j``; for ``multi`` the steps
      are interleaved over the sequences (``multi_decode="interleaved"``), or one batch per step
      holding one token of every live sequence (``multi_decode="batched"``, what a server does).

    ``executed`` records the context (n_ctx, n_ctx_seq, n_seq_max, n_batch, n_ubatch, KV type, flash
    attention, library), every ``llama_decode`` call (tokens, outputs, sequence ids), and the state
    length llama.cpp reports after the prefill (``llama_memory_seq_pos_max + 1``).

Hidden states (``hidden_states``)
    A request with ``hidden`` gets a context that keeps the output of the final norm for every token
    (``llama_set_embeddings_nextn(ctx, true, masked=false)``, llama.cpp's staging API reached by its
    C++ names: ``ext``): Gemma 4's graph names that tensor ``h_nextn`` (always a graph output) and
    takes the head's input rows (``result_norm``) from it, so the graph and the logits are unchanged;
    each output row's state is ``llama_get_embeddings_nextn_ith`` of its batch index, read beside its
    logits. Not ``embeddings=true`` with pooling none (``cparams.embeddings``): that forces every token
    to be an output, which would change the rows llama.cpp computes.

Traces (``traces``)
    A request with ``trace`` (not MTP) gets a context whose graph evaluation callback (``cb_eval``) copies
    the tensors of Gemma 4's graph that are the trace points (``inp_scaled``, ``attn_post_norm-i``,
    ``ffn_post_norm-i``, ``ffn_moe_topk-i``, ``per_layer_embd_out-i``, ``l_out-i``, ``result_norm``: every point
    of ``conformance.protocol.trace``) at each batch's output rows, lined up with the logits rows; see
    ``conformance.backends.llama_cpp.trace``. Other contexts get no callback. The ``llama-cpp`` backend's
    child serves them through the subprocess protocol.

MTP (``mtp``, ``mtp_generate``; convention ``target-cache/P``)
    ``mtp.run_mtp``: the drafter checkpoint converted like the target (architecture
    ``gemma4-assistant``, without the centroid head), a context of type MTP over the target's KV cache,
    and llama.cpp's ``draft-mtp`` loop ported to Python (``common_speculative`` is not in libllama);
    see ``conformance.backends.llama_cpp.mtp``.

Input embeddings (``last_embeddings``): not claimed by default
    llama.cpp's Gemma 4 graph (``src/models/gemma4.cpp``) does not take ``batch.embd`` together with
    the token ids the per-layer embeddings (PLE) need. A batch with ``embd`` and no tokens takes the
    PLE of the padding token 0 for every position (``TAG_GEMMA4_IMG_PADDING``, meant for image
    soft tokens), and a batch that carries both uses the token path and ignores ``embd``
    (``build_inp_embd`` selects on ``ubatch.token``). ``embeddings=true`` claims the entry anyway
    and sends ``embd``-only batches (convention ``"scaled"``: the graph multiplies by ``sqrt(H)``
    only for token input): right for checkpoints without PLE, wrong by design for PLE checkpoints.

Options (``--backend-option KEY=VALUE``)
    ``kv_type``        ``"f16"`` (default, llama.cpp's default cache type) or ``"f32"``.
    ``lib``            ``"stock"`` (default: the library in the llama_cpp package), ``"exact-gelu"``
                       (``.cache/llama-cpp/exact-gelu/build/bin``, built by
                       ``scripts/build-llama-cpp.sh --exact-gelu``: ``GGML_GELU_FP16`` disabled) or
                       a directory holding ``libllama.so``. llama-cpp-python loads the library at
                       import from ``LLAMA_CPP_LIB_PATH``; in-process the engine sets it before the
                       first import, else checks that the loaded library is the one asked for.
    ``threads``        threads for llama.cpp (default 2).
    ``flash_attn``     ``false`` (default; llama.cpp's own default is "auto") or ``true``.
    ``outtype``        GGUF weight type: ``"f32"`` (default), ``"f16"``, ``"bf16"``, ``"q8_0"``.
    ``source``         the llama.cpp source tree holding ``convert_hf_to_gguf.py`` (default: env
                       ``LLAMA_CPP_SOURCE``, else the sdist tree that scripts/build-llama-cpp.sh
                       extracts: ``.cache/llama-cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp``).
    ``cache_dir``      where GGUF files are cached (default above).
    ``swa_full``       ``true`` (default, llama.cpp's default): full-size cache for sliding layers.
    ``kv_unified``     ``false`` (default, llama.cpp's default): one KV stream per sequence.
    ``multi_decode``   ``"interleaved"`` (default) or ``"batched"`` (see above).
    ``embeddings``     ``false`` (default) or ``true`` (see above).
    ``default_profile`` override the profile chosen below.
    ``verbose``        ``false`` (default): llama.cpp's log goes to stderr at level error only.
    ``traces``         ``true`` (default): claim and serve traces (see above).

Profiles
    ``fp16-kv`` for an f16 KV cache (either library). ``fp32`` for an f32 KV cache with the exact-GELU
    library. The **stock library with an f32 KV cache is graded ``fp16-kv`` too**: stock ggml-cpu
    computes GELU through a float16 lookup table (``GGML_GELU_FP16`` in ``ggml-cpu/vec.h``), an fp16
    rounding of every MLP activation, which is the "stock llama.cpp with its fp16 GELU table" the
    ``fp16-kv`` profile describes and which ``fp32`` is calibrated to catch. ``flash_attn=true`` is
    ``fp16-kv`` whatever the cache type: ``build_attn_mha`` (src/llama-graph.cpp) casts an f32 K/V
    view to f16 before ``ggml_flash_attn_ext`` (measured: exact-GELU + f32 KV + flash attention
    fails ``fp32`` on 147 of 220 cases at max_abs 0.02-0.15, passes ``fp16-kv``). Other outtypes
    are graded by analogy and ship no expectations: ``bf16`` for f16/bf16 weights, ``q8`` for q8_0
    (measured with an f16 KV cache on the 220 claimed cases: f16 fails 1, a 26b-a4b-mini MoE
    near-tie; bf16 fails 13, MoE near-ties and e2b-mini rows; q8_0 fails 15, e2b-mini kl_mean
    0.12-0.2 > 0.1 and two decided top-1 flips).

The name shows the configuration: ``llama-cpp-f16kv``, ``llama-cpp-f32kv``,
``llama-cpp-f32kv-exact-gelu`` (plus ``-fa``, ``-<outtype>``, ``-custom-lib``, ``-swa-small``,
``-kv-unified``, ``-embd`` when set); ``expectations_file`` is
``conformance/backends/llama_cpp/expectations/<name>.json`` when that file ships.

    conformance check --backend llama-cpp --backend-option kv_type=f32 --backend-option lib=exact-gelu
    conformance check --backend conformance.backends.llama_cpp.engine:LlamaCppEngine   # in-process
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from refimpl import RefimplError, load_config
from refimpl.errors import check_choice
from refimpl.gguf_io import is_gguf

from ...check.profiles import PROFILES
from ...protocol.serving import check_multi
from ...protocol.trace import trace_rows
from ...protocol.types import BackendError, Capabilities, Request, Response
from ...sets.format import sha256_file
from .ext import Ext
from .mtp import CONVENTION as MTP_CONVENTION
from .mtp import check_assistant, run_mtp
from .trace import SOURCE as TRACE_SOURCE
from .trace import Tracer

__all__ = [
    "DEFAULT_SOURCE",
    "EXACT_GELU_LIB",
    "EXPECTATIONS_DIR",
    "KV_TYPES",
    "LIBS",
    "LLAMA_CPP_PYTHON_VERSION",
    "MULTI_DECODE",
    "OUTTYPES",
    "REPO_ROOT",
    "LlamaCppEngine",
    "cache_root",
    "check_options",
    "config_name",
    "convert_to_gguf",
    "default_profile_for",
    "gguf_cache_key",
    "loaded_library",
    "make_tokenizer_json",
    "resolve_lib",
    "resolve_source",
]

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
REPO_ROOT = Path(__file__).resolve().parents[3]  # conformance/backends/llama_cpp/engine.py -> the checkout
DEFAULT_SOURCE = (REPO_ROOT / ".cache" / "llama-cpp" / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor"
                  / "llama.cpp")
EXACT_GELU_LIB = REPO_ROOT / ".cache" / "llama-cpp" / "exact-gelu" / "build" / "bin"
EXPECTATIONS_DIR = Path(__file__).resolve().parent / "expectations"
BUILD_HINT = "run scripts/build-llama-cpp.sh (add --exact-gelu for the exact-GELU library)"

KV_TYPES = {"f16": 1, "f32": 0}  # ggml_type: GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
LIBS = ("stock", "exact-gelu")
MULTI_DECODE = ("interleaved", "batched")
LLAMA_MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h)
CTX_PAD = 256  # llama.cpp pads n_ctx and n_ctx_seq to a multiple of 256
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")
GGUF_FORMAT = 1  # bump to invalidate every cached GGUF
HIDDEN_SOURCE = ("llama_get_embeddings_nextn_ith: t_h_nextn (the output of output_norm, the head's input), "
                 "llama_set_embeddings_nextn(ctx, true, masked=false)")
CONVERT_TIMEOUT_S = 7200  # a real checkpoint's f32 conversion takes minutes; the tiny presets take seconds


# ----------------------------------------------------------------------------------------------
# options


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


def stock_lib_dir() -> Path | None:
    """The library directory of the installed llama_cpp package (found without importing it)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "lib"


def resolve_lib(lib: str) -> tuple[str, Path | None]:
    """``lib`` option -> (kind, directory): ("stock", the package's lib dir), ("exact-gelu", dir) or
    ("custom", dir). The directory is None only for "stock" when llama_cpp is not installed.

    Raises BackendError when the exact-GELU or custom directory or its libllama.so is missing.
    """
    if lib == "stock":
        return "stock", stock_lib_dir()
    if lib == "exact-gelu":
        d = EXACT_GELU_LIB
        if not (d / "libllama.so").is_file():
            raise BackendError(f"llama-cpp backend: lib='exact-gelu' needs the exact-GELU build at {d} "
                               f"(no libllama.so there); build it with: scripts/build-llama-cpp.sh --exact-gelu")
        return "exact-gelu", d.resolve()
    d = Path(lib).expanduser().resolve()
    if not d.is_dir() or not (d / "libllama.so").is_file():
        raise BackendError(f"llama-cpp backend: lib {lib!r} is neither 'stock', 'exact-gelu' nor a directory "
                           f"holding libllama.so")
    if EXACT_GELU_LIB.is_dir() and d == EXACT_GELU_LIB.resolve():
        return "exact-gelu", d
    if d == stock_lib_dir():
        return "stock", d
    return "custom", d


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


def activation_convention(kv_type: str = "f32", flash_attn: bool = False, lib_kind: str = "exact-gelu") -> str:
    """The activation convention ggml's CPU kernels follow on this machine: the x86 SIMD quantisers on x86-64
    (refimpl/ggml_act.py), with the fp16 K/V cache's roundings for ``kv_type`` f16 and the stock library's fp16
    GELU table (``/gelu-table``); none that the oracle emulates on other machines (ARM's NEON path), with
    flash attention (fp16 accumulators) or with a library of unknown build (``lib`` a directory)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or flash_attn or lib_kind not in ("exact-gelu", "stock"):
        return "none"
    return "ggml-cpu/x86" + ("/f16-kv" if kv_type == "f16" else "") + ("/gelu-table" if lib_kind == "stock" else "")


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


# ----------------------------------------------------------------------------------------------
# conversion to GGUF


def resolve_source(source: str | os.PathLike | None = None) -> Path:
    """The llama.cpp tree holding convert_hf_to_gguf.py: ``source``, $LLAMA_CPP_SOURCE, or the sdist."""
    if source is not None:
        where = f"source option {str(source)!r}"
        d = Path(source).expanduser()
    elif os.environ.get("LLAMA_CPP_SOURCE"):
        where = f"LLAMA_CPP_SOURCE={os.environ['LLAMA_CPP_SOURCE']!r}"
        d = Path(os.environ["LLAMA_CPP_SOURCE"]).expanduser()
    else:
        where = "the default location"
        d = DEFAULT_SOURCE
    if not (d / "convert_hf_to_gguf.py").is_file():
        raise BackendError(
            f"llama-cpp backend: no llama.cpp converter at {d / 'convert_hf_to_gguf.py'} ({where}). Get the "
            f"llama.cpp sources that match llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} with "
            f"scripts/build-llama-cpp.sh (it extracts the sdist to .cache/llama-cpp/src/), or point the "
            f"'source' option or LLAMA_CPP_SOURCE at a llama.cpp tree")
    return d.resolve()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("GEMMA4_CONFORMANCE_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "gemma4-conformance"
    return base / "gguf"


_CONVERTER_IDS: dict[Path, str] = {}


def converter_identity(source: Path) -> str:
    """sha256 over the converter's sources: convert_hf_to_gguf.py, conversion/, gguf-py/gguf/."""
    if source in _CONVERTER_IDS:
        return _CONVERTER_IDS[source]
    files = [source / "convert_hf_to_gguf.py"]
    for sub in ("conversion", "gguf-py/gguf"):
        files += sorted(p for p in (source / sub).rglob("*.py") if "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(source)).encode() + b"\0" + sha256_file(p).encode() + b"\n")
    _CONVERTER_IDS[source] = h.hexdigest()
    return _CONVERTER_IDS[source]


def _checkpoint_files(model_dir: Path) -> list[Path]:
    names = ["config.json", "model.safetensors.index.json", *TOKENIZER_FILES]
    files = [model_dir / n for n in names if (model_dir / n).is_file()]
    files += sorted(model_dir.glob("*.safetensors"))
    return sorted(set(files))


def read_text_config(model_dir: Path) -> dict:
    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise BackendError(f"llama-cpp backend: cannot read {model_dir / 'config.json'}: {e}") from e
    return raw.get("text_config", raw) if isinstance(raw, dict) else {}


def gguf_cache_key(model_dir: Path, source: Path, outtype: str) -> tuple[str, dict]:
    """(key, manifest): the content hash a converted GGUF is cached under."""
    files = _checkpoint_files(model_dir)
    if not (model_dir / "config.json").is_file():
        raise BackendError(f"llama-cpp backend: {model_dir} has no config.json")
    if not any(p.suffix == ".safetensors" for p in files):
        raise BackendError(f"llama-cpp backend: {model_dir} has no *.safetensors weights")
    manifest: dict[str, Any] = {
        "format": GGUF_FORMAT,
        "files": {p.name: sha256_file(p) for p in files},
        "converter": converter_identity(source),
        "outtype": outtype,
    }
    if not (model_dir / "tokenizer.json").is_file():
        try:  # the version without importing transformers (seconds)
            manifest["tokenizer_json"] = f"generated by transformers {version('transformers')}"
        except PackageNotFoundError:
            manifest["tokenizer_json"] = "generated (transformers missing)"
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    return key, manifest


def make_tokenizer_json(model_dir: Path, out_dir: Path, vocab_size: int | None = None) -> Path:
    """Write ``tokenizer.json`` (+ tokenizer_config.json) for ``model_dir``'s tokenizer.model into
    ``out_dir``: a copy of the small files and symlinks to the weights (the converter reads the
    directory; nothing is written into ``model_dir``). Checks the tokenizer has exactly
    ``vocab_size`` entries (the converter asserts it). Returns ``out_dir``.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "tokenizer.model").is_file():
        raise BackendError(f"llama-cpp backend: {model_dir} has neither tokenizer.json nor tokenizer.model; "
                           f"the GGUF converter needs a tokenizer")
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in model_dir.iterdir():
        if p.is_dir():
            continue
        dst = out_dir / p.name
        if p.suffix == ".safetensors":
            dst.symlink_to(p.resolve())
        else:
            shutil.copyfile(p, dst)  # a copy: save_pretrained below must never write through a link
    try:
        from transformers import GemmaTokenizer
    except ImportError as e:
        raise BackendError("llama-cpp backend: making tokenizer.json from tokenizer.model needs transformers "
                           "and protobuf: pip install 'gemma4-conformance[hf]'") from e
    try:
        tok = GemmaTokenizer.from_pretrained(str(out_dir))
        tok.save_pretrained(str(out_dir))
    except Exception as e:
        raise BackendError(f"llama-cpp backend: making tokenizer.json from {model_dir / 'tokenizer.model'} "
                           f"failed: {type(e).__name__}: {e}") from e
    if vocab_size is None:
        vocab_size = read_text_config(model_dir).get("vocab_size")
    n = len(tok)
    with open(out_dir / "tokenizer.json", encoding="utf-8") as f:
        n_json = len(json.load(f)["model"]["vocab"])
    if vocab_size is not None and (n != vocab_size or n_json > vocab_size):
        raise BackendError(f"llama-cpp backend: the tokenizer made from tokenizer.model has {n} tokens "
                           f"({n_json} in tokenizer.json's vocab), the config's vocab_size is {vocab_size}; "
                           f"the GGUF converter needs exactly vocab_size (add Gemma's special pieces "
                           f"<pad> <eos> <bos> <unk> <mask> to the SentencePiece model)")
    return out_dir


def _pid_alive(pid: str) -> bool:
    """Whether process ``pid`` (text from a .part file name) still runs; a conversion it owns is in use."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def convert_to_gguf(model_dir: Path, source: Path, outtype: str = "f32", cache_dir: Path | None = None,
                    log=None) -> tuple[Path, dict]:
    """Convert (or find in the cache) ``model_dir`` as GGUF; returns (path, info)."""
    model_dir = Path(model_dir).resolve()
    key, manifest = gguf_cache_key(model_dir, source, outtype)
    root = cache_root(cache_dir)
    out = root / f"{key}.gguf"
    info = {"gguf": str(out), "key": key, "outtype": outtype, "converter": str(source / "convert_hf_to_gguf.py"),
            "converter_sha256": manifest["converter"], "cached": True}
    if out.is_file():
        return out, info
    root.mkdir(parents=True, exist_ok=True)
    info["cached"] = False
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-cpp-convert-") as tmp:
        src = model_dir
        if not (model_dir / "tokenizer.json").is_file():
            src = make_tokenizer_json(model_dir, Path(tmp) / "ckpt", read_text_config(model_dir).get("vocab_size"))
            info["tokenizer_json"] = manifest.get("tokenizer_json")
        for stale in root.glob(f".{key}.*.part"):  # left by a conversion that was killed mid-way
            if not _pid_alive(stale.name.split(".")[2]):
                stale.unlink(missing_ok=True)
        part = root / f".{key}.{os.getpid()}.{threading.get_ident()}.part"
        cmd = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(src), "--outtype", outtype,
               "--outfile", str(part)]
        if log:
            log(f"converting {model_dir} to GGUF ({outtype}): {' '.join(cmd)}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            part.unlink(missing_ok=True)
            raise BackendError(f"llama-cpp backend: GGUF conversion of {model_dir} timed out after "
                               f"{CONVERT_TIMEOUT_S} s") from e
        if proc.returncode != 0 or not part.is_file():
            part.unlink(missing_ok=True)
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-25:])
            raise BackendError(f"llama-cpp backend: GGUF conversion of {model_dir} failed (exit {proc.returncode}): "
                               f"{' '.join(cmd)}\n{tail}")
        os.replace(part, out)
    (root / f"{key}.json").write_text(json.dumps({**manifest, "source_dir": str(model_dir),
                                                  "converted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                                 indent=1, sort_keys=True) + "\n", encoding="utf-8")
    info["convert_s"] = round(time.monotonic() - t0, 2)
    return out, info


# ----------------------------------------------------------------------------------------------
# the library


def loaded_libraries() -> dict[str, str]:
    """The llama.cpp / ggml shared libraries mapped into this process: {basename: path}."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                base = os.path.basename(path)
                if base.startswith(("libllama.", "libggml")) and ".so" in base:
                    out.setdefault(base, path)
    except OSError:
        pass
    return out


def loaded_library(name: str = "libllama") -> str | None:
    """The path of ``name.so`` mapped into this process, if any."""
    for base, path in loaded_libraries().items():
        if base == name + ".so" or base.startswith(name + ".so."):
            return path
    return None


def _import_llama_cpp(lib_kind: str, lib_dir: Path | None):
    """Import llama_cpp with the library asked for (llama-cpp-python reads LLAMA_CPP_LIB_PATH at
    import), then check that libllama *and* the ggml libraries come from that directory."""
    if "llama_cpp" not in sys.modules and lib_dir is not None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    try:
        import llama_cpp
    except ImportError as e:
        raise BackendError(f"llama-cpp backend: llama-cpp-python is not installed ({e}); {BUILD_HINT}") from e
    except (OSError, RuntimeError) as e:
        raise BackendError(f"llama-cpp backend: loading the llama.cpp library from {lib_dir} failed: {e}") from e
    if lib_dir is None:
        lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
    libs = loaded_libraries()
    wrong = {b: p for b, p in libs.items() if Path(p).resolve().parent != lib_dir.resolve()
             and b.split(".so")[0] in ("libllama", "libggml", "libggml-base", "libggml-cpu")}
    if "libllama.so" not in libs and not any(b.startswith("libllama.so") for b in libs):
        raise BackendError("llama-cpp backend: llama_cpp imported but no libllama.so is mapped")
    if wrong:
        raise BackendError(f"llama-cpp backend: lib={lib_kind!r} wants the libraries of {lib_dir}, but this process "
                           f"mapped {', '.join(f'{p}' for p in wrong.values())}; llama-cpp-python loads its library "
                           f"once per process (use the llama-cpp backend, which runs a fresh process)")
    return llama_cpp


# ----------------------------------------------------------------------------------------------
# the engine


def _pad(n: int, to: int = CTX_PAD) -> int:
    return max(to, -(-n // to) * to)


class LlamaCppEngine:
    """llama.cpp in this process behind the backend protocol; see the module docstring."""

    def __init__(self, kv_type: str = "f16", lib: str = "stock", threads: int = 2, flash_attn: bool = False,
                 outtype: str = "f32", source: str | None = None, cache_dir: str | None = None,
                 swa_full: bool = True, kv_unified: bool = False, multi_decode: str = "interleaved",
                 embeddings: bool = False, default_profile: str | None = None, verbose: bool = False,
                 traces: bool = True):
        o = check_options(kv_type, lib, threads, flash_attn, outtype, swa_full, kv_unified, multi_decode,
                          embeddings, default_profile, verbose, traces)
        self.options = o
        self.lib_kind, self.lib_dir = resolve_lib(o["lib"])
        self.source_option = source
        self.cache_dir = cache_dir
        self.name = config_name(o["kv_type"], self.lib_kind, o["flash_attn"], o["outtype"], o["swa_full"],
                                o["kv_unified"], o["embeddings"])
        profile = o["default_profile"] or default_profile_for(o["kv_type"], self.lib_kind, o["outtype"],
                                                              o["flash_attn"])
        self.capabilities = capabilities_for(profile, o["embeddings"], o["traces"], o["kv_type"], o["flash_attn"],
                                             self.lib_kind)
        self.expectations_file = expectations_for(self.name)
        self.L = None
        self.model = None
        self.n_vocab = 0
        self.n_embd = 0
        self.ext: Ext | None = None
        self._hidden = False  # the request being served asks for hidden rows (Request.hidden)
        self._trace = False  # ... and for its trace (Request.trace; not for MTP requests)
        self._drafters: dict[str, tuple[Any, dict[str, Any]]] = {}  # drafter directory -> (model, GGUF info)
        self.has_ple = False
        self.gguf_info: dict[str, Any] = {}
        self._log_lines: deque[str] = deque(maxlen=60)
        self._log_cb = None

    # -- logging --------------------------------------------------------------------------------

    def _install_logger(self) -> None:
        L = self.L
        verbose = self.options["verbose"]
        lines = self._log_lines

        def cb(level, text, _user):
            try:
                msg = text.decode("utf-8", "replace") if text else ""
            except Exception:  # noqa: BLE001 - a log callback must never raise into C
                return
            if msg.strip():
                lines.append(msg.rstrip("\n"))
            if verbose or level == 4:  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(msg)
                sys.stderr.flush()

        self._log_cb = L.llama_log_callback(cb)
        L.llama_log_set(self._log_cb, ctypes.c_void_p(0))

    def _log_tail(self, n: int = 8) -> str:
        return " | ".join(list(self._log_lines)[-n:])

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        source = resolve_source(self.source_option)
        L = self.L = _import_llama_cpp(self.lib_kind, self.lib_dir)
        self._install_logger()
        L.llama_backend_init()
        self.ext = Ext(L)
        log = (lambda m: sys.stderr.write(m + "\n")) if self.options["verbose"] else None
        if model_dir.is_file() and is_gguf(model_dir):  # a GGUF file as the checkpoint: loaded as it is
            path, info, cfg = model_dir, {"gguf": str(model_dir), "given": True}, gguf_text_config(model_dir)
        else:
            path, info = convert_to_gguf(model_dir, source, self.options["outtype"], self.cache_dir, log=log)
            cfg = read_text_config(model_dir)
        mparams = L.llama_model_default_params()
        t0 = time.monotonic()
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise BackendError(f"llama-cpp backend: llama_model_load_from_file({path}) failed: {self._log_tail()}")
        self.model = model
        vocab = L.llama_model_get_vocab(model)
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self.n_embd = int(L.llama_model_n_embd(model))
        if cfg.get("vocab_size") is not None and self.n_vocab != cfg["vocab_size"]:
            self.close()
            raise BackendError(f"llama-cpp backend: the GGUF has {self.n_vocab} tokens, config vocab_size is "
                               f"{cfg['vocab_size']}")
        self.has_ple = bool(cfg.get("hidden_size_per_layer_input") or 0)
        self.gguf_info = {**info, "load_s": round(time.monotonic() - t0, 3)}
        self.library = {"lib": self.lib_kind, "libllama": loaded_library("libllama"),
                        "libggml-cpu": loaded_library("libggml-cpu"),
                        "llama_cpp_python": getattr(L, "__version__", None)}

    def close(self) -> None:
        if self.L is not None:
            for model, _ in self._drafters.values():
                self.L.llama_model_free(model)
        self._drafters = {}
        if self.model is not None and self.L is not None:
            self.L.llama_model_free(self.model)
        self.model = None

    def drafter_model(self, path: str | None):
        """The assistant checkpoint at ``path`` as a llama_model (converted to GGUF like the target; loaded
        once per directory)."""
        if not path:
            raise ValueError("llama-cpp backend: an mtp request needs the drafter's directory (request.drafter)")
        if path not in self._drafters:
            d = Path(path)
            check_assistant(d)
            gguf, info = convert_to_gguf(d, resolve_source(self.source_option), self.options["outtype"],
                                         self.cache_dir)
            model = self.L.llama_model_load_from_file(str(gguf).encode(), self.L.llama_model_default_params())
            if not model:
                raise BackendError(f"llama-cpp backend: llama_model_load_from_file({gguf}) failed for the drafter "
                                   f"{d}: {self._log_tail()}")
            self._drafters[path] = (model, {k: info.get(k) for k in ("key", "outtype", "cached")})
        return self._drafters[path][0]

    def drafter_info(self, path: str) -> dict[str, Any]:
        return {"dir": path, "gguf": self._drafters[path][1]}

    def run(self, request: Request) -> Response:
        if self.model is None:
            raise RuntimeError("llama-cpp backend: run() called before open()")
        handler = {"full": self._full, "last": self._last, "prefill": self._prefill, "multi": self._multi,
                   "mtp": lambda r: run_mtp(self, r)}[request.kind]
        self._hidden = bool(request.hidden)
        self._trace = bool(request.trace) and self.capabilities.traces and request.kind != "mtp"
        return handler(request)

    # -- context and batches --------------------------------------------------------------------

    def _new_context(self, n_seq_max: int, longest: int, n_batch: int, n_ubatch: int | None,
                     total: int | None = None, hidden: bool | None = None) -> _Ctx:
        """A context for one request: ``longest`` tokens per sequence, ``total`` over all sequences
        (a unified KV cache holds them all in one stream), batches of up to ``n_batch`` tokens; keeping the
        final-norm states when ``hidden`` (default: when the request asks for them), tracing when the request asks
        for a trace (``trace.Tracer`` as its ``cb_eval``; no callback otherwise)."""
        L = self.L
        o = self.options
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise ValueError(f"llama-cpp backend: sequence ids must lie in [0, {LLAMA_MAX_SEQ}), "
                             f"needs n_seq_max {n_seq_max}")
        n_ctx_seq = _pad(longest)
        p = L.llama_context_default_params()
        p.n_ctx = _pad(max(longest, total or 0)) if o["kv_unified"] else n_ctx_seq * n_seq_max
        p.n_batch = max(1, n_batch)
        p.n_ubatch = max(1, min(n_ubatch or n_batch, p.n_batch))
        p.n_seq_max = n_seq_max
        p.n_threads = p.n_threads_batch = o["threads"]
        p.type_k = p.type_v = KV_TYPES[o["kv_type"]]
        p.flash_attn_type = 1 if o["flash_attn"] else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        p.swa_full = o["swa_full"]
        p.kv_unified = o["kv_unified"]
        p.no_perf = True
        tracer = Tracer(L) if self._trace else None
        if tracer is not None:
            p.cb_eval = tracer.callback
        ctx = L.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError(f"llama-cpp backend: llama_init_from_model failed: {self._log_tail()}")
        c = _Ctx(self, ctx, hidden=self._hidden if hidden is None else hidden, tracer=tracer)
        c.type_kv = p.type_k
        c.info = {"n_ctx": int(L.llama_n_ctx(ctx)), "n_ctx_seq": int(L.llama_n_ctx_seq(ctx)),
                  "n_seq_max": int(L.llama_n_seq_max(ctx)), "n_batch": int(L.llama_n_batch(ctx)),
                  "n_ubatch": int(L.llama_n_ubatch(ctx))}
        return c

    def _executed(self, path: str, c: _Ctx, **extra) -> dict[str, Any]:
        o = self.options
        return {"path": path, "engine": "llama.cpp", "dtype": "float32", "kv_type": o["kv_type"],
                "flash_attn": o["flash_attn"], "swa_full": o["swa_full"], "kv_unified": o["kv_unified"],
                "threads": o["threads"], "library": self.library,
                "gguf": {k: self.gguf_info.get(k) for k in ("key", "outtype", "cached")},
                "fresh_state": True, "state": "a new llama_context (and KV cache) for this request",
                "context": c.info, "decode_calls": c.calls,
                **({"hidden": HIDDEN_SOURCE} if c.hidden is not None else {}),
                **({"trace": TRACE_SOURCE} if c.tracer is not None else {}), **extra}

    # -- request kinds --------------------------------------------------------------------------

    @staticmethod
    def _check_tokens(tokens: Sequence[int], what: str) -> None:
        if len(tokens) == 0:
            raise ValueError(f"llama-cpp backend: {what} has no tokens")

    def _full(self, request: Request) -> Response:
        T = len(request.tokens)
        self._check_tokens(request.tokens, "full request")
        with self._new_context(1, T + len(request.decode), T, None) as c:
            rows = c.decode_tokens(request.tokens, 0, 0, range(T))
            hidden, trace = c.take_hidden(), c.take_trace()
            state = c.seq_len(0)
            dec = c.decode_steps(0, request.decode, T)
            return Response(rows, dec, self._executed("full", c, rows=T, state_len_after_prefill=state,
                                                      decode_steps=len(request.decode)),
                            hidden=hidden, decode_hidden=c.take_hidden() if dec is not None else None,
                            trace=trace, decode_trace=c.take_trace() if dec is not None else None)

    def _last(self, request: Request) -> Response:
        T = len(request.tokens)
        self._check_tokens(request.tokens, "last request")
        if not 0 <= request.last_pos < T:
            raise ValueError(f"llama-cpp backend: last_pos {request.last_pos} is outside the {T} tokens of the call")
        seq = 0 if request.entry == "plain" or request.seq_id is None else int(request.seq_id)
        if seq < 0:
            raise ValueError(f"llama-cpp backend: seq_id must be >= 0, got {seq}")
        with self._new_context(seq + 1, T + len(request.decode), T, None) as c:
            if request.entry == "embeddings":
                if not self.options["embeddings"]:
                    raise ValueError("llama-cpp backend: entry 'embeddings' is not claimed (option embeddings=false)")
                if request.embeddings is None:
                    raise ValueError("llama-cpp backend: entry 'embeddings' without embeddings")
                emb = np.asarray(request.embeddings, dtype=np.float32)
                if emb.shape != (T, self.n_embd):
                    raise ValueError(f"llama-cpp backend: embeddings shape {emb.shape}, expected ({T}, {self.n_embd})")
                rows = c.decode_embeddings(emb, seq, 0, [request.last_pos])
            else:
                rows = c.decode_tokens(request.tokens, seq, 0, [request.last_pos])
            hidden, trace = c.take_hidden(), c.take_trace()
            state = c.seq_len(seq)
            dec = c.decode_steps(seq, request.decode, T)
            extra = {}
            if request.entry == "embeddings":
                extra["embeddings_input"] = "batch.embd only (no token ids)" + (
                    "; llama.cpp takes the per-layer embeddings of token 0 for every position" if self.has_ple else "")
            return Response(rows, dec, self._executed(
                "last", c, entry=request.entry, seq_id=seq, last_pos=request.last_pos, output_rows=[request.last_pos],
                state_len_after_prefill=state, decode_steps=len(request.decode), **extra),
                hidden=hidden, decode_hidden=c.take_hidden() if dec is not None else None,
                trace=trace, decode_trace=c.take_trace() if dec is not None else None)

    def _prefill(self, request: Request) -> Response:
        if not request.pieces:
            raise ValueError("llama-cpp backend: prefill request has no pieces")
        if request.ubatch is not None and request.ubatch < 1:
            raise ValueError(f"llama-cpp backend: ubatch must be >= 1, got {request.ubatch}")
        total = sum(len(p.tokens) for p in request.pieces)
        longest_piece = max(len(p.tokens) for p in request.pieces)
        out: list[np.ndarray] = []
        pieces_done = []
        with self._new_context(1, total + len(request.decode), longest_piece, request.ubatch) as c:
            pos = 0
            for i, piece in enumerate(request.pieces):
                T = len(piece.tokens)
                self._check_tokens(piece.tokens, f"piece {i}")
                rows = [int(r) for r in piece.rows]
                if any(not 0 <= r < T for r in rows) or any(b <= a for a, b in itertools.pairwise(rows)):
                    raise ValueError(f"llama-cpp backend: piece {i} rows {rows} must be increasing within [0, {T})")
                out.append(c.decode_tokens(piece.tokens, 0, pos, rows))
                ub = c.info["n_ubatch"]
                pieces_done.append({"tokens": T, "rows": rows, "pos0": pos,
                                    "ubatches": [min(ub, T - s) for s in range(0, T, ub)]})
                pos += T
            hidden, trace = c.take_hidden(), c.take_trace()
            state = c.seq_len(0)
            dec = c.decode_steps(0, request.decode, pos)
            logits = np.concatenate(out) if out else np.empty((0, self.n_vocab), dtype=np.float32)
            return Response(logits, dec, self._executed(
                "prefill", c, ubatch=request.ubatch, pieces=pieces_done,
                ubatches=[u for p in pieces_done for u in p["ubatches"]],
                state_len_after_prefill=state, decode_steps=len(request.decode)),
                hidden=hidden, decode_hidden=c.take_hidden() if dec is not None else None,
                trace=trace, decode_trace=c.take_trace() if dec is not None else None)

    def _multi(self, request: Request) -> Response:
        seq_ids, decode = check_multi(request, "llama-cpp backend")
        seq_ids = tuple(int(s) for s in seq_ids)
        if min(seq_ids) < 0:
            raise ValueError(f"llama-cpp backend: seq_ids must be >= 0, got {list(seq_ids)}")
        lens = [len(s) for s in request.sequences]
        longest = max(L_ + (len(decode[i]) if decode else 0) for i, L_ in enumerate(lens))
        total = sum(lens) + sum(len(d) for d in decode)
        with self._new_context(max(seq_ids) + 1, longest, sum(lens), None, total) as c:
            logits = c.decode_multi(request.sequences, seq_ids)
            hidden, trace = c.take_hidden(), c.take_trace()
            states = [c.seq_len(s) for s in seq_ids]
            decode_logits = decode_hidden = decode_trace = None
            if decode:
                decode_logits, decode_hidden, decode_trace = c.decode_multi_steps(seq_ids, decode, lens,
                                                                                  self.options["multi_decode"])
            return Response(logits, decode_logits, self._executed(
                "multi", c, seq_ids=list(seq_ids), one_batch=True, multi_decode=self.options["multi_decode"],
                state_len_after_prefill=states, decode_steps=[len(d) for d in decode] if decode else 0),
                hidden=hidden, decode_hidden=decode_hidden, trace=trace, decode_trace=decode_trace)


class _Ctx:
    """One llama_context for one request; freed on exit.

    ``hidden``: the context keeps every token's final-norm state (``llama_set_embeddings_nextn(ctx, true,
    false)``: ``t_h_nextn``, the LM head's input, with the graph unchanged; see ``ext``), and every batch
    collects the rows of its outputs beside their logits, for ``take_hidden``.

    ``tracer``: the ``trace.Tracer`` the context was made with (its ``cb_eval``); every batch then collects the
    trace of its outputs beside their logits, for ``take_trace``."""

    def __init__(self, engine: LlamaCppEngine, ctx, hidden: bool = False, tracer: Tracer | None = None):
        self.e = engine
        self.L = engine.L
        self.ctx = ctx
        self.calls: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        self.type_kv = KV_TYPES["f16"]  # the ggml type of its K and V cache (set by _new_context)
        self.hidden: list[np.ndarray] | None = [] if hidden else None
        self.tracer = tracer  # kept alive with the context: llama.cpp holds its callback
        self.traces: list[dict[str, np.ndarray]] | None = [] if tracer is not None else None
        if hidden:
            engine.ext.llama_set_embeddings_nextn(ctx, True, False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None

    def _decode(self, batch, n: int, n_out: int, seqs) -> None:
        rc = self.L.llama_decode(self.ctx, batch)
        self.calls.append({"tokens": n, "outputs": n_out, "seq_ids": sorted(set(seqs))})
        if rc != 0:
            what = {1: "no KV slot for the batch", 2: "aborted", -1: "invalid batch"}.get(rc, "error")
            raise RuntimeError(f"llama-cpp backend: llama_decode returned {rc} ({what}) on a batch of {n} tokens: "
                               f"{self.e._log_tail()}")

    def _rows(self, idx: Sequence[int]) -> np.ndarray:
        V = self.e.n_vocab
        out = np.empty((len(idx), V), dtype=np.float32)
        for k, i in enumerate(idx):
            ptr = self.L.llama_get_logits_ith(self.ctx, int(i))
            if not ptr:
                raise RuntimeError(f"llama-cpp backend: llama_get_logits_ith({i}) returned NULL: {self.e._log_tail()}")
            out[k] = np.ctypeslib.as_array(ptr, shape=(V,))
        if self.hidden is not None:
            self.hidden.append(self.hidden_rows(idx))
        if self.tracer is not None:
            self.traces.append(self.tracer.take(out))
        return out

    def hidden_rows(self, idx: Sequence[int]) -> np.ndarray:
        """The final-norm states [len(idx), H] of the last batch's tokens at batch indices ``idx``."""
        H = self.e.n_embd
        out = np.empty((len(idx), H), dtype=np.float32)
        for k, i in enumerate(idx):
            ptr = self.e.ext.llama_get_embeddings_nextn_ith(self.ctx, int(i))
            if not ptr:
                raise RuntimeError(f"llama-cpp backend: llama_get_embeddings_nextn_ith({i}) returned NULL: "
                                   f"{self.e._log_tail()}")
            out[k] = np.ctypeslib.as_array(ptr, shape=(H,))
        return out

    def take_hidden(self) -> np.ndarray | None:
        """The hidden rows collected since the last take, [rows, H] (None when the request asks none)."""
        if self.hidden is None:
            return None
        got, self.hidden[:] = self.hidden[:], []
        return np.concatenate(got) if got else np.empty((0, self.e.n_embd), dtype=np.float32)

    def take_trace(self) -> dict[str, np.ndarray] | None:
        """The trace of the rows collected since the last take, point -> [rows, ...] (None when not tracing)."""
        if self.traces is None:
            return None
        got, self.traces[:] = self.traces[:], []
        return trace_rows(got)

    def _batch(self, items: Sequence[tuple[int, int, int, bool]], embd: np.ndarray | None = None) -> np.ndarray:
        """Decode one batch of (token, pos, seq, output) items; returns the logits of the outputs in order."""
        L = self.L
        n = len(items)
        batch = L.llama_batch_init(n, 0 if embd is None else embd.shape[1], 1)
        try:
            for i, (tok, pos, seq, want) in enumerate(items):
                if embd is None:
                    batch.token[i] = int(tok)
                batch.pos[i] = int(pos)
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = int(seq)
                batch.logits[i] = 1 if want else 0
            if embd is not None:
                flat = np.ascontiguousarray(embd, dtype=np.float32).ravel()
                ctypes.memmove(batch.embd, flat.ctypes.data, flat.nbytes)
            batch.n_tokens = n
            outs = [i for i, it in enumerate(items) if it[3]]
            self._decode(batch, n, len(outs), [it[2] for it in items])
            return self._rows(outs)
        finally:
            L.llama_batch_free(batch)

    def decode_tokens(self, tokens: Sequence[int], seq: int, pos0: int, rows) -> np.ndarray:
        rows = {int(r) for r in rows}
        return self._batch([(int(t), pos0 + i, seq, i in rows) for i, t in enumerate(tokens)])

    def decode_embeddings(self, emb: np.ndarray, seq: int, pos0: int, rows) -> np.ndarray:
        rows = {int(r) for r in rows}
        return self._batch([(0, pos0 + i, seq, i in rows) for i in range(emb.shape[0])], embd=emb)

    def decode_steps(self, seq: int, tokens: Sequence[int], pos0: int) -> np.ndarray | None:
        if not tokens:
            return None
        return np.concatenate([self._batch([(int(t), pos0 + j, seq, True)]) for j, t in enumerate(tokens)])

    def decode_multi(self, sequences, seq_ids) -> np.ndarray:
        items = []
        for toks, s in zip(sequences, seq_ids, strict=True):
            items += [(int(t), i, s, i == len(toks) - 1) for i, t in enumerate(toks)]
        return self._batch(items)

    def decode_multi_steps(self, seq_ids, decode, lens, mode: str) -> tuple[list[np.ndarray], list[np.ndarray] | None,
                                                                            list[dict[str, np.ndarray]] | None]:
        """Each sequence's decode logits [len(decode[i]), V], its hidden rows when the context keeps them, and its
        trace when it traces."""
        V, H = self.e.n_vocab, self.e.n_embd
        out = [np.empty((len(d), V), dtype=np.float32) for d in decode]
        hid = None if self.hidden is None else [np.empty((len(d), H), dtype=np.float32) for d in decode]
        trc: list[list[dict[str, np.ndarray]]] | None = None if self.traces is None else [[] for _ in decode]
        for j in range(max(len(d) for d in decode)):
            live = [i for i, d in enumerate(decode) if j < len(d)]
            if mode == "batched":
                rows = self._batch([(int(decode[i][j]), lens[i] + j, seq_ids[i], True) for i in live])
                h, t = self.take_hidden(), self.take_trace()
                for k, i in enumerate(live):
                    out[i][j] = rows[k]
                    if hid is not None:
                        hid[i][j] = h[k]
                    if trc is not None:
                        trc[i].append({name: a[k:k + 1] for name, a in t.items()})
            else:
                for i in live:
                    out[i][j] = self._batch([(int(decode[i][j]), lens[i] + j, seq_ids[i], True)])[0]
                    if hid is not None:
                        hid[i][j] = self.take_hidden()[0]
                    if trc is not None:
                        trc[i].append(self.take_trace())
        return out, hid, None if trc is None else [trace_rows(t) for t in trc]

    def seq_len(self, seq: int) -> int:
        mem = self.L.llama_get_memory(self.ctx)
        return int(self.L.llama_memory_seq_pos_max(mem, seq)) + 1
