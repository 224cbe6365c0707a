#!/usr/bin/env bash
# Issue 39's memory-safety oracle on one GPU (H100/H200; compute-sanitizer from /usr/local/cuda/bin), about 8
# minutes in all:
#  1. the oracle on vllm#56862's trigger (one prefill sequence, query_len 12, > 8: the 2-D path with its prefill
#     tile of 32; block size 16, an exactly sized block table): seq_len 16 and 48 should raise "memory safety" at
#     triton_unified_attention.py:432 (a 4-byte read just past the table's allocation), seq_len 17 should pass (0 errors) -> OUT/trigger.txt;
#  2. (below: 4 and 5) a persistent-child probe, and default campaigns with --sanitize 0 and each share in SHARES.
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
    ex = Example(small_batch([12], [seq_len - 12], head_size=64, block_size=16, dtype="float16"), Poison.NAN)
    start = time.time()
    try:
        sanitizer.sanitize(t, ex, "vllm.unified_attention")
        print(f"seq_len {seq_len}: clean ({time.time() - start:.1f} s)", flush=True)
    except Finding as f:
        print(f"seq_len {seq_len}: {f.kind.value}: {f.message} ({time.time() - start:.1f} s)", flush=True)
        print("   ", (f.details.get("report") or "")[-800:].replace("\n", "\n    "), flush=True)
PY
echo "trigger: exit $?" >> "$OUT/trigger.txt"
# 4. persistent-child probe: one process under memcheck runs the trigger (seq_len 16), a clean case (17) and the
#    trigger again, printing a marker after each: do the reports come between the markers, and does the process
#    go on after an invalid access (--destroy-on-device-error kernel)? -> OUT/persistent.txt
for mode in context kernel; do
  echo "== --destroy-on-device-error $mode" >> "$OUT/persistent.txt"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 5 \
    --destroy-on-device-error $mode python3 - >> "$OUT/persistent.txt" 2>&1 <<'PY'
import time, torch, attrs
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.harness import properties, sanitizer
from kvfuzz.fuzz.targets.registry import get_target
t = get_target("vllm.unified_attention")
for i, seq_len in enumerate((16, 17, 48, 17)):
    ex = Example(small_batch([12], [seq_len - 12], head_size=64, block_size=16, dtype="float16"), Poison.NAN)
    ex = attrs.evolve(ex, batch=sanitizer.exact_batch(ex.batch))
    start = time.time()
    try:
        run = properties.prepare(t, ex)
        t.run(run.call)
        torch.cuda.synchronize()
        print(f"KVFUZZ-DONE {i} seq_len {seq_len} {time.time() - start:.2f} s", flush=True)
    except Exception as e:
        print(f"KVFUZZ-RAISED {i} seq_len {seq_len} {type(e).__name__}: {str(e)[:200]}", flush=True)
PY
  echo "exit $?" >> "$OUT/persistent.txt"
done
# 5. default campaigns (kvfuzz's defaults: MPS, its workers, unless SAN_ARGS says otherwise) of
#    vllm.unified_attention, after a WARM-second warm-up that fills the Triton cache: --sanitize 0 (the examples/s
#    baseline) and each share in SHARES, RUN seconds each -> OUT/<share>.log, OUT/summary.txt
WARM=${WARM:-30}; RUN=${RUN:-60}
timeout $((WARM + 100)) $KV fuzz --target vllm.unified_attention --seed 9 --duration "${WARM}s" ${SAN_ARGS:-} \
  --out /tmp/s-warm > "$OUT/warm.log" 2>&1
for share in 0 ${SHARES:-auto}; do
  timeout $((RUN + 200)) $KV fuzz --target vllm.unified_attention --seed 0 --duration "${RUN}s" ${SAN_ARGS:-} \
    --sanitize "$share" --out "/tmp/s-$share" > "$OUT/$share.log" 2>&1
  echo "--sanitize $share: exit $?" | tee -a "$OUT/summary.txt"
  python3 -c "
import json
t=json.load(open('/tmp/s-$share/summary.json'))['targets'][0]
print({k:t.get(k) for k in ('examples','elapsed_s','examples_per_s','first_failure_s','first_failure_examples')})
print('sanitize-related:', {k: v for k, v in t.items() if 'sanit' in k.lower()})
for f in t['failures']: print(' ', f['kind'], f['blame'], f['check'], '|', f['batch'][:300], '|', f['message'][:300])
" 2>&1 | tee -a "$OUT/summary.txt"
  grep -c "sanitized" "$OUT/$share.log" >> "$OUT/summary.txt"
done
