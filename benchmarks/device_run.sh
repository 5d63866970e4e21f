#!/bin/bash
# The GPU measurements of issues 53 and 54 in one device call (the device machine: one H100/H200, 16 cores, CuPy,
# torch; run from the repository root there, with OUT set to the folder whose files come back):
#
#   benchmarks/device_run.sh kernels   the fused-kernel tests, fused_kernels.py and a profile on the E2B 10-layer cut
#   benchmarks/device_run.sh prefill   benchmarks/prefill.py --device cuda on E2B at full depth, last row and all rows
#   benchmarks/device_run.sh generate  generate --device cuda of the real-size E2B text set, timed, then checked by
#                                      the CPU oracle at exact-f64 on a -k subset
#   benchmarks/device_run.sh families e4b:full 31b:4 ...
#                                      each published shape cut to that many layers (full: every layer): synth,
#                                      generate --device cuda
#                                      (timed, peak GPU memory by nvidia-smi), one JSON line each in families.jsonl;
#                                      BUDGET_S (default 330): start no cut after that many seconds; SYNTH_S, GEN_S
#                                      (default 280, 300): the synthesiser's and generate's limits per cut; a cut
#                                      whose generate did not finish keeps its checkpoint, and the same spec in a
#                                      later call on the machine resumes from the bases it finished; one whose
#                                      synth did not finish is recorded (generate_s null) and skipped; each step
#                                      stops at most at CALL_S (default 590) from the start, so the records are
#                                      written inside the device's per-call limit; CKPT_ROOT (default /tmp): where
#                                      the checkpoints go (/dev/shm: in memory, where the disk writes slowly;
#                                      auto: /dev/shm when it holds the cut or has room with memory to spare)
#   benchmarks/device_run.sh rerun     generate --device cuda of the real-size E2B text set twice (first, cached)
#   benchmarks/device_run.sh summaries benchmarks/summaries.py on 1,032 rows (a real-size base) on its cores
#   benchmarks/device_run.sh synth [PRESET [LAYERS]]
#                                      benchmarks/synth_writer.py (the synthesiser's writer before and now, side by
#                                      side) on its cores, default the 12B cut to 8 layers
#   benchmarks/device_run.sh profile [PRESET:LAYERS]
#                                      generate --device cuda under cProfile (default e2b:full): the stages' log and
#                                      the costliest functions in $OUT
#   benchmarks/device_run.sh transformers [K]
#                                      check --backend transformers --backend-option device=cuda on the GPU-made
#                                      E2B set, -k K (default last/plain)
#
# transformers 5.24.0 (what --transformers exact patches) is installed from a wheel carried in .whl/ when there is
# one (python3 -m pip download -q transformers==5.24.0 --no-deps -d .whl on this side; carry .whl). Each step has a
# time limit so that the call ends inside the device's per-call limit; the logs and JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
fi
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
CONF='import sys; from conformance.cli import main; sys.argv[0] = "conformance"; sys.exit(main())'
# the backend by its object: the checkout runs from PYTHONPATH, not installed, so its entry points are not registered
TRANSFORMERS=conformance.backends.transformers.backend:TransformersBackend
limit() {  # limit S: S seconds, or what is left of the call's CALL_S (default 590) less 10 s for the records
  local left=$(( ${CALL_S:-590} - (SECONDS - t0) - 10 ))
  [ "$left" -lt 1 ] && left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
ckpt_root() {  # ckpt_root PRESET LAYERS: CKPT_ROOT, or with CKPT_ROOT=auto /dev/shm where it already holds the cut
  # or has room for its bf16 (+4 GiB) with 24 GiB of memory left beside it, else /tmp
  local root=${CKPT_ROOT:-/tmp}
  [ "$root" = auto ] || { echo "$root"; return; }
  [ -f "/dev/shm/ckpt-$1-$2/config.json" ] && { echo /dev/shm; return; }
  local need shm mem
  need=$(python3 -c "import sys; from refimpl.synth import published_config as c, published_parameters as n
print(int(n(c(sys.argv[1], 0, None if sys.argv[2] == 'full' else int(sys.argv[2]))) * 2 / 2**30) + 4)" "$1" "$2" 2>/dev/null)
  shm=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
  mem=$(awk '/MemAvailable/ {print int($2 / 2^20)}' /proc/meminfo)
  if [ "${need:-999}" -le "${shm:-0}" ] && [ $((mem - need)) -ge 24 ]; then echo /dev/shm; else echo /tmp; fi
}
synth() {  # synth PRESET_ARGS DIR: a synthetic checkpoint, once per machine
  [ -f "$2/model.safetensors" ] || timeout 200 python3 -m refimpl synth --preset e2b $1 --out "$2" > /dev/null
}
t0=$SECONDS
mode=${1:-}
case "$mode" in
  kernels)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/oracle/test_cupy.py -k "fused or op_on_cupy" \
      > "$OUT/cupy-fused.log" 2>&1; tail -3 "$OUT/cupy-fused.log"
    synth "--layers 10" /tmp/e2b10
    timeout 120 python3 benchmarks/fused_kernels.py --model /tmp/e2b10 --json "$OUT/fused-e2b10.json" 2>&1 | tail -6
    timeout 60 python3 benchmarks/profile_forward.py --model /tmp/e2b10 --weight-cache all --device cuda --top 45 \
      > "$OUT/profile-e2b10.txt" 2>&1; head -20 "$OUT/profile-e2b10.txt" ;;
  prefill)
    synth "" /tmp/e2b
    for rows in last all; do
      timeout 240 python3 benchmarks/prefill.py --model /tmp/e2b --rows $rows --device cuda \
        --json "$OUT/e2b-$rows-cuda.json" 2>&1 | tail -9
    done ;;
  generate)
    synth "" /tmp/e2b
    rm -rf /tmp/sets; s=$SECONDS
    timeout 300 python3 -c "$CONF" generate --model /tmp/e2b --out /tmp/sets/e2b-gpu --cases text --device cuda 2>&1 \
      | tee "$OUT/generate-e2b-cuda.log" | tail -4
    echo "generate: $((SECONDS - s)) s, $(du -sh /tmp/sets/e2b-gpu | cut -f1)"
    timeout 200 python3 -c "$CONF" check --backend conformance.backends.refimpl_backend:RefimplBackend \
      --fixtures /tmp/sets/e2b-gpu --model /tmp/e2b --profile exact-f64 -k 'last/plain/A' \
      --json "$OUT/check-gpu-set-on-cpu.json" 2>&1 | tail -3 ;;
  families)  # families PRESET:LAYERS ...: synth each cut, generate its text set on the GPU, timed, peak GPU memory
    shift
    for spec in "$@"; do
      preset=${spec%%:*}; layers=${spec##*:}; root=$(ckpt_root "$preset" "$layers"); dir=$root/ckpt-$preset-$layers
      set_dir=/tmp/sets/$preset-$layers
      if [ $((SECONDS - t0)) -gt ${BUDGET_S:-330} ]; then echo "skipped $spec: the call's time is spent"; continue; fi
      cut="--layers $layers"; jl=$layers; [ "$layers" = full ] && { cut=""; jl='"full"'; }
      s=$SECONDS
      df -h "$root" /dev/shm | tail -n +2  # the free space, and whether CKPT_ROOT=/dev/shm could hold the cut
      lim=$(limit "${SYNTH_S:-280}")
      [ -f "$dir/config.json" ] || timeout "$lim" python3 -m refimpl synth --preset "$preset" $cut --out "$dir" > /dev/null
      synth_s=$((SECONDS - s))
      if [ ! -f "$dir/config.json" ]; then  # synth ran out of its limit (it removes its partial checkpoint on SIGTERM; this, after a harder end)
        rm -rf "$root"/.ckpt-$preset-$layers.*
        echo "{\"preset\": \"$preset\", \"layers\": $jl, \"synth_s\": $synth_s, \"generate_s\": null, \"exit\": null, \"note\": \"synth did not finish within its $lim s\"}" \
          | tee -a "$OUT/families.jsonl"
        continue
      fi
      rm -rf "$set_dir"; s=$SECONDS
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/smi-$preset-$layers.log" &
      smi=$!
      timeout "$(limit "${GEN_S:-300}")" python3 -c "$CONF" generate --model "$dir" --out "$set_dir" --cases text \
        --device cuda 2>&1 | tee "$OUT/generate-$preset-$layers-cuda.log" | tail -3
      rc=${PIPESTATUS[0]}; gen_s=$((SECONDS - s)); kill $smi 2>/dev/null
      peak=$(sort -n "$OUT/smi-$preset-$layers.log" | tail -1)
      echo "{\"preset\": \"$preset\", \"layers\": $jl, \"synth_s\": $synth_s, \"generate_s\": $gen_s, \"exit\": $rc, \"weight_cache\": \"${REFIMPL_WEIGHT_CACHE:-auto}\", \"peak_gpu_mib\": ${peak:-null}, \"checkpoint\": \"$(du -sh "$dir" | cut -f1)\", \"set\": \"$(du -sh "$set_dir" 2>/dev/null | cut -f1)\"}" \
        | tee -a "$OUT/families.jsonl"
      if [ "$rc" = 0 ]; then rm -rf "$dir"; else echo "kept $dir: the same spec again resumes from its finished bases"; fi
    done ;;
  rerun)  # generate --device cuda of the real-size E2B text set twice: a first run on this machine (the checkpoint
           # hashed, CuPy's kernels compiled) and a second (both cached), each timed end to end
    synth "" /tmp/e2b
    for run in $(seq 1 "${RUNS:-2}"); do
      rm -rf /tmp/sets/e2b-gpu; s=$SECONDS
      timeout 300 python3 -c "$CONF" generate --model /tmp/e2b --out /tmp/sets/e2b-gpu --cases text --device cuda \
        > "$OUT/generate-e2b-cuda-run$run.log" 2>&1
      echo "generate run $run: exit $?, $((SECONDS - s)) s, $(du -sh /tmp/sets/e2b-gpu | cut -f1)"
    done ;;
  synth)  # synth [PRESET [LAYERS]]: benchmarks/synth_writer.py on the machine's cores (default 12b, 8 layers)
    timeout 400 python3 benchmarks/synth_writer.py --preset "${2:-12b}" --layers "${3:-8}" --dir /tmp/synth-bench \
      --json "$OUT/synth-writer.json" ;;
  summaries)  # benchmarks/summaries.py on the machine's cores (1,032 rows: a real-size base)
    timeout 200 python3 benchmarks/summaries.py --rows 1032 --repeat 2 --json "$OUT/summaries-device.json" ;;
  profile)  # profile [PRESET:LAYERS]: generate --device cuda of that set under cProfile (default e2b:full), the
             # stages' log and the 45 costliest functions by cumulative and by own time
    spec=${2:-e2b:full}; preset=${spec%%:*}; layers=${spec##*:}; dir=/tmp/ckpt-$preset-$layers
    cut="--layers $layers"; [ "$layers" = full ] && cut=""
    [ -f "$dir/config.json" ] || timeout 280 python3 -m refimpl synth --preset "$preset" $cut --out "$dir" > /dev/null
    rm -rf /tmp/sets/prof; s=$SECONDS
    timeout 300 python3 -m cProfile -o "$OUT/generate-$preset-$layers.prof" -m conformance.cli generate --model "$dir" \
      --out /tmp/sets/prof --cases text --device cuda > "$OUT/generate-$preset-$layers-profile.log" 2>&1
    echo "generate under cProfile: $((SECONDS - s)) s"; tail -3 "$OUT/generate-$preset-$layers-profile.log"
    python3 -c "import pstats, sys; p = pstats.Stats(sys.argv[1]); p.sort_stats('cumulative').print_stats(45); \
p.sort_stats('tottime').print_stats(45)" "$OUT/generate-$preset-$layers.prof" > "$OUT/profile-$preset-$layers.txt"
    ;;
  transformers)  # transformers on the GPU, float32, on a -k subset of the GPU-made E2B set (generate first)
    synth "" /tmp/e2b
    [ -f /tmp/sets/e2b-gpu/manifest.json ] || timeout 300 python3 -c "$CONF" generate --model /tmp/e2b \
      --out /tmp/sets/e2b-gpu --cases text --device cuda > "$OUT/generate-e2b-cuda.log" 2>&1
    timeout 300 python3 -c "$CONF" check --backend "$TRANSFORMERS" --backend-option device=cuda --fixtures \
      /tmp/sets/e2b-gpu --model /tmp/e2b -k "${2:-last/plain}" --json "$OUT/check-transformers-cuda.json" 2>&1 \
      | tee "$OUT/check-transformers-cuda.log" | tail -6 ;;
  *) echo "usage: benchmarks/device_run.sh kernels|prefill|generate|families PRESET:LAYERS...|rerun|summaries|synth [PRESET [LAYERS]]|profile [PRESET:LAYERS]|transformers [-k]" >&2
     exit 2 ;;
esac
echo "device_run.sh $mode: $((SECONDS - t0)) s"
