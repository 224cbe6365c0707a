#!/usr/bin/env bash
# Issue 31's question for the default GPU campaign: does a plain `kvfuzz fuzz` (no --big-cache, no --tier: the
# default size-tier mix on CUDA) find the re-injected bugs that the default CPU campaign misses? vllm#47671 (int32
# page offsets: needs the big-cache tier) on seeds 0 and 1, vllm#30887 on seed 0; 55 s each, --max-crashes 1.
# Carry .device/ (`make device-bundle`). Writes OUT/<bug>-<seed>.log and .summary.txt.
# Usage: OUT=dir bash benchmarks/gpu_bugs_default.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
for b in "vllm-47671 0" "vllm-47671 1" "vllm-30887 0"; do
  set -- $b
  timeout 95 $KV fuzz --target "kvfuzz.fuzz.bench.bugs:Bug_${1//-/_}" --seed "$2" --duration 55s \
    --out "/tmp/b-$1-$2" --max-crashes 1 > "$OUT/$1-$2.log" 2>&1
  echo "$1 seed $2: exit $?"
  python3 -c "
import json,sys
t=json.load(open('/tmp/b-$1-$2/summary.json'))['targets'][0]
print({k:t.get(k) for k in ('examples','elapsed_s','first_failure_s','first_failure_examples')}, t['coverage'].get('tier'))
for f in t['failures']: print(' ', f['kind'], f['blame'], f['check'], '|', f['batch'][:300])
" 2>&1 | tee "$OUT/$1-$2.summary.txt"
done
