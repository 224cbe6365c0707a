#!/usr/bin/env bash
# Issue 32's mix on one lent GPU (no network; carry .device/ from `make device-bundle`): one target fuzzed for
# SECONDS with `--tier auto` (every size tier it declares: small on 4 chunks of 5, long/wide/big-cache in turn on
# the fifth, each large chunk sized to a small chunk's time), then SECONDS of `--tier small` alone, each from an
# empty Triton cache (both cold: same compile work per configuration), kvfuzz fuzz's defaults otherwise (workers,
# MPS, pinned chunks). nvidia-smi's utilization is sampled each second through each run. Then
# benchmarks/gpu_profile.py's per-stage split (small and 1M-KV batches) of the same target, unless PROFILE_EXAMPLES=0.
# MODES (default "auto small") names the runs, each a --tier value; PYSPY_MODE profiles one worker of that run for
# 20 s, 30 s in (py-spy from the bundle). Writes OUT/tiers.json (per run: examples, per-tier counts and kernel and
# harness seconds, GPU busy mean; the small tier's examples/s against the small-only run's), OUT/log.txt,
# OUT/profile.json, OUT/util-<mode>.txt, OUT/worker-<mode>.top.txt.
# Usage: OUT=dir [MODES="auto small"] [PYSPY_MODE=long] bash benchmarks/gpu_tiers.sh [TARGET] [SECONDS] [-- fuzz args]
set -uo pipefail
T=${1:-vllm.unified_attention}
S=${2:-180}
shift 2 2>/dev/null; [ "${1:-}" = "--" ] && shift
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
{
  gpu_machine
  for mode in ${MODES:-auto small}; do
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -l 1 > "$R/util-$mode.txt" 2>/dev/null &
    SMI=$!
    if [ "${PYSPY_MODE:-}" = "$mode" ]; then
      (
        sleep 30
        cli=$(pgrep -f -- "--out $W/$mode" | head -1)
        w=$(pgrep -P "$cli" | tail -1)
        [ -n "$w" ] && /tmp/site/bin/py-spy record -p "$w" -d 20 -f raw -o "$W/$mode.raw" --nonblocking
        python3 benchmarks/pyspy_top.py "$W/$mode.raw" --top 60 > "$R/worker-$mode.top.txt" 2>&1
      ) &
    fi
    timeout $((S + 120)) $KV fuzz --target "$T" --seed 0 --duration "${S}s" --tier "$mode" \
      --triton-cache "$W/triton-$mode" --out "$W/$mode" --baseline kvfuzz-baseline.toml "$@" > "$W/$mode.log" 2>&1
    echo "$mode: exit $?"
    kill $SMI 2>/dev/null
    tail -4 "$W/$mode.log"
  done
  python3 - "$W" "$R" "${MODES:-auto small}" <<'PY'
import json, sys
from pathlib import Path
w, r = Path(sys.argv[1]), Path(sys.argv[2])
out = {}
for mode in sys.argv[3].split():
    u = [float(x) for x in (r / f"util-{mode}.txt").read_text().split() if x.strip()]
    try:
        (t,) = json.loads((w / mode / "summary.json").read_text())["targets"]
    except (OSError, ValueError) as e:
        out[mode] = {"error": repr(e)}
        continue
    tiers = t["coverage"].get("tier", {})
    out[mode] = {k: t.get(k) for k in ("examples", "elapsed_s", "examples_per_s", "kernel_s", "harness_s", "lost",
                                       "max_error_ratio")}
    out[mode].update(tiers=tiers, tier_seconds=t.get("tiers"), gpu_busy_mean_pct=round(sum(u) / max(1, len(u)), 1), gpu_samples=len(u),
                     failures=[{k: f.get(k) for k in ("kind", "blame", "known", "batch")} for f in t["failures"]])
    out[mode]["small_per_s"] = round(tiers.get("small", 0) / t["elapsed_s"], 1) if t.get("elapsed_s") else None
if "small_per_s" in out.get("auto", {}) and out.get("small", {}).get("small_per_s"):
    out["small_rate_ratio"] = round(out["auto"]["small_per_s"] / out["small"]["small_per_s"], 3)
(r / "tiers.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
PY
  [ "${PROFILE_EXAMPLES:-20}" = 0 ] || TRITON_CACHE_DIR="$W/triton-small" timeout "${PROFILE_TIMEOUT:-200}" \
    python3 benchmarks/gpu_profile.py --target "$T" --examples "${PROFILE_EXAMPLES:-20}" --configs 1 --tokens \
    --out "$R/profile.json" 2>&1 | cut -c1-600
} > "$R/log.txt" 2>&1
tail -c 9000 "$R/log.txt"
