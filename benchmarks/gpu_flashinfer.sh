#!/usr/bin/env bash
# FlashInfer on a lent GPU (issue 20), one device call of about 8 minutes (BUDGET 400 s + ~1 min of set-up):
# versions; `kvfuzz targets`; benchmarks/flashinfer_speed.py: for each FlashInfer target a cold campaign (an empty
# JIT cache) and a warm one (the cache the cold one left), their examples/s, the compile time of every JIT module
# they built, what they drew (declared dtypes, kv_cache_dtypes, head and page sizes, features, GQA groups), then the
# replay of regressions/flashinfer.batch_decode-config-rejected-* (group size 7: expected "rejected as recorded",
# exit 0). It degrades gracefully: every phase is written when it ends, a phase that has no time left is skipped
# (said), and a SIGTERM (the `timeout` below) stops the phase in flight and keeps what it counted.
# Needs .device/ with flashinfer.tgz (FLASHINFER=1 make device-bundle, or bash benchmarks/flashinfer_bundle.sh).
# Env: OUT (default /tmp/fi-out), BUDGET (seconds for the benchmark, default 400), TARGETS (space-separated names,
# default the four: append_paged_kv_cache, batch_decode, batch_prefill, batch_decode_tc), SEED (default 1),
# SCENARIO=1 (also the FlashInfer seeds scenario with and without the guard: about 2 minutes more).
# Writes under $OUT: flashinfer-speed.json, flashinfer-speed.md, flashinfer-speed.log (this script's output),
# flashinfer-campaign-logs.tgz (each campaign's log and workers' logs).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/fi-out}
BUDGET=${BUDGET:-400}
mkdir -p "$OUT"
[ -f .device/flashinfer.tgz ] || { echo "gpu_flashinfer.sh: no .device/flashinfer.tgz (FLASHINFER=1 make device-bundle)" >&2; exit 1; }
exec > >(tee "$OUT/flashinfer-speed.log") 2>&1
t0=$SECONDS
step() { echo; echo "=== [$((SECONDS - t0))s] $*"; }

step versions
timeout 90 python3 - <<'EOF'
import torch, tvm_ffi, flashinfer
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("flashinfer", flashinfer.__version__, "from", flashinfer.__file__, "tvm_ffi", getattr(tvm_ffi, "__version__", "?"))
EOF
nvcc --version 2>&1 | tail -2; which ninja || echo "no ninja on PATH"; nproc

step "kvfuzz targets"
$KV targets | grep -E "^flashinfer|^target"

step "cold and warm campaigns (budget ${BUDGET} s)"
args=()
for t in ${TARGETS:-}; do args+=(--target "$t"); done
timeout -k 60 $((BUDGET + 120)) python3 benchmarks/flashinfer_speed.py --out "$OUT" --budget "$BUDGET" \
  --seed "${SEED:-1}" --root /tmp/fi-speed ${args[@]+"${args[@]}"}
echo "flashinfer_speed.py exit $?"
tar czf "$OUT/flashinfer-campaign-logs.tgz" -C /tmp/fi-speed --exclude='jit' --exclude='hypothesis-db' \
  --exclude='*.safetensors' . 2>/dev/null || echo "no campaign logs"

if [ "${SCENARIO:-0}" = 1 ]; then
  step "seeds scenario under the guard (the unfixed test must FAIL with the unified invariant, the fixed one PASS)"
  KVFUZZ_SEEDS_SCENARIO=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 120 python3 -m pytest -q -rA -p no:cacheprovider \
    -p kvfuzz.fuzz.guard.plugin --kvfuzz-guard tests/fuzz/guard/seeds_scenario/test_flashinfer_like.py 2>&1 | tail -30
  step "seeds scenario without the guard (both PASS)"
  KVFUZZ_SEEDS_SCENARIO=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 60 python3 -m pytest -q -rA -p no:cacheprovider \
    tests/fuzz/guard/seeds_scenario/test_flashinfer_like.py 2>&1 | tail -5
fi
step done
