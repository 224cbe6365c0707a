#!/usr/bin/env bash
# One GPU session on a machine with no network (this project's lent H100/H200): install what was carried,
# list targets, fuzz every target compiled, measure the guard, run the seeds' scenario under the plugin.
# Carried (ignored) folder .device/: whl/*.whl (hypothesis, attrs, click, rich, pyzmq, cachetools, blake3,
# regex, ...), vllm-py.tgz (vLLM 0.33.0's Python files, no .so) and sglang/ (the sglang 0.5.23 kernel files:
# cp -r .venv/share/kvfuzz/sglang .device/). Usage: bash benchmarks/gpu_session.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/kvfuzz-gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $KV targets
  for t in ${TARGETS:-vllm.chunked_prefill_paged_decode vllm.context_attention_fwd vllm.unified_attention \
           vllm.decode_attention_fwd vllm.reshape_and_cache torch.flex_paged sglang.extend_attention_fwd \
           sglang.decode_attention_fwd}; do
    timeout 120 $KV fuzz --target "$t" --max-examples 300 --duration "${FUZZ_SECONDS:-40}s" --out "$OUT/fuzz/$t" \
      2>&1 | grep -v "^ *$" | tail -25
  done
  [ -n "${SKIP_GUARD_BENCH:-}" ] || timeout 120 python3 benchmarks/guard_overhead.py --repeat 30
  # the plugin is installed (pytest11 entry point): --kvfuzz-guard alone turns it on
  KVFUZZ_SEEDS_SCENARIO=1 timeout 120 python3 -m pytest -q --kvfuzz-guard -p no:cacheprovider tests/fuzz/guard/seeds_scenario \
    2>&1 | tail -30
} > "$OUT/log.txt" 2>&1
tar czf "$OUT/reproducers.tgz" -C "$OUT" fuzz --exclude=hypothesis-db 2>/dev/null
tail -c 20000 "$OUT/log.txt"
