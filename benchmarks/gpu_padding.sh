#!/usr/bin/env bash
# Issue 39 item 1 on one lent Hopper GPU (no network; carry .device/ from `make device-bundle FA3=1`, as
# benchmarks/gpu_hopper.sh does): vLLM's FULL CUDA-graph padding, now declared on vllm.flash_attn_varlen (FA3) and
# vllm.flashmla_decode (FlashMLA), on the real kernels. Is there a false alarm, and what do they leave in the pad rows?
#   1. benchmarks/hopper_smoke.py: the fixed cases of both targets, among them two padded decode batches per target
#      (3 decodes padded to 4, 5 padded to 8: seq_len-0 pads on the null block); each padded line also prints the
#      pad rows (finite? max |x|);
#   2. a default campaign per target, `kvfuzz fuzz --target T --seed 0 --duration ${FUZZ_SECONDS}s` (CUDA-graph pads
#      drawn on about half the decode-only batches), then per failure: its check, whether the batch had pads, known
#      or not, and the shrunk batch; the coverage's "states" counts (how many examples carried pads).
# Confirms the work when every smoke line is "pass" with "finite True" pad rows and no campaign failure has pads
# (FA3's Finding 12, the sliding-window bug found by the serving tier, may appear: it has no pads).
# Worst case: setup ~40 s + smoke ~30 s + 2 x (FUZZ_SECONDS + ~25 s) = ~4 min at the default 60 s.
# Writes OUT/log.txt (printed at the end), OUT/smoke.json, OUT/<target>.summary.json, OUT/<target>-repro.tgz (the
# reproducers without tensors or the Hypothesis database).
# Usage: OUT=dir [FUZZ_SECONDS=60] bash benchmarks/gpu_padding.sh
set -uo pipefail
S=${FUZZ_SECONDS:-60}
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed (carry .device/)"; exit 1; }
gpu_out
{
  gpu_machine
  [ -f /tmp/vllm/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ] || echo "gpu_padding: no FA3 extension (build .device with FA3=1)"
  t0=$(date +%s)
  timeout 150 python3 benchmarks/hopper_smoke.py "$R/smoke.json" 2>&1 | grep -v "^ *$" | cut -c1-600
  echo "smoke: $(( $(date +%s) - t0 )) s"
  for t in vllm.flash_attn_varlen vllm.flashmla_decode; do
    t1=$(date +%s)
    timeout $((S + 60)) $KV fuzz --target "$t" --seed 0 --duration "${S}s" --out "$W/$t" \
      --baseline kvfuzz-baseline.toml > "$W/$t.log" 2>&1
    echo "== $t: exit $? after $(( $(date +%s) - t1 )) s"
    cp "$W/$t/summary.json" "$R/$t.summary.json" 2>/dev/null
    tar czf "$R/$t-repro.tgz" -C "$W/$t" --exclude=hypothesis-db --exclude='*.safetensors' . 2>/dev/null
    python3 - "$W/$t/summary.json" <<'PY' 2>&1 || tail -5 "$W/$t.log"
import json, sys
(t,) = json.load(open(sys.argv[1]))["targets"]
print("  examples", t["examples"], "at", t["examples_per_s"], "/s; states", t["coverage"].get("states"))
pads = [((f.get("example") or {}).get("batch") or {}).get("num_pad_seqs", 0) for f in t["failures"]]
for f, p in zip(t["failures"], pads):
    print("   ", f["kind"], f["check"], "known:", f.get("known"), "pads:", p, "|", f["batch"][:300])
print("  failures:", len(pads), "with CUDA-graph pads:", sum(1 for p in pads if p))
PY
  done
  echo "total: $(( $(date +%s) - t0 )) s"
} > "$R/log.txt" 2>&1
tail -c 11000 "$R/log.txt"
