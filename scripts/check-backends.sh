#!/usr/bin/env bash
# Run `conformance check` on the bundled fixture sets for the real-engine backends, one report per
# configuration, and build the scoreboard from those reports.
#
# Usage: scripts/check-backends.sh [--llama-cpp] [--all] [--out DIR]
#
#   (default)     the CI set: refimpl-subprocess (the protocol's reference server), transformers
#                 float32 and float64, mlx-lm float32, mlx-vlm float32
#   --llama-cpp   also llama.cpp: stock build with its default f16 KV cache, stock with an f32 KV
#                 cache, and the exact-GELU build with an f32 KV cache (scripts/build-llama-cpp.sh
#                 --exact-gelu builds them)
#   --all         also every other dtype and attention of transformers and mlx-lm, mlx-vlm with
#                 the request's soft tokens (image_tower=off audio_tower=off), and (with
#                 --llama-cpp) llama.cpp's input embeddings (the scoreboard in docs/backends.md)
#   --out DIR     where the reports go (default .cache/reports)
#
# Every configuration runs even when an earlier one fails; the exit status is 1 if any check did
# not exit 0. Each configuration writes DIR/NAME.json, DIR/NAME.xml and DIR/NAME.log; the scoreboard
# goes to DIR/scoreboard.md.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFORMANCE="${CONFORMANCE:-conformance}"
OUT="$REPO/.cache/reports"
llama=0; all=0
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-cpp) llama=1 ;;
    --all) all=1 ;;
    --out) shift; OUT="${1:?--out needs a directory}" ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "check-backends.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
command -v "$CONFORMANCE" >/dev/null || { echo "check-backends.sh: no '$CONFORMANCE' on PATH (activate the venv)" >&2; exit 2; }

# name | backend | backend options (space separated KEY=VALUE). transformers runs with one torch
# thread: on these tiny models more threads only add synchronisation, and on a busy 2-core machine
# torch's default threads made a run about 20x slower (223 s instead of 12 s).
configs=(
  "refimpl-subprocess|refimpl-subprocess|"
  "transformers-float32-eager|transformers|dtype=float32 threads=1"
  "transformers-float64-eager|transformers|dtype=float64 threads=1"
  "mlx-lm-float32|mlx-lm|dtype=float32"
  "mlx-vlm-float32|mlx-vlm|dtype=float32"
)
if [ "$all" = 1 ]; then
  configs+=(
    "transformers-float32-sdpa|transformers|dtype=float32 attn=sdpa threads=1"
    "transformers-float64-sdpa|transformers|dtype=float64 attn=sdpa threads=1"
    "transformers-bfloat16-eager|transformers|dtype=bfloat16 threads=1"
    "transformers-bfloat16-sdpa|transformers|dtype=bfloat16 attn=sdpa threads=1"
    "mlx-lm-bfloat16|mlx-lm|dtype=bfloat16"
    "mlx-lm-float16|mlx-lm|dtype=float16"
    "mlx-vlm-float32-towers-off|mlx-vlm|dtype=float32 image_tower=off audio_tower=off"
  )
fi
if [ "$llama" = 1 ]; then
  configs+=(
    "llama-cpp-f16kv|llama-cpp|kv_type=f16"
    "llama-cpp-f32kv|llama-cpp|kv_type=f32"
    "llama-cpp-f32kv-exact-gelu|llama-cpp|kv_type=f32 lib=exact-gelu"
  )
  if [ "$all" = 1 ]; then
    configs+=("llama-cpp-f32kv-exact-gelu-embd|llama-cpp|kv_type=f32 lib=exact-gelu embeddings=true")
  fi
fi

mkdir -p "$OUT"
failed=()
for entry in "${configs[@]}"; do
  IFS='|' read -r name backend opts <<<"$entry"
  args=(check --backend "$backend" -q --json "$OUT/$name.json" --junit-xml "$OUT/$name.xml")
  for o in $opts; do args+=(--backend-option "$o"); done
  rm -f "$OUT/$name.json" "$OUT/$name.xml" "$OUT/$name.log"   # never publish an earlier run's report
  echo "== $name: $CONFORMANCE ${args[*]}"
  start=$(date +%s)
  "$CONFORMANCE" "${args[@]}" >"$OUT/$name.log" 2>&1
  code=$?
  tail -n 3 "$OUT/$name.log"
  echo "== $name: exit $code in $(( $(date +%s) - start )) s"
  [ "$code" = 0 ] || failed+=("$name (exit $code)")
done

reports=()
for entry in "${configs[@]}"; do
  name="${entry%%|*}"
  [ -f "$OUT/$name.json" ] && reports+=("$OUT/$name.json")
done
if [ "${#reports[@]}" -gt 0 ]; then
  "$CONFORMANCE" scoreboard "${reports[@]}" --out "$OUT/scoreboard.md" --title "Conformance scoreboard (bundled sets)"
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "check-backends.sh: failed: ${failed[*]}" >&2
  exit 1
fi
echo "check-backends.sh: every configuration passed"
