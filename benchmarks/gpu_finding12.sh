#!/usr/bin/env bash
# Finding 12 (FA3's sliding-window wrong results, docs/findings.md) shrunk on a Hopper GPU: plain campaigns of
# vllm.flash_attn_varlen (kvfuzz's defaults; a failure found in time gets KVFUZZ_SHRINK_GRACE more to shrink), seeds
# from SEEDS (default "0 1"), DURATION each (default 120s); then `kvfuzz report --issue` and each reproducer's
# standalone.py (run without kvfuzz on the path: its verdict should be exit 1, "reproduces"). Writes OUT/fa3-<seed>/
# (the reproducers; tensor files over 4 MB dropped so the folder travels back) and OUT/finding12.txt (the summary).
# Carry .device/ (`make device-bundle FA3=1`). Usage: OUT=dir bash benchmarks/gpu_finding12.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || exit 1
S="$OUT/finding12.txt"
for seed in ${SEEDS:-0 1}; do
  d="$OUT/fa3-$seed"
  timeout 400 $KV fuzz --target vllm.flash_attn_varlen --seed "$seed" --duration "${DURATION:-120s}" --out "$d" \
    > "$OUT/fa3-$seed.log" 2>&1
  echo "== seed $seed: exit $?" >> "$S"
  tail -25 "$OUT/fa3-$seed.log" >> "$S"
  for r in "$d"/*/; do
    [ -f "$r/case.json" ] || continue
    echo "-- $r" >> "$S"
    python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print(json.dumps(c)[:1500])" "$r/case.json" >> "$S"
    timeout 120 $KV report "$r" --issue >> "$S" 2>&1; echo "report --issue: exit $?" >> "$S"
    # the standalone script without kvfuzz: only the kernel's package (vllm, from /tmp/vllm) and torch/safetensors
    (cd "$r" && PYTHONPATH=/tmp/site:/tmp/vllm timeout 120 python3 standalone.py) >> "$S" 2>&1
    echo "standalone.py: exit $?" >> "$S"
  done
  find "$d" -name '*.safetensors' -size +4M -delete
  rm -rf "$d/hypothesis-db" "$d/workers" 2>/dev/null
done
cat "$S" | tail -c 6000
