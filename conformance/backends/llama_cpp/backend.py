"""llama.cpp as a conformance backend (registered as ``llama-cpp``), isolated in a child process.

``LlamaCppBackend`` serves ``conformance.backends.llama_cpp.engine.LlamaCppEngine`` (which drives
llama-cpp-python's low-level C API: see that module for what each request does) through the
subprocess protocol::

    python -m conformance.serve \\
        --backend conformance.backends.llama_cpp.engine:LlamaCppEngine --backend-option KEY=VALUE ...

A failed ``GGML_ASSERT`` aborts the whole process (SIGABRT), e.g. llama.cpp's positional KV-sharing
rule on a checkpoint whose unshared-layer prefix does not end in ``[sliding, full]``
(``llama-kv-cache.cpp: GGML_ASSERT(map_layer_ids.find(il_reuse) != map_layer_ids.end())`` when the
context is created). In the child that is one case reported as an error (with the signal and the
engine's last stderr lines); the next case restarts the child and the run goes on.

Options: those of ``LlamaCppEngine`` (``kv_type``, ``lib``, ``threads``, ``flash_attn``, ``outtype``,
``source``, ``cache_dir``, ``swa_full``, ``kv_unified``, ``multi_decode``, ``embeddings``,
``default_profile``, ``verbose``), checked here before the child starts, ``backtrace`` (default
false: the child runs with ``GGML_NO_BACKTRACE=1`` so that a crash report quotes the ``GGML_ASSERT``
line rather than a gdb backtrace), plus the subprocess backend's ``timeout`` (600 s a request), ``startup_timeout``,
``open_timeout`` (default 7200 s: ``open`` converts the checkpoint to GGUF) and ``stderr_log``. ``lib`` becomes the
child's
``LLAMA_CPP_LIB_PATH`` (llama-cpp-python loads ``libllama.so`` from there at import): ``stock``
(the library inside the llama_cpp package), ``exact-gelu`` (``.cache/llama-cpp/exact-gelu/build/bin``
from ``scripts/build-llama-cpp.sh --exact-gelu``) or a directory. The child serves traces (capability ``traces``)
through the subprocess protocol like everything else.

``expectations_file`` is ``conformance/backends/llama_cpp/expectations/<name>.json`` when one ships for the
configuration (the CLI uses it when no ``--expectations`` is given). The three default configurations
pass every text case they claim, hidden-state rows included, and the MTP cases of the dense-head drafter
(``12b-assistant-mini``); their files declare the MTP cases of ``e2b-assistant-mini``, whose centroid head
llama.cpp's converter drops. ``embeddings=true`` ships ``llama-cpp-<config>-embd.json`` (also: Gemma 4's
graph takes no input embeddings together with the ids its per-layer inputs need).

    scripts/build-llama-cpp.sh --exact-gelu      # once: ~5 min wheel + ~2 min exact-GELU library
    conformance check --backend llama-cpp                                   # f16 KV, profile fp16-kv
    conformance check --backend llama-cpp --backend-option kv_type=f32      # fp16 GELU table: fp16-kv
    conformance check --backend llama-cpp --backend-option kv_type=f32 --backend-option lib=exact-gelu  # fp32
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ...protocol.types import BackendError
from ..subprocess.client import SubprocessBackend
from .library import BUILD_HINT, resolve_lib, resolve_source
from .options import check_options, config_name, default_profile_for, expectations_for

__all__ = ["ENGINE", "LlamaCppBackend"]

ENGINE = "conformance.backends.llama_cpp.engine:LlamaCppEngine"
PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding the conformance package


def _option_text(value: Any) -> str:
    """A value as conformance.serve's --backend-option parses it back (JSON number/bool, else string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class LlamaCppBackend(SubprocessBackend):
    """llama.cpp (llama-cpp-python 0.3.36) in a child process; see the module docstring."""

    def __init__(self, kv_type: str = "f16", lib: str = "stock", threads: int = 2, flash_attn: bool = False,
                 outtype: str = "f32", source: str | None = None, cache_dir: str | None = None,
                 swa_full: bool = True, kv_unified: bool = False, multi_decode: str = "interleaved",
                 embeddings: bool = False, default_profile: str | None = None, verbose: bool = False,
                 backtrace: bool = False, timeout: float = 600.0, startup_timeout: float = 120.0,
                 open_timeout: float = 7200.0, stderr_log: str | None = None):
        try:
            o = check_options(kv_type, lib, threads, flash_attn, outtype, swa_full, kv_unified, multi_decode,
                              embeddings, default_profile, verbose)
        except ValueError as e:
            raise BackendError(str(e)) from None
        lib_kind, lib_dir = resolve_lib(o["lib"])
        if lib_dir is None:
            raise BackendError(f"llama-cpp backend: llama-cpp-python is not installed; {BUILD_HINT}")
        # fail before starting a child when the converter is missing (open would fail in the child)
        source_dir = resolve_source(source)
        argv = [sys.executable, "-m", "conformance.serve", "--backend", ENGINE]
        engine_opts = {**o, "lib": str(lib_dir) if lib_kind == "custom" else lib_kind,
                       "source": str(source_dir), "cache_dir": cache_dir}
        for key, value in engine_opts.items():
            if value is not None:
                argv += ["--backend-option", f"{key}={_option_text(value)}"]
        env = {"LLAMA_CPP_LIB_PATH": str(lib_dir)}
        if backtrace is not True:
            # ggml_abort would otherwise attach gdb and print a backtrace of ~80 lines, which pushes
            # the GGML_ASSERT line out of the stderr tail the crash report quotes
            env["GGML_NO_BACKTRACE"] = "1"
        if "GEMMA4_CONFORMANCE_CACHE" in os.environ:
            env["GEMMA4_CONFORMANCE_CACHE"] = os.environ["GEMMA4_CONFORMANCE_CACHE"]
        # the child imports conformance from this checkout even when it is not installed
        pp = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = str(PACKAGE_ROOT) if not pp else str(PACKAGE_ROOT) + os.pathsep + pp
        self.options = o
        self.lib_kind, self.lib_dir = lib_kind, lib_dir
        name = config_name(o["kv_type"], lib_kind, o["flash_attn"], o["outtype"], o["swa_full"], o["kv_unified"],
                           o["embeddings"])
        self.expectations_file: Path | None = expectations_for(name)
        # open converts the checkpoint to GGUF: minutes for a real checkpoint, hence its own limit
        super().__init__(argv, name=name, timeout=timeout, env=env, startup_timeout=startup_timeout,
                         open_timeout=open_timeout,
                         stderr_log=stderr_log)
        want = o["default_profile"] or default_profile_for(o["kv_type"], lib_kind, o["outtype"], o["flash_attn"])
        if self.capabilities.default_profile != want:  # the child chose the same way; a mismatch is a bug
            raise BackendError(f"llama-cpp backend: the engine reports profile {self.capabilities.default_profile!r}, "
                               f"expected {want!r}")
