#!/usr/bin/env bash
# The seeds' bug in FlashAttention 3 form (tests/fuzz/guard/seeds_scenario/test_flash_attn_like.py) on a Hopper GPU,
# plainly and under the guard: plainly both tests pass; under --kvfuzz-guard the seeds' form fails with the unified
# invariant and the fixed form passes. Needs `source benchmarks/gpu_env.sh` (FA3 from `make device-bundle FA3=1`).
# Usage: bash benchmarks/gpu_hopper_seeds.sh
set -uo pipefail
F=tests/fuzz/guard/seeds_scenario/test_flash_attn_like.py
for mode in plain guard; do
  args=(); [ "$mode" = guard ] && args=(--kvfuzz-guard)
  echo "== $F: $mode"
  KVFUZZ_SEEDS_SCENARIO=1 python3 -m pytest -q -p no:cacheprovider -rA "${args[@]}" "$F" 2>&1 \
    | grep -E "PASSED|FAILED|passed|failed|skipped|unified|Error" | cut -c1-300 | head -12
done
