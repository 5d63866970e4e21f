#!/usr/bin/env bash
# mlx-lm on MLX quantised weights, graded two ways (issue 48): against the oracle of its own quantised weights
# (sets generated from the quantised directory, profile fp32) and against the unquantised oracle (the bundled
# e2b-mini set, the same weights quantised at open by mlx-lm's quantize_model, profiles q4 and q8).
#
# Usage: scripts/mlx-quantised-scoreboard.sh [--out DIR]   (default .cache/reports/mlx-quantised)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
OUT="$REPO/.cache/reports/mlx-quantised"
[ "${1:-}" = "--out" ] && OUT="${2:?--out needs a directory}"
mkdir -p "$OUT"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
conformance() { "$PY" -m conformance.cli "$@"; }

# the quantised directories and their sets: 4-bit g32 is the bundled set; 8-bit g64 and mlx-lm's mixed_3_6
"$PY" - "$work" <<'PYEOF'
import sys
from pathlib import Path
sys.path[:0] = ["tests"]
from mlx_convert import quantise
from refimpl.synth import write_checkpoint
work = Path(sys.argv[1])
src = write_checkpoint("e2b-mini", 0, work / "e2b-mini")
quantise(src, work / "q8-g64", 8, 64)
quantise(src, work / "mixed_3_6-g32", 3, 32, "mixed_3_6")
PYEOF
for q in q8-g64 mixed_3_6-g32; do
  conformance generate --model "$work/$q" --out "$work/set-$q" --name "e2b-mini-mlx-$q" --cases text --store logits -q
done

run() {  # name, then conformance check arguments
  local name="$1"; shift
  conformance check --backend mlx-lm -q --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? ($(tail -n 1 "$OUT/$name.log"))"
}
run own-q4-g32-fp32 --fixtures "$REPO/fixtures/e2b-mini-mlx-q4" --profile fp32
run own-q8-g64-fp32 --fixtures "$work/set-q8-g64" --profile fp32
run own-mixed_3_6-g32-fp32 --fixtures "$work/set-mixed_3_6-g32" --profile fp32
run unquantised-oracle-q4-g32-q4 --fixtures "$REPO/fixtures/e2b-mini" --backend-option quantize=4:32 --profile q4
run unquantised-oracle-q8-g64-q8 --fixtures "$REPO/fixtures/e2b-mini" --backend-option quantize=8:64 --profile q8
run unquantised-oracle-mixed_3_6-g32-q4 --fixtures "$REPO/fixtures/e2b-mini" --backend-option quantize=mixed_3_6:32 \
  --profile q4
conformance scoreboard "$OUT"/*.json --out "$OUT/scoreboard.md" --title "mlx-lm on MLX quantised weights (e2b-mini)"
echo "wrote $OUT/scoreboard.md"
