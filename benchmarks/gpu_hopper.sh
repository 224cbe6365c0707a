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
# Writes into OUT only what is worth carrying back: OUT/log.txt (printed at the end, compact), OUT/smoke.json,
# OUT/<target>.summary.json, OUT/campaigns.tgz (the campaigns' folders without their Hypothesis databases:
# reproducers, report.md), OUT/upstream/ (upstream.md, upstream.json, the guard's reports, the pytest logs); the
# campaigns themselves run in $WORK (default /tmp/kvfuzz-gpu-hopper-work).
# Every step's timeout is cut to what is left of BUDGET seconds (default 560: a device call's command may run 600),
# so the log is complete even when a step is slow.
# Usage: bash benchmarks/gpu_hopper.sh OUTDIR   (env: FUZZ_SECONDS per target, default 60; UPSTREAM, default
#        .upstream/vllm-0.33.0; UPSTREAM_WORKERS, default 4; BUDGET, default 560)
set -uo pipefail
START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-560}))
# tmo N: N seconds, or what is left before DEADLINE if less (at least 1)
tmo() { local left=$((DEADLINE - $(date +%s))); [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"; }
OUT=${1:-/tmp/kvfuzz-gpu-hopper}
S=${FUZZ_SECONDS:-60}
UPSTREAM=${UPSTREAM:-.upstream/vllm-0.33.0}
WORK=${WORK:-/tmp/kvfuzz-gpu-hopper-work}
mkdir -p "$OUT" "$WORK"
source benchmarks/gpu_env.sh
[ -f /tmp/vllm/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ] || echo "gpu_hopper: no FA3 extension unpacked (build .device with FA3=1)"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  t0=$START
  timeout "$(tmo 120)" $KV targets --check | grep -E "^target|^vllm\.(flash_attn_varlen|flashmla_decode)" | cut -c1-400
  timeout "$(tmo 180)" python3 benchmarks/hopper_smoke.py "$OUT/smoke.json" 2>&1 | grep -v "^ *$" | cut -c1-600
  echo "setup + smoke: $(( $(date +%s) - t0 )) s"
  for t in vllm.flash_attn_varlen vllm.flashmla_decode; do
    d=$(( $(tmo $((S + 45))) - 45 ))   # the campaign's length: FUZZ_SECONDS, or less when time runs short
    [ "$d" -ge 10 ] || { echo "== fuzz $t: skipped (no time left)"; continue; }
    echo "== fuzz $t (${d}s)"
    timeout $((d + 45)) $KV fuzz --target "$t" --max-examples 100000 --duration "${d}s" --out "$WORK/fuzz/$t" \
      2>&1 | grep -v "^ *$" | tail -20 | cut -c1-400
    cp "$WORK/fuzz/$t/summary.json" "$OUT/$t.summary.json" 2>/dev/null
  done
  if [ -d "$UPSTREAM/tests/kernels/attention" ]; then
    timeout "$(tmo 200)" bash benchmarks/upstream_suites.sh -n "${UPSTREAM_WORKERS:-4}" -o "$OUT/upstream/fa" "$UPSTREAM" \
      tests/kernels/attention/test_flash_attn.py -- -k "3-2048" 2>&1 | tail -15 | cut -c1-400
    timeout "$(tmo 150)" bash benchmarks/upstream_suites.sh -n 2 -o "$OUT/upstream/flashmla" "$UPSTREAM" \
      tests/kernels/attention/test_flashmla.py -- -k "1-16-4096" 2>&1 | tail -15 | cut -c1-400
  else
    echo "gpu_hopper: no upstream test tree at $UPSTREAM (carry .upstream, or set UPSTREAM=)"
  fi
  echo "total: $(( $(date +%s) - t0 )) s"
} > "$OUT/log.txt" 2>&1
tar czf "$OUT/campaigns.tgz" -C "$WORK" --exclude=hypothesis-db fuzz 2>/dev/null
tail -c 11000 "$OUT/log.txt"
