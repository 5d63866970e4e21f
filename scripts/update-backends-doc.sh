#!/usr/bin/env bash
# Rebuild the scoreboard of docs/backends.md from the reports of
#   make check-backends CHECK_ARGS="--all --llama-cpp"      (.cache/reports/*.json)
# and the CUDA runs of the transformers backend copied to .cache/reports/cuda/*.json.
set -euo pipefail
R="${1:-.cache/reports}"
reports=("$R/refimpl-subprocess.json")
for c in float32-eager float32-sdpa float64-eager float64-sdpa bfloat16-eager bfloat16-sdpa; do
  reports+=("$R/transformers-$c.json")
done
for c in float32-eager float32-sdpa float64-eager float64-sdpa bfloat16-eager bfloat16-sdpa; do
  [ -f "$R/cuda/transformers-$c-cuda.json" ] && reports+=("$R/cuda/transformers-$c-cuda.json")
done
reports+=("$R/mlx-lm-float32.json" "$R/mlx-lm-bfloat16.json" "$R/mlx-lm-float16.json")
reports+=("$R/mlx-vlm-float32.json" "$R/mlx-vlm-float32-towers-off.json")
reports+=("$R/llama-cpp-f16kv.json" "$R/llama-cpp-f32kv.json" "$R/llama-cpp-f32kv-exact-gelu.json"
          "$R/llama-cpp-f32kv-exact-gelu-embd.json")
conformance scoreboard "${reports[@]}" --into docs/backends.md --title "Scoreboard: every configuration on the bundled sets"
