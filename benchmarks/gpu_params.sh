#!/usr/bin/env bash
# Issue 5 on a lent GPU (no network): the Triton targets compiled with the full parameter space (fp8 caches,
# window, ALiBi, sinks, softcap, value ranges), big caches past 2**31 elements, the tolerance calibration and
# the metamorphic relations. Carried (ignored) folder .device/ as for benchmarks/gpu_session.sh.
# Usage: STEPS="fuzz big calibrate relations undeclared" bash benchmarks/gpu_params.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/kvfuzz-gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
TRITON="vllm.chunked_prefill_paged_decode vllm.context_attention_fwd vllm.unified_attention vllm.decode_attention_fwd"
STEPS=${STEPS:-fuzz big calibrate relations undeclared}
S=${SECONDS_PER_RUN:-40}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  for step in $STEPS; do
    echo "=== $step"
    case $step in
      fuzz) for t in $TRITON torch.flex_paged; do
              timeout $((S + 60)) $KV fuzz --target "$t" --max-examples 400 --duration "${S}s" --out "$OUT/fuzz/$t" \
                2>&1 | grep -v "^ *$" | tail -14; done ;;
      big) for t in $TRITON; do
             timeout $((S + 60)) $KV fuzz --big-cache --target "$t" --max-examples 60 --duration "${S}s" \
               --out "$OUT/big/$t" 2>&1 | grep -v "^ *$" | tail -12; done ;;
      calibrate) for t in vllm.unified_attention vllm.chunked_prefill_paged_decode; do
                   timeout $((S + 60)) python3 benchmarks/calibrate_tolerance.py --target "$t" --examples 150 \
                     --json "$OUT/calibrate-$t.json" > /dev/null 2>&1; cat "$OUT/calibrate-$t.json"; done ;;
      relations) for t in $TRITON; do
                   timeout $((S + 60)) $KV relations --target "$t" --max-examples 15 --shrink-time 20 --json "$OUT/relations-$t.json" \
                     2>&1 | grep -v "^ *$" | tail -14; done ;;
      undeclared) for t in vllm.context_attention_fwd vllm.unified_attention; do
                    timeout $((S + 60)) $KV fuzz --undeclared --target "$t" --max-examples 200 --duration "${S}s" \
                      --out "$OUT/undeclared/$t" 2>&1 | grep -v "^ *$" | tail -16; done ;;
    esac
  done
} > "$OUT/log.txt" 2>&1
tar czf "$OUT/reproducers.tgz" -C "$OUT" --exclude=hypothesis-db fuzz big relations undeclared 2>/dev/null
tail -c 20000 "$OUT/log.txt"
