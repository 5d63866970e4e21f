#!/usr/bin/env bash
# llama.cpp on its own quantised GGUF files, graded two ways (issue 49): against the oracle of the same file under
# ggml's CPU activation convention (sets generated with --activations ggml-cpu/x86, or ggml-cpu/x86/f16-kv for the
# f16 KV cache; profile ggml-cpu) and against the oracle of the same file without it (the dequantised weights
# times the activations as they are; profiles q8 / q4). The files: e2b-mini and e2b-256-mini (seed 0) converted
# to f32 by llama.cpp's own converter and quantised by its own quantiser (tests/llama_quantize.py) to Q8_0, Q4_0
# and Q4_K_M. llama.cpp runs the exact-GELU library (make llama-cpp).
#
# Usage: scripts/gguf-quantised-scoreboard.sh [--out DIR]   (default .cache/reports/gguf-quantised)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
OUT="$REPO/.cache/reports/gguf-quantised"
[ "${1:-}" = "--out" ] && OUT="${2:?--out needs a directory}"
mkdir -p "$OUT"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
conformance() { "$PY" -m conformance.cli "$@"; }

"$PY" - "$work" <<'PYEOF'
import sys
from pathlib import Path
sys.path[:0] = ["tests"]
from llama_quantize import quantize
from conformance.backends.llama_cpp.convert import convert_to_gguf
from conformance.backends.llama_cpp.library import resolve_source
from refimpl.synth import write_checkpoint
work = Path(sys.argv[1])
for preset in ("e2b-mini", "e2b-256-mini"):
    f32, _ = convert_to_gguf(write_checkpoint(preset, 0, work / preset), resolve_source(None), "f32", work / "cache")
    for ftype in ("Q8_0", "Q4_0", "Q4_K_M"):
        quantize(f32, work / f"{preset}-{ftype}.gguf", ftype)
PYEOF
for gguf in "$work"/*.gguf; do
  stem="$(basename "$gguf" .gguf)"; low="$(echo "$stem" | tr 'A-Z_' 'a-z-')"
  for conv in ggml-cpu/x86 ggml-cpu/x86/f16-kv none; do
    tag="$(echo "$conv" | tr / -)"
    conformance generate --model "$gguf" --out "$work/set-$stem-$tag" --name "$low-$tag" --cases text --store logits \
      --activations "$conv" -q
  done
done

run() {  # name, then conformance check arguments
  local name="$1"; shift
  conformance check --backend llama-cpp --backend-option lib=exact-gelu -q --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? ($(tail -n 1 "$OUT/$name.log"))"
}
for gguf in "$work"/*.gguf; do
  stem="$(basename "$gguf" .gguf)"
  case "$stem" in *Q8_0) plain=q8 ;; *) plain=q4 ;; esac
  run "$stem-f32kv-own" --backend-option kv_type=f32 --fixtures "$work/set-$stem-ggml-cpu-x86" --profile ggml-cpu
  run "$stem-f16kv-own" --backend-option kv_type=f16 --fixtures "$work/set-$stem-ggml-cpu-x86-f16-kv" \
    --profile ggml-cpu
  run "$stem-f32kv-plain" --backend-option kv_type=f32 --fixtures "$work/set-$stem-none" --profile "$plain"
  run "$stem-f16kv-plain" --backend-option kv_type=f16 --fixtures "$work/set-$stem-none" --profile "$plain"
done
conformance scoreboard "$OUT"/*.json --out "$OUT/scoreboard.md" \
  --title "llama.cpp on its own quantised GGUF files (e2b-mini, e2b-256-mini)"
echo "wrote $OUT/scoreboard.md"
