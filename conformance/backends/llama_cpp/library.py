"""Where llama.cpp comes from: the llama-cpp-python sources (the GGUF converter), the stock or exact-GELU
library built by scripts/build-llama-cpp.sh, and the library a process has loaded (docs/backends.md)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ...protocol.types import BackendError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"


REPO_ROOT = Path(__file__).resolve().parents[3]  # conformance/backends/llama_cpp/engine.py -> the checkout


DEFAULT_SOURCE = (REPO_ROOT / ".cache" / "llama-cpp" / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor"
                  / "llama.cpp")


EXACT_GELU_LIB = REPO_ROOT / ".cache" / "llama-cpp" / "exact-gelu" / "build" / "bin"


BUILD_HINT = "run scripts/build-llama-cpp.sh (add --exact-gelu for the exact-GELU library)"


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


def import_llama_cpp(lib_kind: str, lib_dir: Path | None):
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
