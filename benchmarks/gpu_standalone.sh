#!/usr/bin/env bash
# Issue 41 on a GPU: every reproducer's standalone.py, run in a python3 whose path lacks kvfuzz, agrees with
# `kvfuzz replay` (benchmarks/gpu_standalone.py lists the cases). CASES picks the groups (space-separated):
#   triton fa3 mla (the default): compiled Triton (re-injected bug.vllm-47305 and bug.vllm-30887, finding 3, a passing
#     unified_attention), FA3 and FlashMLA (a planted softmax_scale fault, and passing cases; FlashMLA's scheduler
#     metadata made again in the script);
#   flex: torch.compile'd flex_attention (planted scale, and passing; block mask, score_mod, kernel_options made in
#     the script);
#   flashinfer: batch_decode, batch_decode_tc, batch_prefill (planted sm_scale, and passing) and append_paged_kv_cache
#     (planted keys, and passing); needs .device/flashinfer.tgz (FLASHINFER=1 make device-bundle);
#   finding8: docs/findings/8-torch-flex-score-mod-float-recompile/standalone.py (torch only; exit 1: reproduced on
#     this torch, 0: fixed), first, in at most 120 s.
# Carry .device/ (`make device-bundle`, with FA3=1 for FA3 and FlashMLA). Writes OUT/standalone.log and
# OUT/repro/<case>/ (standalone.out: its output). One device call per line, each under ~9 minutes on an H100:
#   OUT=dir bash benchmarks/gpu_standalone.sh                      (about 3-5 minutes)
#   OUT=dir CASES="mla flex finding8" bash benchmarks/gpu_standalone.sh
#   OUT=dir CASES=flashinfer bash benchmarks/gpu_standalone.sh     (FlashInfer's first JIT compiles: ~3.5 minutes)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
NOKV=/tmp/site:/tmp/vllm   # gpu_env.sh's PYTHONPATH without /tmp/kv: torch, safetensors, triton, vllm; no kvfuzz
[ -d /tmp/fi ] && NOKV=/tmp/fi:/tmp/fi-site:$NOKV   # and flashinfer, when carried
export CASES=${CASES:-triton fa3 mla}
echo "cases: $CASES" | tee "$OUT/standalone.log"
t0=$SECONDS
if [[ " $CASES " == *" finding8 "* ]]; then
  PYTHONPATH=$NOKV timeout 120 python3 docs/findings/8-torch-flex-score-mod-float-recompile/standalone.py 2>&1 \
    | tail -5 | tee -a "$OUT/standalone.log"
  echo "finding 8 standalone.py: exit ${PIPESTATUS[0]}" | tee -a "$OUT/standalone.log"
fi
timeout $((540 - (SECONDS - t0))) python3 benchmarks/gpu_standalone.py "$OUT" "$NOKV" 2>&1 | grep -v "^INFO\|^WARNING" | tee -a "$OUT/standalone.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/standalone.log"
