#!/usr/bin/env bash
# `kvfuzz bench bugs` on a lent GPU in one device call: the re-injected bugs in four concurrent groups (one
# process each; the slow bugs alone), so 3 seeds of every bug fit one call. Carry .device/ (`make device-bundle`).
# Writes OUT/bugs-<group>.json and .log; TAG names the files (e.g. before, after). Against the shipped baseline
# (--baseline kvfuzz-baseline.toml): a known live bug in the same kernel (vllm#56862, which the memory-safety oracle
# meets in the unified kernel) neither ends a campaign nor counts as the re-injected bug found.
# Usage: OUT=dir TAG=before SEEDS=3 DURATION=100s bash benchmarks/gpu_bugs_groups.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || exit 1
TAG=${TAG:-run}
i=0
for g in "vllm-47305 sglang-2479" "vllm-56579" "vllm-47671" "vllm-30887"; do
  args=(); for b in $g; do args+=(--bug "$b"); done
  i=$((i + 1))
  timeout "${GROUP_TIMEOUT:-520}" $KV bench bugs "${args[@]}" --seeds "${SEEDS:-3}" --duration "${DURATION:-100s}" \
    --baseline kvfuzz-baseline.toml --json "$OUT/bugs-$TAG-$i.json" > "$OUT/bugs-$TAG-$i.log" 2>&1 &
done
wait
python3 - "$OUT" "$TAG" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/bugs-{sys.argv[2]}-*.json")):
    for b in json.load(open(f))["bugs"]:
        s = b["summary"]
        print(b["bug"], f"found {s['found']}/{s['runs']}", "median s", s.get("median_seconds_to_first"),
              "examples", s.get("median_examples_to_first"), s.get("kinds"))
PY
