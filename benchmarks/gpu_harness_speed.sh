#!/usr/bin/env bash
# Before/after of benchmarks/harness_speed.py on one lent GPU, the two trees side by side in one call: an earlier tree
# carried as an ignored folder (OLD, default .main: e.g. `git -C /work/main archive HEAD | tar x -C .main`) and this
# tree. The earlier tree draws the examples (vllm.flash_attn_varlen and vllm.unified_attention, small and serving
# tiers), this tree replays exactly those; then each replays them once more in the other order, so a warm-up or a
# busy GPU does not favour one side. Prints the comparison (verdicts identical or not; ms, torch operators, host
# reads and CUDA syncs per example per stage) and keeps every JSON in OUT.
# Usage: OUT=dir [OLD=.main] [SMALL=200] [SERVING=60] [COUNT=40] [TARGETS="vllm.flash_attn_varlen vllm.unified_attention"]
#        bash benchmarks/gpu_harness_speed.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed (no .device bundle?)"; exit 1; }
R=${OUT:?set OUT}
OLD=${OLD:-.main}
mkdir -p "$R"
[ -f "$OLD/setup.py" ] || { echo "no earlier tree in $OLD (carry main's tree there)"; exit 1; }
rm -rf /tmp/kv-old
(cd "$OLD" && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kv-old .) \
  > /tmp/kv-old.log 2>&1 || { echo "installing $OLD failed:"; tail -5 /tmp/kv-old.log; exit 1; }
NEW_PATH=$PYTHONPATH
OLD_PATH=$(echo ":$PYTHONPATH:" | sed 's#:/tmp/kv:#:/tmp/kv-old:#; s#^:##; s#:$##')  # gpu_env.sh installed this tree in /tmp/kv
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc-harness-speed}
S=benchmarks/harness_speed.py
for T in ${TARGETS:-vllm.flash_attn_varlen vllm.unified_attention}; do
  for tier in small serving; do
    n=$([ $tier = small ] && echo "${SMALL:-200}" || echo "${SERVING:-60}")
    tag=${T#vllm.}-$tier
    # the earlier tree draws (and fills the Triton cache: its first pass is not compared), then alternate
    PYTHONPATH=$OLD_PATH timeout 580 python3 $S --target "$T" --tier $tier --examples "$n" --out "$R/$tag-draw.json" \
      > "$R/$tag-draw.log" 2>&1 || { echo "$tag: draw failed"; tail -3 "$R/$tag-draw.log"; continue; }
    for side in old new new2 old2; do
      P=$NEW_PATH; case $side in old*) P=$OLD_PATH;; esac
      PYTHONPATH=$P timeout 580 python3 $S --replay "$R/$tag-draw.json" --count "${COUNT:-40}" --out "$R/$tag-$side.json" \
        > "$R/$tag-$side.log" 2>&1 || { echo "$tag $side failed"; tail -3 "$R/$tag-$side.log"; }
    done
    echo "######## $tag (first pair: old then new)"
    python3 $S --compare "$R/$tag-old.json" "$R/$tag-new.json" --out "$R/$tag-compare.json"
    python3 -c "import json, sys; print('trees:', *(json.load(open(p))['kvfuzz'] for p in sys.argv[1:]))" \
      "$R/$tag-old.json" "$R/$tag-new.json"
    echo "######## $tag (second pair: new then old)"
    python3 $S --compare "$R/$tag-old2.json" "$R/$tag-new2.json" | grep -E "verdicts|ms per example"
  done
done
