#!/usr/bin/env bash
# Issue 40's two-GPU goal: does one host's second GPU (and third, fourth) add its share? Same seed, the target's
# default size-tier mix and kvfuzz fuzz's defaults (workers, placement, MPS: one daemon per GPU now), on one GPU
# (CUDA_VISIBLE_DEVICES=first), on the first two where the host has more, and then on all of them, RUN_SECONDS
# each (default 90), after a warm-up campaign on all
# GPUs (WARMUP seconds, default 30) that fills the shared Triton cache, so neither timed run pays for compiles the
# other does not. AB=1 (default) adds a third run on all GPUs with KVFUZZ_MPS_PER_GPU=0 (one MPS daemon for all
# GPUs, as before issue 40): the before/after of the per-GPU daemons on the same machine.
# Per run: examples, examples/s, KV tokens, KV tokens/s (summary.json, counted from the target's first task),
# workers, nvidia-smi utilization.gpu per GPU (mean of 1 s samples), the supervisor's CPU seconds (ps) and the
# host's CPU busy (from /proc/stat), exit status, failures. The goal: all GPUs >= 1.9x one GPU in examples/s and KV
# tokens/s, each GPU >= 50% busy, the same findings. Files under OUT: run-*.json (summary.json), util-*.txt,
# scaling.json (the table), log.txt. Needs the .device/ bundle (benchmarks/gpu_env.sh); no network.
# Start-up and shutdown cost ~25 s per run, the install ~40 s: WARMUP + 3 x RUN_SECONDS + ~2.5 min (~7.5 min with
# the defaults; AB=0 saves a run), within one 10-minute device call.
# SIDE=1 (issue 51: "side by side, at the same time, never one run after another"): after the warm-up, one GPU (the
# first, cores 0 .. C-1) and two GPUs (the next two, cores C .. 3C-1) run at the same time, C = CORES_PER_GPU (default
# 16 here), so neither pays compiles or noise the other does not; needs 3 GPUs and 3C cores; AB is not run.
# SKIP_ONE=1 leaves out the one-GPU run (one measured in an earlier call on the same kind of host).
# CORES_PER_GPU=N gives each run N cores per GPU it uses (taskset 0 .. N*GPUs-1), as the lent machines are sized
# (16 cores a GPU): one GPU is then measured on a one-GPU machine's share of the host, not on all its cores; the
# defaults (workers) count that affinity mask. Unset: every run sees all the host's cores.
# GPUS=0,1,2 uses those GPUs alone (the rest of the host free for other work in the same call).
# Usage: OUT=dir [GPUS=i,j,..] [RUN_SECONDS=90] [WARMUP=30] [AB=1] [SKIP_ONE=1] bash benchmarks/gpu_multi_scaling.sh [TARGET] [-- kvfuzz fuzz args]
set -uo pipefail
T=${1:-vllm.unified_attention}
shift 1 2>/dev/null; [ "${1:-}" = "--" ] && shift
export S=${RUN_SECONDS:-90}  # not $SECONDS: bash counts its own seconds there
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
ALL=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)}
FIRST=${ALL%%,*}

cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$6+$7+$8, $2+$3+$4+$5+$6+$7+$8}' /proc/stat; }

run() {  # name devices seconds [env...]
  local name=$1 devs=$2 secs=$3; shift 3
  nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -l 1 > "$R/util-$name.txt" 2>/dev/null &
  local smi=$!
  read -r b0 t0 <<< "$(cpu_ticks)"
  local pin=() off=${CORE_OFFSET:-0}
  if [ -n "${CORES_PER_GPU:-}" ]; then
    local n; n=$(echo "$devs" | tr ',' '\n' | wc -l)
    pin=(taskset -c "$off-$((off + n * CORES_PER_GPU - 1))")
  fi
  env "$@" CUDA_VISIBLE_DEVICES=$devs "${pin[@]}" timeout $((secs + 150)) $KV fuzz --target "$T" --seed 0 \
    --triton-cache "$W/tc" --out "$W/$name" --duration "${secs}s" "${EXTRA[@]}" > "$W/$name.log" 2>&1 &
  local pid=$! sup_cpu=0
  while kill -0 $pid 2>/dev/null; do  # the supervisor: the python child of timeout
    local sp; sp=$(pgrep -P $pid | head -1)
    [ -n "$sp" ] && sup_cpu=$(ps -o times= -p "$sp" 2>/dev/null | tr -d ' ' || echo "$sup_cpu")
    sleep 1
  done
  wait $pid; local rc=$?
  read -r b1 t1 <<< "$(cpu_ticks)"
  kill $smi 2>/dev/null
  cp "$W/$name/summary.json" "$R/run-$name.json" 2>/dev/null
  tail -5 "$W/$name.log"
  python3 - "$R" "$name" "$devs" "$rc" "${sup_cpu:-0}" "$((b1 - b0))" "$((t1 - t0))" <<'PY'
import collections, json, os, sys
r, name, devs, rc, sup, busy, total = sys.argv[1:8]
u = collections.defaultdict(list)
for line in open(os.path.join(r, f"util-{name}.txt")):
    try:
        i, v = (x.strip() for x in line.split(","))
        u[i].append(float(v))
    except ValueError:
        pass
try:
    d = json.load(open(os.path.join(r, f"run-{name}.json")))
    t = d["targets"][0]
except (OSError, ValueError, KeyError, IndexError):
    d, t = {}, {}
row = {"run": name, "devices": devs, "cores": os.environ.get("CORES_PER_GPU") and
       int(os.environ["CORES_PER_GPU"]) * len(devs.split(",")) or os.cpu_count(), "exit": int(rc),
       "workers": d.get("workers"),
       "examples": t.get("examples"), "examples_per_s": t.get("examples_per_s"),
       "kv_tokens": t.get("kv_tokens"), "kv_tokens_per_s": t.get("kv_tokens_per_s"), "elapsed_s": t.get("elapsed_s"),
       # examples over --duration alone: an overrun (examples running at the deadline) draws no new ones
       "examples_per_s_in_duration": round((t.get("examples") or 0) / int(os.environ["S"]), 1),
       "gpu_busy_pct": {i: round(sum(v) / len(v), 1) for i, v in sorted(u.items()) if i in devs.split(",")},
       "supervisor_cpu_s": sup, "host_cpu_busy_pct": round(100 * int(busy) / max(1, int(total)), 1),
       "failures": sorted(f"{f['kind']}: {f['check']}" + (" (known)" if f.get("known") else "")
                          for f in t.get("failures", []))}
print(json.dumps(row))
with open(os.path.join(r, "rows.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
PY
}

EXTRA=("$@")
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  echo "cpus $(nproc); $(lscpu | grep -E '^(Model name|Socket)' | tr -s ' ' | paste -sd';' -); target $T; ${S}s per run"
  : > "$R/rows.jsonl"
  echo "== warm-up on $ALL for ${WARMUP:-30}s (fills the shared Triton cache)"
  run warmup "$ALL" "${WARMUP:-30}"
  if [ "${SIDE:-0}" = 1 ]; then
    export CORES_PER_GPU=${CORES_PER_GPU:-16}
    TWO=$(echo "$ALL" | cut -d, -f2-3)
    echo "== at the same time: one GPU ($FIRST, cores 0-$((CORES_PER_GPU - 1))) and two GPUs ($TWO, cores" \
      "$CORES_PER_GPU-$((3 * CORES_PER_GPU - 1)))"
    run one "$FIRST" "$S" > "$W/side-one.txt" 2>&1 &
    CORE_OFFSET=$CORES_PER_GPU run two "$TWO" "$S" > "$W/side-two.txt" 2>&1 &
    wait
    cat "$W/side-one.txt" "$W/side-two.txt"
  else
    if [ "${SKIP_ONE:-0}" != 1 ]; then
      echo "== one GPU ($FIRST)"
      run one "$FIRST" "$S"
    fi
    TWO=$(echo "$ALL" | cut -d, -f1-2)
    if [ "$TWO" != "$ALL" ]; then
      echo "== two GPUs ($TWO), one MPS daemon per GPU"
      run two "$TWO" "$S"
    fi
    echo "== all GPUs ($ALL), one MPS daemon per GPU"
    run all "$ALL" "$S"
    if [ "${AB:-1}" = 1 ]; then
      echo "== all GPUs ($ALL), one MPS daemon for all (KVFUZZ_MPS_PER_GPU=0, as before)"
      run all-one-daemon "$ALL" "$S" KVFUZZ_MPS_PER_GPU=0
    fi
  fi
  python3 - "$R" <<'PY'
import json, os, sys
r = sys.argv[1]
rows = {x["run"]: x for x in map(json.loads, open(os.path.join(r, "rows.jsonl")))}
one = rows.get("one", {})
out = {"rows": rows}
for k in ("two", "all", "all-one-daemon"):
    if k in rows and one.get("examples_per_s") and one.get("kv_tokens_per_s"):
        out[f"{k}_vs_one"] = {"examples_per_s": round(rows[k]["examples_per_s"] / one["examples_per_s"], 2),
                              "kv_tokens_per_s": round(rows[k]["kv_tokens_per_s"] / one["kv_tokens_per_s"], 2),
                              "examples_per_s_in_duration": round(rows[k]["examples_per_s_in_duration"]
                                                                  / max(1e-9, one["examples_per_s_in_duration"]), 2),
                              "same_findings": rows[k]["failures"] == one["failures"]}
json.dump(out, open(os.path.join(r, "scaling.json"), "w"), indent=2)
print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
PY
} > "$R/log.txt" 2>&1
tail -c 9000 "$R/log.txt"
