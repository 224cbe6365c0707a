#!/usr/bin/env bash
# Before/after of benchmarks/gpu_profile.py on one lent GPU: the carried tree of an earlier commit (OLD, made here
# with `git archive --format=tar.gz -o .device/old.tgz REV`) and this tree, alternated REPS times (default 3) on one
# warm Triton cache, vllm.unified_attention, configuration 0, 300 small examples and 30 of 1M+ KV elements. Prints
# one line per run (ms per example and per stage); keeps the last pair as OUT/profile-{old,new}.json. Measured on an
# H200: the same code varies 2-3x between processes (benchmarks/results/gpu-profile-h200-ab.log): compare medians.
# Usage: OUT=dir [OLD=.device/old.tgz] [REPS=3] bash benchmarks/gpu_profile_ab.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc-profile-ab}
rm -rf /tmp/ab-old /tmp/ab-kvold && mkdir -p /tmp/ab-old && tar xzf "${OLD:-.device/old.tgz}" -C /tmp/ab-old || exit 1
(cd /tmp/ab-old && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/ab-kvold .) || exit 1
NEW_PATH=$PYTHONPATH
# one discarded run first: it fills the Triton cache, so neither side's first run pays the compiles
timeout 180 python3 benchmarks/gpu_profile.py --target vllm.unified_attention --examples 300 --configs 1 \
  --out /tmp/ab-warmup.json > /tmp/ab-warmup.log 2>&1
for i in $(seq 0 $((${REPS:-3} - 1))); do
  for v in old new; do
    if [ $v = old ]; then P=/tmp/ab-kvold:$NEW_PATH S=/tmp/ab-old/benchmarks/gpu_profile.py
    else P=$NEW_PATH S=benchmarks/gpu_profile.py; fi
    PYTHONPATH=$P timeout 180 python3 "$S" --target vllm.unified_attention --examples 300 --configs 1 \
      --out "/tmp/ab-$v.json" > "/tmp/ab-$v.log" 2>&1 || { echo "$v-$i failed:"; tail -3 "/tmp/ab-$v.log"; continue; }
    python3 - "/tmp/ab-$v.json" "$v-$i" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = d["targets"][0]
big, small = t["stages_1M_kv"], t["stages_small"]
print(sys.argv[2], d["device"], "| 1M KV", big["ms_per_example"], "ms", big["stages_ms"], "| small", small["ms_per_example"],
      "ms", small["stages_ms"], flush=True)
PY
    cp "/tmp/ab-$v.json" "$R/profile-$v.json"
  done
done
