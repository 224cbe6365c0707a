#!/usr/bin/env bash
# Issue 41 on a GPU: every reproducer's standalone.py, run in a python3 whose path lacks kvfuzz, agrees with
# `kvfuzz replay` for compiled Triton (re-injected bug.vllm-47305 and bug.vllm-30887, finding 3), FA3 and FlashMLA
# (a planted softmax_scale fault; and passing cases: FA3 with a window and a softcap, FlashMLA, unified_attention).
# FlashInfer's reproducers get a report-only standalone.py (no call to compare). Carry .device/ (`make device-bundle`,
# with FA3=1 for FA3 and FlashMLA). Writes OUT/standalone.log and OUT/repro/<case>/ (standalone.out: its output).
# Usage: OUT=dir bash benchmarks/gpu_standalone.sh     (about 3-5 minutes on an H100)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
NOKV=/tmp/site:/tmp/vllm   # gpu_env.sh's PYTHONPATH without /tmp/kv: torch, safetensors, triton, vllm; no kvfuzz
timeout 540 python3 benchmarks/gpu_standalone.py "$OUT" "$NOKV" 2>&1 | grep -v "^INFO\|^WARNING" | tee "$OUT/standalone.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/standalone.log"
