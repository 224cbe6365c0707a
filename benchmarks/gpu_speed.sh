#!/usr/bin/env bash
# Issue 21's measurement on one lent GPU (no network; carry .device/ from `make device-bundle`): `kvfuzz bench
# curve` of one target (a cold Triton cache, then the warm cache it left, same seed and workers: kvfuzz fuzz's
# defaults, MPS included), nvidia-smi's utilization sampled each second through both, a py-spy profile of one
# worker 20 s into the warm run, optionally (GPUREF_SECONDS) a warm run with every fp64 reference on the GPU, and
# benchmarks/gpu_profile.py's per-stage split (small and 1M-KV batches).
# Few files under OUT (a device call brings back a limited number): curve.json, util-{cold,warm}.txt,
# worker-warm.top.txt, profile.json, log.txt.
# Usage: OUT=dir [CURVE_MODES='warm warm-capped'] bash benchmarks/gpu_speed.sh [TARGET] [SECONDS] [-- kvfuzz fuzz args]
set -uo pipefail
T=${1:-vllm.unified_attention}
S=${2:-150}
shift 2 2>/dev/null; [ "${1:-}" = "--" ] && shift
MODES=${CURVE_MODES:-warm}  # the runs after the cold one: warm and/or warm-capped (kvfuzz bench curve --mode)
M=${MODES%% *}              # the one nvidia-smi's samples are split at and py-spy profiles
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
{
  gpu_machine
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -l 1 > "$W/util.txt" 2>/dev/null &
  SMI=$!
  (  # split the samples at the warm run's start, and py-spy one of its workers 20 s in
    while [ ! -d "$W/curve/$T-wdefault-$M" ]; do sleep 1; done
    wc -l < "$W/util.txt" > "$W/cold-lines"
    sleep 20
    cli=$(pgrep -f -- "--out $W/curve/$T-wdefault-$M" | head -1)
    w=$(pgrep -P "$cli" | tail -1)
    [ -n "$w" ] && /tmp/site/bin/py-spy record -p "$w" -d 20 -f raw -o "$W/warm.raw" --nonblocking
    python3 benchmarks/pyspy_top.py "$W/warm.raw" --top 70 > "$R/worker-warm.top.txt" 2>&1
  ) &
  $KV bench curve --target "$T" --duration "${S}s" --workers default --dir "$W/curve" --json "$R/curve.json" \
    $(for m in $MODES; do echo --mode "$m"; done) -- "$@"
  kill $SMI 2>/dev/null
  n=$(cat "$W/cold-lines" 2>/dev/null || echo 0)
  head -n "$n" "$W/util.txt" > "$R/util-cold.txt"; tail -n +"$((n + 1))" "$W/util.txt" > "$R/util-warm.txt"
  for m in cold warm; do
    python3 -c "import sys; u=[float(x) for x in open(sys.argv[1]).read().split()]; print(sys.argv[2], 'gpu util mean %.1f%% over %d s' % (sum(u)/max(1,len(u)), len(u)))" "$R/util-$m.txt" $m
  done
  tail -5 "$W/curve/$T-wdefault-$M.log"
  if [ -n "${GPUREF_SECONDS:-}" ]; then  # warm again, every fp64 reference on the GPU (KVFUZZ_GPU_REFERENCE_MIN_KV=0)
    KVFUZZ_GPU_REFERENCE_MIN_KV=0 timeout $((GPUREF_SECONDS + 90)) $KV fuzz --target "$T" --seed 0 \
      --duration "${GPUREF_SECONDS}s" --triton-cache "$W/curve/triton-$T-wdefault" --out "$W/gpuref" "$@" > /dev/null 2>&1
    python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['targets'][0]; print('gpu-reference warm:', {k: t.get(k) for k in ('examples','examples_per_s','kernel_s','harness_s','elapsed_s')})" "$W/gpuref/summary.json"
  fi
  [ "${PROFILE_EXAMPLES:-100}" = 0 ] || TRITON_CACHE_DIR="$W/curve/triton-$T-wdefault" timeout 240 \
    python3 benchmarks/gpu_profile.py --target "$T" --examples "${PROFILE_EXAMPLES:-100}" --configs 1 \
    --out "$R/profile.json" 2>&1 | cut -c1-600
  head -40 "$R/worker-warm.top.txt"
} > "$R/log.txt" 2>&1
cat "$R/log.txt" | tail -c 9000
