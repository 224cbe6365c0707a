#!/usr/bin/env bash
# Issue 21's cold rate against the examples per pinned chunk, on one lent GPU (no network; carry .device/ from
# `make device-bundle`): one cold `kvfuzz bench curve --cold-only` of TARGET per chunk size (kvfuzz fuzz
# --chunk-examples N, each with an empty Triton cache; kvfuzz fuzz's default workers, MPS included), nvidia-smi's
# utilization sampled each second through each. A pinned chunk pays its configuration's compiles once (the
# configurations of a campaign almost never repeat), so longer chunks spend less of the run compiling.
# Files under OUT: chunks-N.json (bench curve's JSON) per size, log.txt.
# Usage: OUT=dir [CHUNKS='200 1000 3000'] bash benchmarks/gpu_chunks.sh [TARGET] [SECONDS] [-- kvfuzz fuzz args]
set -uo pipefail
T=${1:-vllm.unified_attention}
S=${2:-120}
shift 2 2>/dev/null; [ "${1:-}" = "--" ] && shift
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
{
  gpu_machine
  for n in ${CHUNKS:-200 1000 3000}; do
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -l 1 > "$W/util-$n.txt" 2>/dev/null &
    SMI=$!
    echo "== --chunk-examples $n"
    $KV bench curve --target "$T" --duration "${S}s" --workers default --cold-only --dir "$W/c$n" \
      --json "$R/chunks-$n.json" -- --chunk-examples "$n" "$@" 2>&1 | grep -v '^JSON'
    kill $SMI 2>/dev/null
    python3 -c "import sys; u=[float(x) for x in open(sys.argv[1]).read().split()]; print('gpu util mean %.1f%% over %d s' % (sum(u)/max(1,len(u)), len(u)))" "$W/util-$n.txt"
    python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['targets'][0]; print('summary:', {k: t.get(k) for k in ('examples','examples_per_s','kernel_s','harness_s','elapsed_s')})" "$W/c$n/$T-wdefault-cold/summary.json" 2>&1
    rm -rf "$W/c$n"
  done
} > "$R/log.txt" 2>&1
tail -c 9000 "$R/log.txt"
