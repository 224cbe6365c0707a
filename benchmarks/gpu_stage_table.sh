#!/usr/bin/env bash
# Where a GPU campaign's time goes (summary.json's `time`, fuzz/campaign/stages.py), cold and warm: one target on
# one lent GPU (no network), a campaign with an empty Triton cache, then the same seed again with the cache it
# filled. Compiles must land in `compile`, not `kernel`: the two runs' kernel ms per example should agree while
# the cold run's compile seconds are far above the warm run's. Prints, per run: the command's time line, then per
# tier the examples and the mean ms per example of kernel, compile, queued, reference, draw and hypothesis, and
# the seconds of kernel, compile and queued against the workers' wall time.
# Usage: OUT=dir bash benchmarks/gpu_stage_table.sh [TARGET] [SECONDS]
set -uo pipefail
T=${1:-vllm.unified_attention}
S=${2:-90}
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
gpu_machine | tee "$R/machine.txt"
run() {
  local name=$1
  timeout $((S + 300)) $KV fuzz --target "$T" --seed 0 --duration "${S}s" --triton-cache "$W/triton" \
    --out "$R/$name" > "$R/$name.log" 2>&1
  python3 - "$R" "$name" <<'PY'
import json, pathlib, sys
r, name = sys.argv[1:]
try:
    d = json.loads((pathlib.Path(r) / name / "summary.json").read_text())
except (OSError, ValueError) as e:
    print(name, "no summary:", e, flush=True)
    raise SystemExit
t = d.get("time") or {}
log = (pathlib.Path(r) / f"{name}.log").read_text().splitlines()
print(name, next((x for x in log if x.startswith("time: ")), "(no time line)"), flush=True)
for row in t.get("rows", []):
    ms = row["ms"]
    print(f"  {row['tier']:10} examples {row['examples']:7}  " + "  ".join(
        f"{k} {ms.get(k, 0):.2f}" for k in ("kernel", "compile", "queued", "reference", "draw", "hypothesis")))
s = t.get("seconds", {})
print(f"  wall {t.get('wall_s')} s: kernel {s.get('kernel', 0)} s, compile {s.get('compile', 0)} s, "
      f"queued {s.get('queued', 0)} s; target kernel_s {d['targets'][0].get('kernel_s')}", flush=True)
PY
}
run cold
run warm
