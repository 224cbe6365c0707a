#!/usr/bin/env bash
# Issue 40's memory measurement: a user adapter subclassing vllm.unified_attention (only run() overridden) fuzzed
# with the default GPU mix (big-cache tier included) and the default workers. Counts harness errors, Hypothesis
# flaky reports and examples skipped for memory in summary.json. Carry .device/.
# Usage: OUT=dir SECONDS_PER_RUN=45 bash benchmarks/gpu_memory_adapter.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || exit 1
timeout $(( ${SECONDS_PER_RUN:-45} + 60 )) $KV fuzz --target benchmarks/adapters/unified_run_only.py:UnifiedRunOnly \
  --duration "${SECONDS_PER_RUN:-45}s" --out /tmp/mem-adapter > "$OUT/memory-adapter.log" 2>&1
echo "exit $?" | tee -a "$OUT/memory-adapter.log"
python3 - <<'PY' | tee "$OUT/memory-adapter.txt"
import json
s = json.load(open("/tmp/mem-adapter/summary.json"))
for t in s["targets"]:
    fails = t.get("failures", [])
    print(t.get("name", t.get("target")), "examples", t.get("examples"), "skipped_for_memory", t.get("skipped_for_memory"),
          "tiers", t.get("coverage", {}).get("tier"))
    for f in fails:
        print("  ", f.get("kind"), f.get("blame"), f.get("check"), str(f.get("message", ""))[:200])
print("problems", s.get("problems"))
PY
grep -c "OutOfMemoryError" "$OUT/memory-adapter.log" | sed 's/^/OutOfMemoryError lines: /'
grep -c "Flaky" "$OUT/memory-adapter.log" | sed 's/^/Flaky lines: /'
