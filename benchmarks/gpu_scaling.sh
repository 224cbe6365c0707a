#!/usr/bin/env bash
# Workers per GPU, CUDA MPS, and where the reference runs, on one target with a warm Triton cache (one lent GPU,
# no network). A cold campaign fills the cache; then campaigns of the same seed, one per entry of RUNS
# ("NAME:WORKERS[:mps][:gpuref]": mps runs under a CUDA MPS daemon this script starts and stops, gpuref puts
# every reference on the GPU). Prints one line per run: name, workers, examples, examples/s, kernel s, harness s,
# elapsed s, Triton kernels in the cache, mean GPU utilization (%), nvidia-smi samples. PROFILE=NAME also records
# one worker of run NAME with py-spy (raw stacks in $OUT/NAME.pyspy, `make device-bundle` carries py-spy).
# Usage: OUT=dir bash benchmarks/gpu_scaling.sh [TARGET] [SECONDS]
set -uo pipefail
T=${1:-vllm.unified_attention}
S=${2:-35}
RUNS=${RUNS:-w1:1 w4:4 w8:8 w12:12 w8-gpu-reference:8:gpuref}
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
R=${OUT:-$(mktemp -d)} TC=${TRITON_CACHE:-$(mktemp -d)}
mkdir -p "$R"
MPS_DIR=$(mktemp -d)
mps_start() {
  command -v nvidia-cuda-mps-control >/dev/null || { echo "# no nvidia-cuda-mps-control here" >&2; return 1; }
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || return 1
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
profile() {  # py-spy one worker of the campaign under `timeout` pid $1, 15 s after it started
  sleep 15
  local cli w
  cli=$(pgrep -P "$1" | head -1)
  w=$(pgrep -P "$cli" | tail -1)
  [ -n "$w" ] && /tmp/site/bin/py-spy record -p "$w" -d 15 -f raw -o "$R/$2.pyspy" --nonblocking \
    > "$R/$2.pyspy.log" 2>&1
}
run() {
  local name=$1; shift
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -l 1 > "$R/$name.util" 2>/dev/null &
  local smi=$!
  timeout $((S + 90)) $KV fuzz --target "$T" --seed 0 --triton-cache "$TC" --out "$R/$name" "$@" > "$R/$name.log" 2>&1 &
  local pid=$!
  [ "${PROFILE:-}" = "$name" ] && profile "$pid" "$name" &
  wait $pid
  kill $smi 2>/dev/null
  python3 - "$R" "$name" "$TC" <<'PY'
import json, pathlib, sys
r, name, tc = sys.argv[1:]
try:
    d = json.loads((pathlib.Path(r) / name / "summary.json").read_text())
except (OSError, ValueError) as e:
    print(name, "no summary:", e, flush=True)
    raise SystemExit
t = d["targets"][0]
u = [float(x) for x in (pathlib.Path(r) / f"{name}.util").read_text().split() if x.strip()]
n = sum(1 for _ in pathlib.Path(tc).rglob("__grp__*.json"))
print(name, d.get("workers"), t["examples"], t["examples_per_s"], t.get("kernel_s"), t.get("harness_s"),
      t.get("elapsed_s"), n, round(sum(u) / max(1, len(u)), 1), len(u), flush=True)
PY
}
echo "name workers examples ex/s kernel_s harness_s elapsed_s kernels gpu_util% samples"
[ -n "${SKIP_COLD:-}" ] || run cold --duration $((S + 10))s
for spec in $RUNS; do
  IFS=: read -r name workers a b <<< "$spec"
  mps= gpuref=
  for f in $a $b; do [ "$f" = mps ] && mps=1; [ "$f" = gpuref ] && gpuref=1; done
  if [ -n "$mps" ]; then mps_start || { echo "$name mps unavailable"; continue; }; fi
  if [ -n "$gpuref" ]; then
    KVFUZZ_GPU_REFERENCE_MIN_KV=0 run "$name" --duration "${S}s" --workers "$workers"
  else
    run "$name" --duration "${S}s" --workers "$workers"
  fi
  [ -n "$mps" ] && mps_stop
done
rm -rf "$MPS_DIR"
