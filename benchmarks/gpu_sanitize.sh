#!/usr/bin/env bash
# Issue 39's memory-safety oracle on one GPU (H100/H200; compute-sanitizer from /usr/local/cuda/bin). Three steps,
# about 7 minutes in all:
#  1. the oracle on vllm#56862's trigger (one prefill sequence, query_len 4, block size 16, an exactly sized block
#     table): seq_len 16 and 48 should raise "memory safety" at triton_unified_attention.py:432 (a 4-byte read
#     just past the table's allocation), seq_len 17 should pass (0 errors) -> OUT/trigger.txt;
#  2. a plain campaign of vllm.unified_attention, 60 s, no --sanitize (examples/s baseline) -> OUT/plain.*;
#  3. the same with --sanitize 0.02 (found vllm#56862? examples/s against step 2) -> OUT/sanitize.*.
# Both campaigns run --mps off --workers 4 (compute-sanitizer does not attach to MPS clients).
# Carry .device/ (`make device-bundle`). Usage: OUT=dir bash benchmarks/gpu_sanitize.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
export PATH=$PATH:/usr/local/cuda/bin
command -v compute-sanitizer > "$OUT/sanitizer.txt" 2>&1 || echo "no compute-sanitizer" >> "$OUT/sanitizer.txt"
timeout 200 python3 - > "$OUT/trigger.txt" 2>&1 <<'PY'
import time
from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.harness import sanitizer
from kvfuzz.fuzz.targets.registry import get_target

t = get_target("vllm.unified_attention")
for seq_len in (16, 48, 17):
    ex = Example(small_batch([4], [seq_len - 4], head_size=64, block_size=16, dtype="float16"), Poison.NAN)
    start = time.time()
    try:
        sanitizer.sanitize(t, ex, "vllm.unified_attention")
        print(f"seq_len {seq_len}: clean ({time.time() - start:.1f} s)", flush=True)
    except Finding as f:
        print(f"seq_len {seq_len}: {f.kind.value}: {f.message} ({time.time() - start:.1f} s)", flush=True)
        print("   ", (f.details.get("report") or "")[-800:].replace("\n", "\n    "), flush=True)
PY
echo "trigger: exit $?" >> "$OUT/trigger.txt"
for run in "plain 0" "sanitize 0.02"; do
  set -- $run
  timeout 100 $KV fuzz --target vllm.unified_attention --seed 0 --duration 60s --mps off --workers 4 \
    --sanitize "$2" --out "/tmp/s-$1" > "$OUT/$1.log" 2>&1
  echo "$1 (--sanitize $2): exit $?" | tee "$OUT/$1.summary.txt"
  python3 -c "
import json
t=json.load(open('/tmp/s-$1/summary.json'))['targets'][0]
print({k:t.get(k) for k in ('examples','elapsed_s','examples_per_s','first_failure_s','first_failure_examples')})
for f in t['failures']: print(' ', f['kind'], f['blame'], f['check'], '|', f['batch'][:300], '|', f['message'][:300])
" 2>&1 | tee -a "$OUT/$1.summary.txt"
done
