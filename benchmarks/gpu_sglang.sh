#!/usr/bin/env bash
# SGLang's Triton targets compiled on one lent GPU (no network): install kvfuzz from this tree (the GPU image
# already has torch, triton, hypothesis, attrs, click, rich, numpy and safetensors), point KVFUZZ_SGLANG_TREE at
# the carried kernel files (.device/sglang/: `cp -r .venv/share/kvfuzz/sglang .device/` here, then carry
# .device/sglang), list the targets, fuzz both, fuzz decode's undeclared configurations (fp8 with GQA among them),
# and run the SGLang seeds scenario under the pytest plugin.
# Usage: bash benchmarks/gpu_sglang.sh OUTDIR   (FUZZ_SECONDS per target, default 100)
set -uo pipefail
OUT=${1:-/tmp/kvfuzz-gpu-sglang}
S=${FUZZ_SECONDS:-100}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kv . || exit 1
export PYTHONPATH=/tmp/kv KVFUZZ_SGLANG_TREE=${KVFUZZ_SGLANG_TREE:-$PWD/.device/sglang}
KV="python3 -m kvfuzz.fuzz.cli"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, hypothesis; print('torch', torch.__version__, 'triton', triton.__version__, \
'hypothesis', hypothesis.__version__)"
  $KV targets | grep -E "^target|^sglang"
  for t in sglang.extend_attention_fwd sglang.decode_attention_fwd; do
    timeout $((S + 90)) $KV fuzz --target "$t" --max-examples 3000 --duration "${S}s" --out "$OUT/fuzz/$t" \
      2>&1 | grep -v "^ *$" | tail -25
  done
  timeout 150 $KV fuzz --undeclared --target sglang.decode_attention_fwd --max-examples 500 --duration 60s \
    --out "$OUT/undeclared" 2>&1 | grep -v "^ *$" | tail -25
  KVFUZZ_SEEDS_SCENARIO=1 timeout 120 python3 -m pytest -q -rA -p no:cacheprovider --kvfuzz-guard \
    tests/fuzz/guard/seeds_scenario/test_sglang_like.py 2>&1 | grep -E "PASSED|FAILED|passed|failed|violated|checked" | cut -c1-300
} > "$OUT/log.txt" 2>&1
tar czf "$OUT/reproducers.tgz" -C "$OUT" --exclude=hypothesis-db fuzz undeclared 2>/dev/null
tail -c 11000 "$OUT/log.txt"
