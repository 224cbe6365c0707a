#!/usr/bin/env bash
# FlashAttention 2 and 4 and the merge_attn_states family on one lent GPU (no network), each step one device call of at
# most ~9 minutes. First stage FA2's extension and FA4's packages (bash benchmarks/fa_bundle.sh here, then one call per
# part: bash benchmarks/fa_stage.sh), then carry .device (make device-bundle FA3=1) and run a step:
#   check            `kvfuzz targets --check` for the new targets, and one short campaign (60 s) each of FA2 and FA4,
#                    which also fills the driver's JIT cache for FA2's PTX (kept in .fa-stage/nv-cache) and FA4's
#                    CuTe-DSL compiles
#   fuzz TARGET [S]  `kvfuzz fuzz --target TARGET --duration S(300)s --baseline kvfuzz-baseline.toml --out OUT/TARGET`
#                    (the 5-minute default campaign the goals ask for; summary.json and report.md land in OUT)
#   upstream         vLLM's test_flash_attn.py, its 320 fa_version=2 cases (fa_version is the second parameter of
#                    test_varlen_with_paged_kv: ids "None-2-..." (160 run) and "q_dtype1-2-..." (160, fp8 queries, which the
#                    test skips on FA2)), plainly and under --kvfuzz-guard
#                    (benchmarks/upstream_suites.sh, 3 workers; the tree at $UPSTREAM, e.g. a carried
#                    .upstream/vllm-0.33.0 from benchmarks/upstream_tests.sh)
#   planted [CLASS]  a planted defect of tests/support/planted_fa.py (default AlibiDroppedOnDecodeFA2: ALiBi left out
#                    of decode calls; SinksDroppedOnDecodeFA4: FA4's sinks left out of decode calls) found and shrunk
#                    by a 240 s campaign, and its standalone.py run without kvfuzz
# Writes into OUT (default /tmp/kvfuzz-gpu-fa): log.txt and each step's files.
# Usage: bash benchmarks/gpu_fa.sh STEP [ARGS]   (env: OUT, UPSTREAM, BUDGET seconds per step, default 540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvfuzz-gpu-fa}
UPSTREAM=${UPSTREAM:-.upstream/vllm-0.33.0}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
[ -d .fa-stage/unpacked/fa2 ] || echo "gpu_fa: no .fa-stage/unpacked (run benchmarks/fa_stage.sh with every part first)"
source benchmarks/gpu_env.sh
log() { echo "$*" | tee -a "$OUT/log.txt"; }
step=${1:-check}
case "$step" in
  check)
    $KV targets --check 2>&1 | grep -E "flash_attn|merge" | cut -c1-400 | tee -a "$OUT/log.txt"
    for t in vllm.flash_attn_varlen_fa2 vllm.flash_attn_varlen_fa4; do
      s=$(date +%s)
      timeout 240 $KV fuzz --target "$t" --duration 60s --out "$OUT/check-$t" > "$OUT/check-$t.log" 2>&1
      log "$t: exit $? after $(( $(date +%s) - s )) s (60 s campaign; first calls compile); $(tail -1 "$OUT/check-$t.log")"
    done ;;
  fuzz)
    t=${2:?gpu_fa.sh fuzz TARGET [SECONDS]}
    timeout "$BUDGET" $KV fuzz --target "$t" --duration "${3:-300}s" --baseline kvfuzz-baseline.toml \
      --out "$OUT/$t" > "$OUT/$t.log" 2>&1
    log "$t: exit $? ($(grep -m1 -o '[0-9]* examples.*' "$OUT/$t.log" | tail -1))"
    tail -25 "$OUT/$t.log" | cut -c1-300 ;;
  upstream)
    [ -d "$UPSTREAM" ] || { log "gpu_fa: no $UPSTREAM (bash benchmarks/upstream_tests.sh where pip works, carry it)"; exit 2; }
    timeout "$BUDGET" bash benchmarks/upstream_suites.sh -n 3 -o "$OUT/upstream" "$UPSTREAM" \
      tests/kernels/attention/test_flash_attn.py -- -k "None-2- or q_dtype1-2-" 2>&1 | tail -30 | tee -a "$OUT/log.txt" ;;
  planted)
    timeout "$BUDGET" $KV fuzz --target "tests/support/planted_fa.py:${2:-AlibiDroppedOnDecodeFA2}" --duration 240s \
      --out "$OUT/planted" > "$OUT/planted.log" 2>&1
    log "planted defect ${2:-AlibiDroppedOnDecodeFA2}: exit $? (1: found)"
    for d in "$OUT"/planted/test.fa*; do
      [ -d "$d" ] || continue
      python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print(c['kind'], c['check'], c['example']['batch'])" \
        "$d/case.json" | cut -c1-400 | tee -a "$OUT/log.txt"
      fa4=$PWD/.fa-stage/unpacked/fa4-site  # FA4's packages (the standalone needs them as vLLM does, not kvfuzz)
      (cd "$d" && env -u PYTHONPATH PYTHONPATH=/tmp/site:/tmp/vllm:$fa4/nvidia_cutlass_dsl/dsl_packages:$fa4 \
        python3 standalone.py) 2>&1 | tail -3 | tee -a "$OUT/log.txt"
    done ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
