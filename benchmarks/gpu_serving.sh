#!/usr/bin/env bash
# Issue 38 on one lent Hopper GPU (no network; carry .device/ from `make device-bundle FA3=1`, as
# benchmarks/gpu_hopper.sh does): does the default campaign, with the serving size tier in its mix, find vLLM 0.33.0's
# FA3 sliding-window failure (head sizes 192/256, a prefill chunk whose context runs past the window)?
# (a) plain `kvfuzz fuzz --target vllm.flash_attn_varlen --duration ${SECONDS_FA3}s` (NO size options: --tier auto,
#     the CUDA default) on seeds 0, 1, 2, each stopped GRACE seconds after its first failure's reproducer appears (so
#     Hypothesis can shrink it) or at its duration: time to first failure, examples to it, per-tier counts and the
#     shrunk batch of each failure;
# (b) a default campaign of vllm.unified_attention for SECONDS_UNIFIED seconds with nvidia-smi sampling GPU busy each
#     second: examples/s per tier, GPU busy mean, exit code (a correct kernel: 0, no new false alarm).
# Worst case ~3 * (120 + 20) + 120 + 20 s = 9.3 min; a first failure at ~20 s makes (a) ~3 * 75 s.
# Writes OUT/serving.json, OUT/<run>.log, OUT/util-unified.txt.
# FA3_ONLY=1: only (a), with each seed's summary.json and its reproducers (no tensors) back as OUT/fa3-S.*.
# Usage: OUT=dir [SECONDS_FA3=120] [SECONDS_UNIFIED=120] [GRACE=40] [SEEDS="0 1 2"] [FA3_ONLY=1] bash benchmarks/gpu_serving.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed (carry .device/)"; exit 1; }
gpu_out
SF=${SECONDS_FA3:-120}; SU=${SECONDS_UNIFIED:-120}; G=${GRACE:-40}
{
  gpu_machine
  for s in ${SEEDS:-0 1 2}; do
    o="$W/fa3-$s"
    $KV fuzz --target vllm.flash_attn_varlen --seed "$s" --duration "${SF}s" --out "$o" \
      --baseline kvfuzz-baseline.toml > "$R/fa3-$s.log" 2>&1 &
    cli=$!
    start=$(date +%s); found=""
    while kill -0 "$cli" 2>/dev/null; do
      sleep 1
      now=$(date +%s)
      if [ -z "$found" ] && ls "$o" 2>/dev/null | grep -q "^vllm.flash_attn_varlen-"; then found=$now; fi
      if [ -n "$found" ] && [ $((now - found)) -ge "$G" ]; then kill -TERM "$cli"; fi
      if [ $((now - start)) -ge $((SF + 60)) ]; then kill -TERM "$cli"; fi
    done
    wait "$cli"; echo "fa3 seed $s: exit $? after $(( $(date +%s) - start )) s"
    cp "$o/summary.json" "$R/fa3-$s.summary.json" 2>/dev/null
    python3 -c "
import json, sys
(t,) = json.load(open(sys.argv[1]))['targets']
print('  first_failure_s', t.get('first_failure_s'), 'examples', t.get('first_failure_examples'), 'of', t.get('examples'),
      'tiers', t['coverage'].get('tier'))
for f in t['failures']:
    print('   ', f['kind'], f.get('known'), '|', str(f['batch'])[:300])
" "$o/summary.json" 2>&1
    [ -n "${FA3_ONLY:-}" ] && tar czf "$R/fa3-$s-repro.tgz" -C "$o" --exclude=hypothesis-db --exclude='*.safetensors' . 2>/dev/null
  done
  [ -n "${FA3_ONLY:-}" ] && exit 0
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -l 1 > "$R/util-unified.txt" 2>/dev/null &
  SMI=$!
  timeout $((SU + 90)) $KV fuzz --target vllm.unified_attention --seed 0 --duration "${SU}s" --out "$W/unified" \
    --baseline kvfuzz-baseline.toml > "$R/unified.log" 2>&1
  echo "unified: exit $?"
  kill $SMI 2>/dev/null
  python3 - "$W" "$R" "${SEEDS:-0 1 2}" <<'PY'
import json, sys
from pathlib import Path
w, r = Path(sys.argv[1]), Path(sys.argv[2])
out = {}
runs = [(f"fa3-{s}", w / f"fa3-{s}") for s in sys.argv[3].split()] + [("unified", w / "unified")]
for name, d in runs:
    try:
        (t,) = json.loads((d / "summary.json").read_text())["targets"]
    except (OSError, ValueError) as e:
        out[name] = {"error": repr(e)}
        continue
    out[name] = {k: t.get(k) for k in ("examples", "elapsed_s", "examples_per_s", "kernel_s", "harness_s",
                                       "first_failure_s", "first_failure_examples", "max_error_ratio")}
    out[name]["tiers"] = t["coverage"].get("tier")
    out[name]["tier_seconds"] = t.get("tiers")
    out[name]["failures"] = [{k: f.get(k) for k in ("kind", "blame", "check", "known", "message", "batch")}
                             for f in t["failures"]]
util = r / "util-unified.txt"
u = [float(x) for x in util.read_text().split() if x.strip()] if util.exists() else []
out.setdefault("unified", {})["gpu_busy_mean_pct"] = round(sum(u) / max(1, len(u)), 1)
(r / "serving.json").write_text(json.dumps(out, indent=1, default=str))
for name, v in out.items():
    print(name, {k: v.get(k) for k in ("examples", "first_failure_s", "first_failure_examples", "tiers",
                                        "gpu_busy_mean_pct")})
    for f in v.get("failures", []):
        print("  ", f["kind"], f["blame"], f["check"], "|", str(f["batch"])[:400])
PY
} 2>&1 | tee "$R/log.txt"
