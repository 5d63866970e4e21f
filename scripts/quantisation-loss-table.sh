#!/usr/bin/env bash
# The quantisation loss on the same rows (issue 50; docs/quantised.md, "The quantisation loss"): the bundled
# e2b-mini (seed 0) quantised four ways, each set compared with the bundled unquantised set fixtures/e2b-mini by
# `conformance loss`, with the engine that runs that format: llama.cpp (stock library, its default f16 KV cache)
# on Q8_0, Q4_0 and Q4_K_M files made by its own converter and quantiser (tests/llama_quantize.py; sets generated
# under ggml-cpu/x86/f16-kv/gelu-table, the convention of that configuration), and mlx-lm float32 on the bundled
# MLX 4-bit set fixtures/e2b-mini-mlx-q4. Writes OUT/NAME.{json,md,png} and prints each console report.
#
# Usage: scripts/quantisation-loss-table.sh [--out DIR]   (default .cache/reports/quantisation-loss)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
OUT="$REPO/.cache/reports/quantisation-loss"
[ "${1:-}" = "--out" ] && OUT="${2:?--out needs a directory}"
mkdir -p "$OUT"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
conformance() { "$PY" -m conformance.cli "$@"; }
CONV=ggml-cpu/x86/f16-kv/gelu-table

"$PY" - "$work" <<'PYEOF'
import sys
from pathlib import Path
sys.path[:0] = ["tests"]
from llama_quantize import quantize
from conformance.backends.llama_cpp.convert import convert_to_gguf
from conformance.backends.llama_cpp.library import resolve_source
from refimpl.synth import write_checkpoint
work = Path(sys.argv[1])
f32, _ = convert_to_gguf(write_checkpoint("e2b-mini", 0, work / "e2b-mini"), resolve_source(None), "f32", work / "cache")
for ftype in ("Q8_0", "Q4_0", "Q4_K_M"):
    quantize(f32, work / f"e2b-mini-{ftype}.gguf", ftype)
PYEOF
status=0
for ftype in Q8_0 Q4_0 Q4_K_M; do
  low="$(echo "e2b-mini-$ftype" | tr 'A-Z_' 'a-z-')"
  conformance generate --model "$work/e2b-mini-$ftype.gguf" --out "$work/$low" --name "$low" --cases text \
    --activations "$CONV" -q || status=1
  echo "== $ftype"
  conformance loss --fixtures "$work/$low" --reference "$REPO/fixtures/e2b-mini" --backend llama-cpp -q \
    --json "$OUT/$ftype.json" --summary-md "$OUT/$ftype.md" --plot "$OUT/$ftype.png" || status=1
done
echo "== MLX 4-bit, group size 32"
conformance loss --fixtures "$REPO/fixtures/e2b-mini-mlx-q4" --reference "$REPO/fixtures/e2b-mini" --backend mlx-lm \
  --backend-option dtype=float32 -q --json "$OUT/mlx-q4.json" --summary-md "$OUT/mlx-q4.md" \
  --plot "$OUT/mlx-q4.png" || status=1
exit $status
