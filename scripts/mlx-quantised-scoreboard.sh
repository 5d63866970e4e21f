#!/usr/bin/env bash
# mlx-lm and mlx-vlm on MLX quantised weights, graded two ways (issue 48): against the oracle of their own
# quantised weights (sets generated from the quantised directory, profile fp32) and against the unquantised
# oracle (the bundled e2b-mini / e2b-vision-mini / e2b-audio-mini sets, the same weights quantised at open by the
# engine's own quantiser, profiles q4 and q8). mlx-vlm's directories are made as mlx_vlm.convert -q makes them
# (tests/mlx_convert.py: the towers unquantised, its mixed recipes at group size 64 only).
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
from mlx_convert import quantise, quantise_vlm
from refimpl.synth import write_checkpoint
work = Path(sys.argv[1])
src = write_checkpoint("e2b-mini", 0, work / "e2b-mini")
quantise(src, work / "q8-g64", 8, 64)
quantise(src, work / "mixed_3_6-g32", 3, 32, "mixed_3_6")
vision = write_checkpoint("e2b-vision-mini", 0, work / "e2b-vision-mini")
audio = write_checkpoint("e2b-audio-mini", 0, work / "e2b-audio-mini")
quantise_vlm(vision, work / "vision-q4-g32", 4, 32)
quantise_vlm(audio, work / "audio-q8-g64", 8, 64)
quantise_vlm(vision, work / "vision-mixed_3_6-g64", 3, 64, "mixed_3_6")
PYEOF
for q in vision-q4-g32 audio-q8-g64 vision-mixed_3_6-g64; do
  conformance generate --model "$work/$q" --out "$work/set-$q" --name "e2b-mlx-vlm-$q" --store logits -q
done
for q in q8-g64 mixed_3_6-g32; do
  conformance generate --model "$work/$q" --out "$work/set-$q" --name "e2b-mini-mlx-$q" --cases text --store logits -q
done

run() {  # backend, name, then conformance check arguments
  local backend="$1" name="$2"; shift 2
  conformance check --backend "$backend" -q --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? ($(tail -n 1 "$OUT/$name.log"))"
}
run mlx-lm own-q4-g32-fp32 --fixtures "$REPO/fixtures/e2b-mini-mlx-q4" --profile fp32
run mlx-lm own-q8-g64-fp32 --fixtures "$work/set-q8-g64" --profile fp32
run mlx-lm own-mixed_3_6-g32-fp32 --fixtures "$work/set-mixed_3_6-g32" --profile fp32
run mlx-lm unquantised-oracle-q4-g32-q4 --fixtures "$REPO/fixtures/e2b-mini" --backend-option quantize=4:32 --profile q4
run mlx-lm unquantised-oracle-q8-g64-q8 --fixtures "$REPO/fixtures/e2b-mini" --backend-option quantize=8:64 --profile q8
run mlx-lm unquantised-oracle-mixed_3_6-g32-q4 --fixtures "$REPO/fixtures/e2b-mini" --backend-option quantize=mixed_3_6:32 \
  --profile q4
run mlx-vlm vlm-own-vision-q4-g32-fp32 --fixtures "$work/set-vision-q4-g32" --profile fp32
run mlx-vlm vlm-own-audio-q8-g64-fp32 --fixtures "$work/set-audio-q8-g64" --profile fp32
run mlx-vlm vlm-own-vision-mixed_3_6-g64-fp32 --fixtures "$work/set-vision-mixed_3_6-g64" --profile fp32
run mlx-vlm vlm-unquantised-oracle-vision-q4-g32-q4 --fixtures "$REPO/fixtures/e2b-vision-mini" \
  --backend-option quantize=4:32 --profile q4
run mlx-vlm vlm-unquantised-oracle-audio-q8-g64-q8 --fixtures "$REPO/fixtures/e2b-audio-mini" \
  --backend-option quantize=8:64 --profile q8
run mlx-vlm vlm-unquantised-oracle-vision-mixed_3_6-g64-q4 --fixtures "$REPO/fixtures/e2b-vision-mini" \
  --backend-option quantize=mixed_3_6:64 --profile q4
conformance scoreboard "$OUT"/*.json --out "$OUT/scoreboard.md" \
  --title "mlx-lm and mlx-vlm on MLX quantised weights (e2b-mini, e2b-vision-mini, e2b-audio-mini)"
echo "wrote $OUT/scoreboard.md"
