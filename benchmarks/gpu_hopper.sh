#!/usr/bin/env bash
# The Hopper-only targets on one lent H100/H200 (no network), in one device call of about 8 minutes:
# vllm.flash_attn_varlen (FlashAttention 3, as vLLM's FLASH_ATTN backend calls it) and vllm.flashmla_decode
# (FlashMLA's dense decode, as vLLM's FLASHMLA backend calls it).
#   1. source benchmarks/gpu_env.sh: installs .device/ (built with `make device-bundle FA3=1`: .device/hopper/ holds
#      the xz-packed extensions, unpacked into the carried vllm tree)
#   2. the targets' availability (`kvfuzz targets --check`) and a smoke run of fixed examples
#      (benchmarks/hopper_smoke.py: one line per example, every split choice of FA3 among them)
#   3. a campaign per target: `kvfuzz fuzz --target T --duration ${FUZZ_SECONDS}s --out OUT/fuzz/T`
#   4. vLLM's own tests of both kernels, plainly and under the guard (benchmarks/upstream_suites.sh; the test tree at
#      $UPSTREAM, e.g. a carried .upstream/vllm-0.33.0): test_flash_attn.py -k "3-2048" (FA3, 2048 blocks: 160
#      cases, fp8 queries among them) and test_flashmla.py -k "1-16-4096" (16 heads, 4096 tokens: 12 cases)
# Writes OUT/log.txt (printed at the end, compact), OUT/smoke.json, OUT/fuzz/<target>/ (summary.json, reproducers),
# OUT/upstream/ (upstream.md, upstream.json, the guard's reports).
# Usage: bash benchmarks/gpu_hopper.sh OUTDIR   (env: FUZZ_SECONDS per target, default 75; UPSTREAM, default
#        .upstream/vllm-0.33.0; UPSTREAM_WORKERS, default 4)
set -uo pipefail
OUT=${1:-/tmp/kvfuzz-gpu-hopper}
S=${FUZZ_SECONDS:-75}
UPSTREAM=${UPSTREAM:-.upstream/vllm-0.33.0}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
[ -f /tmp/vllm/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ] || echo "gpu_hopper: no FA3 extension unpacked (build .device with FA3=1)"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  t0=$(date +%s)
  timeout 120 $KV targets --check | grep -E "^target|^vllm\.(flash_attn_varlen|flashmla_decode)" | cut -c1-400
  timeout 180 python3 benchmarks/hopper_smoke.py "$OUT/smoke.json" 2>&1 | grep -v "^ *$" | cut -c1-600
  echo "setup + smoke: $(( $(date +%s) - t0 )) s"
  for t in vllm.flash_attn_varlen vllm.flashmla_decode; do
    echo "== fuzz $t (${S}s)"
    timeout $((S + 60)) $KV fuzz --target "$t" --max-examples 100000 --duration "${S}s" --out "$OUT/fuzz/$t" \
      2>&1 | grep -v "^ *$" | tail -20 | cut -c1-400
  done
  if [ -d "$UPSTREAM/tests/kernels/attention" ]; then
    timeout 150 bash benchmarks/upstream_suites.sh -n "${UPSTREAM_WORKERS:-4}" -o "$OUT/upstream/fa" "$UPSTREAM" \
      tests/kernels/attention/test_flash_attn.py -- -k "3-2048" 2>&1 | tail -15 | cut -c1-400
    timeout 120 bash benchmarks/upstream_suites.sh -n 2 -o "$OUT/upstream/flashmla" "$UPSTREAM" \
      tests/kernels/attention/test_flashmla.py -- -k "1-16-4096" 2>&1 | tail -15 | cut -c1-400
  else
    echo "gpu_hopper: no upstream test tree at $UPSTREAM (carry .upstream, or set UPSTREAM=)"
  fi
  echo "total: $(( $(date +%s) - t0 )) s"
} > "$OUT/log.txt" 2>&1
tar czf "$OUT/reproducers.tgz" -C "$OUT" --exclude=hypothesis-db fuzz 2>/dev/null
tail -c 11000 "$OUT/log.txt"
