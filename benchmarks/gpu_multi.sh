#!/usr/bin/env bash
# Issue 21's multi-GPU goal: the same command (`kvfuzz bench curve --cold-only --workers default`, i.e. kvfuzz
# fuzz's defaults: workers spread over the visible GPUs with CUDA_VISIBLE_DEVICES, one MPS daemon) on one GPU of a
# host (CUDA_VISIBLE_DEVICES=0) and then on all of them, each from an empty Triton cache, with each GPU's
# nvidia-smi utilization sampled every second. No network on the lent GPUs: carry .device/ (`make device-bundle`).
# WARM="DEVICES:WORKERS ..." (e.g. "0:14 0,1:28 0:28") then separates the GPUs from the CPU cores: a cold campaign
# on all GPUs fills one Triton cache, and each entry runs a warm `kvfuzz fuzz` on it for SECONDS, capped at the
# cold run's example count (the configurations it compiled), printing examples, examples/s and its steady rate
# (status.json sampled each second, from the 10th second to the first with the final count) and its rate from the
# first second with a counted example to that one (worker start-up left out). An entry
# DEVICES:WORKERS:old runs the carried tree of an earlier commit instead (OLD, default .device/old.tgz, made here
# with `git archive --format=tar.gz -o .device/old.tgz REV`), on the same cache: a before/after on one machine
# (entries alternate in the order given). SKIP_COLD=1 skips the two cold runs. Files under OUT: gpus-N.json (bench curve's JSON) per cold run, util-N.txt, warm-*.json,
# log.txt.
# Usage: OUT=dir [WARM=...] [OLD=tgz] [SKIP_COLD=1] bash benchmarks/gpu_multi.sh [TARGET] [SECONDS] [-- kvfuzz fuzz args]
set -uo pipefail
T=${1:-vllm.unified_attention}
S=${2:-120}
shift 2 2>/dev/null; [ "${1:-}" = "--" ] && shift
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
ALL=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  echo "cpus $(nproc); $(lscpu | grep -E '^(Thread|Core|Socket|Model name)' | tr -s ' ' | paste -sd';' -)"
  COLD=(0 "$ALL"); [ -n "${SKIP_COLD:-}" ] && COLD=()
  for devs in "${COLD[@]}"; do
    n=$(echo "$devs" | tr , '\n' | wc -l)
    nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -l 1 > "$R/util-$n.txt" 2>/dev/null &
    SMI=$!
    echo "== CUDA_VISIBLE_DEVICES=$devs ($n GPU)"
    CUDA_VISIBLE_DEVICES=$devs $KV bench curve --target "$T" --duration "${S}s" --workers default --cold-only \
      --dir "$W/g$n" --json "$R/gpus-$n.json" -- "$@" 2>&1 | grep -v '^JSON'
    kill $SMI 2>/dev/null
    python3 - "$R/util-$n.txt" <<'PY'
import collections, sys
u = collections.defaultdict(list)
for line in open(sys.argv[1]):
    i, v = (x.strip() for x in line.split(","))
    u[i].append(float(v))
print("gpu util mean:", {i: round(sum(v) / len(v), 1) for i, v in sorted(u.items())})
PY
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); t=d['targets'][0]; print('summary:', d.get('workers'), {k: t.get(k) for k in ('examples','examples_per_s','kernel_s','harness_s','elapsed_s','failures')})" "$W/g$n/$T-wdefault-cold/summary.json" 2>&1
    rm -rf "$W/g$n"
  done
  if [ -n "${WARM:-}" ]; then
    echo "== warm: a cold fill on CUDA_VISIBLE_DEVICES=$ALL for ${S}s"
    CUDA_VISIBLE_DEVICES=$ALL timeout $((S + 120)) $KV fuzz --target "$T" --seed 0 --triton-cache "$W/tc" \
      --out "$W/fill" --duration "${S}s" "$@" > "$W/fill.log" 2>&1
    echo "fill exit $?"
    CAP=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['targets'][0]['examples'])" "$W/fill/summary.json")
    echo "fill: $CAP examples"
    NEW_PATH=$PYTHONPATH
    if [[ " $WARM" == *:old* ]]; then  # the earlier tree, installed beside this one
      rm -rf /tmp/multi-old /tmp/multi-kvold && mkdir -p /tmp/multi-old \
        && tar xzf "${OLD:-.device/old.tgz}" -C /tmp/multi-old \
        && (cd /tmp/multi-old && python3 -m pip install -q --no-deps --no-build-isolation --no-index \
              --target /tmp/multi-kvold .) || { echo "OLD tree: install failed"; exit 1; }
      echo "old tree: ${OLD:-.device/old.tgz}"
    fi
    k=0
    for spec in $WARM; do
      IFS=: read -r devs workers tree <<< "$spec"
      k=$((k + 1))
      name=warm-${devs//,/}-w$workers${tree:+-$tree}-$k
      P=$NEW_PATH; [ "$tree" = old ] && P=/tmp/multi-kvold:$NEW_PATH
      PYTHONPATH=$P CUDA_VISIBLE_DEVICES=$devs timeout $((S + 120)) $KV fuzz --target "$T" --seed 0 --triton-cache "$W/tc" \
        --out "$W/$name" --duration "${S}s" --max-examples "$CAP" --workers "$workers" "$@" > "$W/$name.log" 2>&1 &
      pid=$!
      : > "$W/$name.samples"
      while kill -0 $pid 2>/dev/null; do
        python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['targets'][0]['examples'])" \
          "$W/$name/status.json" >> "$W/$name.samples" 2>/dev/null || echo 0 >> "$W/$name.samples"
        sleep 1
      done
      wait $pid; rc=$?
      cp "$W/$name/summary.json" "$R/$name.json" 2>/dev/null
      python3 - "$W/$name.samples" "$R/$name.json" "$name" "$rc" <<'PY'
import json, sys
xs = [int(x) for x in open(sys.argv[1]).read().split()]
t = json.load(open(sys.argv[2]))["targets"][0]
last = min(i for i, x in enumerate(xs) if x == xs[-1])  # the first second with the final count
steady = (xs[last] - xs[10]) / max(1, last - 10) if last > 10 else None
first = next((i for i, x in enumerate(xs) if x > 0), last)  # the first second with an example counted
run = (xs[last] - xs[first]) / (last - first) if last > first else None
print(sys.argv[3], "exit", sys.argv[4], "examples", t["examples"], "ex/s", t["examples_per_s"],
      "steady", steady and round(steady, 1), "first-to-last", run and round(run, 1),
      "failures", len(t.get("failures", [])))
PY
    done
  fi
} > "$R/log.txt" 2>&1
tail -c 9000 "$R/log.txt"
