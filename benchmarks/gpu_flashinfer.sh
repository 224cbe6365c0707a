#!/usr/bin/env bash
# FlashInfer on a lent GPU (issue 20), ~8 minutes, one call: versions; `kvfuzz targets`; the first call of each
# FlashInfer target timed (JIT compile into $FLASHINFER_WORKSPACE_BASE, then a second call) through kvfuzz's own
# property on one hand-made batch per target, in the compile configuration its campaign's first chunk pins
# (so the campaign finds the module compiled); a short campaign per target; the FlashInfer seeds scenario under
# `pytest --kvfuzz-guard`. Needs .device/ with flashinfer.tgz (make device-bundle FLASHINFER=1).
# Writes under $OUT (the run tool's folder; default /tmp/fi-out).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/fi-out}
mkdir -p "$OUT"
[ -f .device/flashinfer.tgz ] || { echo "gpu_flashinfer.sh: no .device/flashinfer.tgz (make device-bundle FLASHINFER=1)" >&2; exit 1; }
t0=$SECONDS
step() { echo; echo "=== [$((SECONDS - t0))s] $*"; }

step versions
python3 - <<'EOF'
import torch, tvm_ffi, flashinfer
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("flashinfer", flashinfer.__version__, "from", flashinfer.__file__, "tvm_ffi", getattr(tvm_ffi, "__version__", "?"))
EOF
nvcc --version 2>&1 | tail -2; which ninja || echo "no ninja on PATH"

step "kvfuzz targets"
$KV targets | grep -E "^flashinfer|^target" ; $KV targets --check 2>&1 | grep -E "^flashinfer"

step "first calls: JIT compile, then a second call (kvfuzz property on one batch each)"
timeout 240 python3 - <<'EOF' 2>&1 | tee "$OUT/first_calls.txt"
import time, torch
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets.registry import get_target

def table(lens, bs):
    rows, k = [], 0
    for n in lens:
        p = -(-n // bs); rows.append(list(range(k, k + p))); k += p
    w = max(len(r) for r in rows)
    return [r + [0] * (w - len(r)) for r in rows], k
# the compile keys of each campaign's first pinned configuration (seeds below; strategies/configs.py config_for)
cases = {
    "flashinfer.batch_decode": dict(query_lens=[1, 1, 1], ctx_lens=[130, 6, 0], num_heads=8, num_kv_heads=1,
                                    head_size=128, block_size=1, kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                                    v_scale=2.0, sliding_window=108, softcap=30.0),
    "flashinfer.batch_prefill": dict(query_lens=[5, 1, 17], ctx_lens=[7, 10, 0], num_heads=16, num_kv_heads=2,
                                     head_size=128, block_size=3, sliding_window=2, softcap=30.0),
    "flashinfer.append_paged_kv_cache": dict(query_lens=[5, 1], ctx_lens=[7, 10], num_heads=7, num_kv_heads=1,
                                             head_size=128, block_size=1, kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                                             v_scale=2.0),
}
for name, kw in cases.items():
    t = get_target(name)
    lens = [q + c for q, c in zip(kw["query_lens"], kw["ctx_lens"])]
    bt, nb = table(lens, kw["block_size"])
    for seed in (0, 1, 2, 3):  # the four cache forms: NHD/HND x 5-D/(k, v)
        b = Batch(block_table=bt, num_blocks=nb + 1, dtype="float16", seed=seed, **kw)
        s = time.perf_counter()
        try:
            run = properties.check(t, Example(b, Poison.NAN))
            verdict = "pass"
        except Exception as e:
            verdict = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.synchronize()
        print(f"{name} seed {seed} ({t.path(b)}): {time.perf_counter() - s:.2f} s, {verdict}", flush=True)
EOF

# seeds whose first pinned configuration is the one compiled above (decode: fp16 H7/1 D128 fp8_e4m3 page 1 window
# + softcap; prefill: fp16 H16/2 D128 auto page 3 window + softcap; writer: its seed-26 configuration)
for spec in flashinfer.batch_decode:26 flashinfer.batch_prefill:35 flashinfer.append_paged_kv_cache:26; do
  T=${spec%%:*} S=${spec##*:}
  step "campaign $T (seed $S)"
  s=$SECONDS
  timeout 100 $KV fuzz --target "$T" --seed "$S" --workers 1 --max-examples 150 --duration 40s --out "$OUT/$T" \
    --jit-cache "$FLASHINFER_WORKSPACE_BASE" 2>&1 | tail -25
  echo "exit ${PIPESTATUS[0]}, $((SECONDS - s)) s"
done

step "seeds scenario under the guard (the unfixed test must FAIL with the unified invariant, the fixed one PASS)"
KVFUZZ_SEEDS_SCENARIO=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 90 python3 -m pytest -q -rA -p no:cacheprovider \
  -p kvfuzz.fuzz.guard.plugin --kvfuzz-guard tests/seeds_scenario/test_flashinfer_like.py 2>&1 | tail -30
step "seeds scenario without the guard (both PASS)"
KVFUZZ_SEEDS_SCENARIO=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 60 python3 -m pytest -q -rA -p no:cacheprovider \
  tests/seeds_scenario/test_flashinfer_like.py 2>&1 | tail -5
step done
