#!/usr/bin/env bash
# Workers per GPU and where the reference runs, on one target with a warm Triton cache (one lent GPU, no
# network). A cold campaign fills the cache; then campaigns of the same seed with 1, 4, 8, 12 workers (small
# references on the CPU, the default), and 8 workers with every reference on the GPU. Prints one line per run:
# name, workers, examples, examples/s, kernel s, harness s, elapsed s, Triton kernels in the cache, mean GPU
# utilization (%). Usage: bash benchmarks/gpu_scaling.sh [TARGET] [SECONDS]
set -uo pipefail
T=${1:-vllm.unified_attention}
S=${2:-35}
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
R=$(mktemp -d) TC=$(mktemp -d)
run() {
  local name=$1; shift
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -l 1 > "$R/$name.util" 2>/dev/null &
  local smi=$!
  timeout $((S + 60)) $KV fuzz --target "$T" --seed 0 --triton-cache "$TC" --out "$R/$name" "$@" > "$R/$name.log" 2>&1
  kill $smi 2>/dev/null
  python3 - "$R" "$name" "$TC" <<'PY'
import json, pathlib, sys
r, name, tc = sys.argv[1:]
d = json.loads((pathlib.Path(r) / name / "summary.json").read_text())
t = d["targets"][0]
u = [float(x) for x in (pathlib.Path(r) / f"{name}.util").read_text().split() if x.strip()]
n = sum(1 for _ in pathlib.Path(tc).rglob("__grp__*.json"))
print(name, d.get("workers"), t["examples"], t["examples_per_s"], t.get("kernel_s"), t.get("harness_s"),
      t.get("elapsed_s"), n, round(sum(u) / max(1, len(u)), 1), flush=True)
PY
}
echo "name workers examples ex/s kernel_s harness_s elapsed_s kernels gpu_util%"
run cold --duration $((S + 10))s
run w1 --duration ${S}s --workers 1
run w4 --duration ${S}s --workers 4
run w8 --duration ${S}s --workers 8
run w12 --duration ${S}s --workers 12
KVFUZZ_GPU_REFERENCE_MIN_KV=0 run w8-gpu-reference --duration ${S}s --workers 8
