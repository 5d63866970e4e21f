#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 from the sdist (CPU only) and install it into the
# current Python environment; optionally build the exact-GELU libllama/libggml.
#
# Usage: scripts/build-llama-cpp.sh [--exact-gelu] [--exact-gelu-only] [--no-install]
#
#   (default)          download the sdist, extract it (vendor/llama.cpp holds the
#                      GGUF converter), build the wheel (~5 min on 2 cores, skipped
#                      if already built) and pip-install it with diskcache.
#   --exact-gelu       also build libllama/libggml with GGML_GELU_FP16 disabled into
#                      .cache/llama-cpp/exact-gelu/ (~2 min); use it with
#                      LLAMA_CPP_LIB_PATH=.cache/llama-cpp/exact-gelu/build/bin
#   --exact-gelu-only  only the exact-GELU build (needs the extracted sdist).
#   --no-install       build, but do not pip-install the wheel.
#
# Everything lives under .cache/llama-cpp/ of the repository (gitignored).
# Recipe and measured times: docs/backends.md (llama.cpp).
# Idempotent: each step is skipped when its output already exists.
set -euo pipefail

VERSION=0.3.36
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache/llama-cpp"
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
SRC="$CACHE/src"
SRCDIR="$SRC/llama_cpp_python-$VERSION"
WHEELS="$CACHE/wheels"
EXACT="$CACHE/exact-gelu"
PY="${PYTHON:-python}"

do_wheel=1; do_exact=0; do_install=1
for arg in "$@"; do
  case "$arg" in
    --exact-gelu) do_exact=1 ;;
    --exact-gelu-only) do_exact=1; do_wheel=0; do_install=0 ;;
    --no-install) do_install=0 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "build-llama-cpp.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

say() { echo "[build-llama-cpp $(date +%H:%M:%S)] $*"; }
die() { echo "[build-llama-cpp] ERROR: $*" >&2; exit 1; }

command -v "$PY" >/dev/null || die "no '$PY' on PATH (activate the venv or set PYTHON=)"
say "python: $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
mkdir -p "$CACHE" "$SRC" "$WHEELS"

# 1. sdist
if [ -f "$SDIST" ]; then
  say "sdist present: $SDIST"
else
  say "downloading sdist llama-cpp-python==$VERSION"
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
  [ -f "$SDIST" ] || die "pip download did not produce $SDIST"
fi

# 2. extracted source (keeps vendor/llama.cpp: the converter lives there)
if [ -f "$SRCDIR/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  say "source present: $SRCDIR"
else
  say "extracting to $SRC"
  rm -rf "$SRCDIR"
  tar -xzf "$SDIST" -C "$SRC"
  [ -f "$SRCDIR/vendor/llama.cpp/convert_hf_to_gguf.py" ] || die "converter missing after extraction: $SRCDIR/vendor/llama.cpp/convert_hf_to_gguf.py"
fi

# 3. wheel
WHEEL="$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ "$do_wheel" = 1 ]; then
  if [ -n "$WHEEL" ]; then
    say "wheel present: $WHEEL (delete it to rebuild)"
  else
    command -v cmake >/dev/null || die "cmake not found"
    say "building wheel (CPU, ~5 min on 2 cores)"
    t0=$(date +%s)
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
      "$PY" -m pip wheel --no-deps -v -w "$WHEELS" "$SDIST"
    WHEEL="$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    [ -n "$WHEEL" ] || die "wheel build produced no wheel in $WHEELS"
    say "wheel built in $(( $(date +%s) - t0 )) s: $WHEEL"
  fi
fi

# 4. install
if [ "$do_install" = 1 ]; then
  [ -n "$WHEEL" ] || die "no wheel to install in $WHEELS"
  # installed from this very wheel? (pip records the file URL in direct_url.json)
  origin="$("$PY" -c 'import importlib.metadata as m; d = m.distribution("llama-cpp-python"); print(d.version, d.read_text("direct_url.json") or "")' 2>/dev/null || true)"
  if [[ "$origin" == "$VERSION "*"$(basename "$WHEEL")"* ]]; then
    say "llama-cpp-python $VERSION already installed from $(basename "$WHEEL")"
  else
    say "installing $WHEEL"
    "$PY" -m pip install --no-deps --force-reinstall "$WHEEL"
  fi
  "$PY" -c 'import diskcache' 2>/dev/null || { say "installing diskcache"; "$PY" -m pip install diskcache; }
  "$PY" -c 'import llama_cpp; print("[build-llama-cpp] import ok: llama_cpp", llama_cpp.__version__)'
fi

# 5. exact-GELU libs
if [ "$do_exact" = 1 ]; then
  [ -d "$SRCDIR/vendor/llama.cpp" ] || die "missing $SRCDIR/vendor/llama.cpp (run without --exact-gelu-only first)"
  LIBDIR="$EXACT/build/bin"
  if ls "$LIBDIR"/libllama.so >/dev/null 2>&1 && ls "$LIBDIR"/libggml-cpu.so >/dev/null 2>&1; then
    say "exact-GELU libs present: $LIBDIR"
  else
    command -v cmake >/dev/null || die "cmake not found (needed for the exact-GELU build)"
    GENERATOR=()
    if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
    say "building exact-GELU libllama/libggml in $EXACT (~2 min)"
    t0=$(date +%s)
    rm -rf "$EXACT"
    cp -r "$SRCDIR/vendor/llama.cpp" "$EXACT"
    VEC="$EXACT/ggml/src/ggml-cpu/vec.h"
    grep -q '^#define GGML_GELU_FP16$' "$VEC" || die "'#define GGML_GELU_FP16' not found in $VEC"
    sed -i 's/^#define GGML_GELU_FP16$/\/\/ #define GGML_GELU_FP16 (disabled by build-llama-cpp.sh --exact-gelu)/' "$VEC"
    ! grep -q '^#define GGML_GELU_FP16$' "$VEC" || die "failed to disable GGML_GELU_FP16"
    cmake -S "$EXACT" -B "$EXACT/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
      -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF
    cmake --build "$EXACT/build" -j"${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target llama ggml-cpu
    ls "$LIBDIR"/libllama.so >/dev/null 2>&1 || die "no libllama.so in $LIBDIR"
    say "exact-GELU libs built in $(( $(date +%s) - t0 )) s: $LIBDIR"
  fi
  echo "[build-llama-cpp] use: LLAMA_CPP_LIB_PATH=$LIBDIR"
fi
say "done"
