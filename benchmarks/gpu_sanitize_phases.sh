#!/usr/bin/env bash
# Where a plain unified campaign's sanitized examples spend their time (issue 52: vllm#56862 is found only by the
# sanitizer, and a 90 s campaign on an H200 spent 84-102 s in sanitized runs for 7-75 sanitized examples): for each
# seed, `kvfuzz fuzz --target TARGET --duration DURATIONs --seed S` with nothing else (plain defaults: --sanitize auto,
# MPS, its workers), then the sanitize stage by phase from its summary.json (benchmarks/sanitize_phases.py: a row per
# phase, a column per group of examples: the child's first example, a new kernel configuration, a seen one, skipped,
# a shrink's; each cell seconds/examples). One GPU (compute-sanitizer from /usr/local/cuda/bin); carry .device/.
# About DURATION + 60-180 s a seed (start-up, the shrink of a failure found: KVFUZZ_SHRINK_GRACE, default 120 s).
# Writes OUT/machine.txt, OUT/seed-S.log, OUT/seed-S/summary.json and report.md, OUT/phases.txt (what it prints).
# Usage: OUT=dir [TARGET=vllm.unified_attention] [DURATION=90] bash benchmarks/gpu_sanitize_phases.sh [SEED...]
set -uo pipefail
T=${TARGET:-vllm.unified_attention}
S=${DURATION:-90}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed" >&2; exit 1; }
gpu_out
export PATH=$PATH:/usr/local/cuda/bin
{ gpu_machine; command -v compute-sanitizer || echo "no compute-sanitizer: nothing is sanitized"; } | tee "$R/machine.txt"
[ "$#" -gt 0 ] || set -- 1
for seed in "$@"; do
  out="$R/seed-$seed"
  start=$(date +%s)
  timeout $((S + 400)) $KV fuzz --target "$T" --duration "${S}s" --seed "$seed" --out "$out" > "$out.log" 2>&1
  rc=$?
  echo "seed $seed: exit $rc, $(( $(date +%s) - start )) s; $(grep -m1 '^time: ' "$out.log" || echo '(no time line)')" \
    | tee -a "$R/phases.txt"
  python3 "$HERE/sanitize_phases.py" "$out/summary.json" | tee -a "$R/phases.txt"
  # what comes back from a device call is small: the summary, the report, each reproducer's case.json and the log
  rm -rf "$out/hypothesis-db" "$out/workers" "$out"/*/tensors.safetensors "$out"/*.png
done
