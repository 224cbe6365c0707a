#!/usr/bin/env bash
# The structural shrink on a lent GPU machine (no network; what gpu_env.sh installs was carried in .device/):
# (1) `kvfuzz bench detect` of the mutant zoo (torch kernels, on the host's CPU cores), free and pinned
#     configurations, 5 seeds, 15 jobs, 2,000 examples / 20 s per mutant and seed;
# (2) compiled Triton targets on the GPU whose known findings show within seconds (README Findings 3 and 9),
#     same seed with the structural shrink on (60 s) and off: each reproducer's case and what the shrink did
#     (case.json details.structural_shrink: the case it started from, candidates tried and taken, seconds).
# Usage: bash benchmarks/gpu_shrink.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/kvfuzz-shrink}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
for c in free pinned; do
  timeout 240 $KV bench detect --seeds 5 --max-examples 2000 --duration 20s --no-grid --jobs 15 --configs $c \
    --json "$OUT/detect-$c.json" --markdown "$OUT/detect-$c.md" > "$OUT/detect-$c.log" 2>&1
  cat "$OUT/detect-$c.md"
done
TC=$(mktemp -d)
for t in ${TARGETS:-vllm.decode_attention_fwd sglang.decode_attention_fwd}; do
  for s in 60 0; do
    timeout $((${FUZZ_SECONDS:-60} + 120)) $KV fuzz --target "$t" --seed 0 --duration "${FUZZ_SECONDS:-60}s" \
      --triton-cache "$TC" --structural-shrink $s --out "$OUT/fuzz-$t-$s" > "$OUT/fuzz-$t-$s.log" 2>&1
    python3 - "$OUT/fuzz-$t-$s" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
s = json.loads((d / "summary.json").read_text())
for t in s["targets"]:
    print(d.name, "examples", t["examples"], "ex/s", t["examples_per_s"])
    for f in t["failures"]:
        case = json.loads((pathlib.Path(f["reproducer"]) / "case.json").read_text())
        print("  ", f["kind"], "|", f["check"], "| x", f["count"], "|", f["batch"], "|",
              case["details"].get("structural_shrink"), flush=True)
PY
  done
done
