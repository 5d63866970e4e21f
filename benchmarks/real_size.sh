#!/usr/bin/env bash
# A fixture set at real size, end to end: the published E2B shapes at full depth (refimpl synth --preset e2b,
# 35 layers, 4.63 B parameters, bf16), `conformance generate` (the default text matrix, compact storage), then
# `conformance check` of that set with transformers in float32 at fp32 (every case) and with the oracle at
# exact-f64 (a -k subset: each case is a float64 forward of up to 1,032 tokens).
#
#   benchmarks/real_size.sh OUTDIR [WORKERS] [REFIMPL_K]
#
# Writes into OUTDIR: log.txt (every step timed), the set's manifest.json and cases.json, sizes.txt (the set's
# files) and the two JSON reports. Needs numpy, safetensors, sentencepiece, and torch + transformers for the
# second check (on a GPU when there is one). About 25 GB of disk under $REAL_SIZE_TMP (default: a new
# temporary directory) and 30 GB of memory with 4 workers. Exit status: that of the first failing step.
set -euo pipefail
out=${1:?usage: benchmarks/real_size.sh OUTDIR [WORKERS] [REFIMPL_K]}
workers=${2:-4}
refimpl_k=${3:-/full/|/chunks-}
py=${PYTHON:-python3}
preset=${REAL_SIZE_PRESET:-e2b}  # a miniature for a smoke test of this script
work=${REAL_SIZE_TMP:-$(mktemp -d)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME COMMAND...: run, timed, output to the log
    local name=$1; shift
    echo "== $name: $*" | tee -a "$out/log.txt"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$out/log.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/log.txt"
    return "$rc"
}

$py -c 'import os, numpy; print("cores", os.cpu_count(), "numpy", numpy.__version__)' | tee -a "$out/log.txt"
step synth $py -m refimpl.cli synth --preset "$preset" --out "$work/ckpt"
step generate $py -m conformance.cli generate --model "$work/ckpt" --cases text --out "$work/set" --workers "$workers"
cp "$work/set/manifest.json" "$work/set/cases.json" "$out/"
ls -l "$work/set" > "$out/sizes.txt"
step check-transformers $py -m conformance.cli check --backend transformers --backend-option dtype=float32 \
    --profile fp32 --fixtures "$work/set" --json "$out/transformers-float32.json"
step check-refimpl $py -m conformance.cli check --backend refimpl --fixtures "$work/set" -k "$refimpl_k" \
    --json "$out/refimpl.json"
