#!/usr/bin/env bash
# One lane of the sanitizer's before/after on a multi-GPU host (benchmarks/gpu_lanes.sh, one lane a tree, side by
# side): a `kvfuzz fuzz --target vllm.unified_attention --duration SECONDS --seed SEED --baseline kvfuzz-baseline.toml`
# campaign (vllm#56862 known, so a hit is not shrunk and the run ends on time), stopped with SIGTERM 50 s past its
# duration, then its sanitize stage by phase (benchmarks/sanitize_phases.py) into OUT/phases.txt. TREE "old" installs
# the earlier tree carried in .old/ and runs that; "new" runs the tree gpu_env.sh installed. E.g. in one device call:
#   OUT=$OUT LANE_TIMEOUT=200 bash benchmarks/gpu_lanes.sh 'bash benchmarks/gpu_sanitize_ab.sh old 120 1' \
#     'bash benchmarks/gpu_sanitize_ab.sh new 120 1'
# Usage: OUT=dir bash benchmarks/gpu_sanitize_ab.sh TREE SECONDS SEED   (after gpu_env.sh)
set -u
R=${OUT:?set OUT}
if [ "$1" = old ]; then
  [ -d .old ] || { echo "gpu_sanitize_ab.sh: no .old/ tree carried" >&2; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kv-old ./.old >/dev/null 2>&1
  export PYTHONPATH=/tmp/kv-old:${PYTHONPATH#/tmp/kv:}
fi
python3 -c "import kvfuzz; print(kvfuzz.__file__)"
timeout -s TERM $(( $2 + 50 )) python3 -m kvfuzz.fuzz.cli fuzz --target vllm.unified_attention --duration "$2s" \
  --seed "$3" --baseline kvfuzz-baseline.toml --out "$R/run" > "$R/run.log" 2>&1
echo "exit $?"
python3 "$(dirname "$0")/sanitize_phases.py" "$R/run/summary.json" | tee "$R/phases.txt"
rm -rf "$R/run/hypothesis-db" "$R/run/workers"; find "$R/run" -name "*.safetensors" -delete
