#!/usr/bin/env bash
# Issue 51's harness costs before and after, the two trees side by side in one device call (benchmarks/harness_speed.py):
# the earlier tree carried in .old/ (as benchmarks/gpu_ttf.sh takes it) draws the examples of each target and tier
# (small and serving), this tree replays exactly those, then each replays them once more in the other order, so a
# warm-up or a busy moment favours neither. Prints per target and tier: the verdicts (identical or not, reference bits
# equal), ms per example, and per stage ms, torch operators, host reads and the synchronizations CUDA reports, before
# -> after; keeps every JSON in OUT. WORK=N: one more replay of this tree with KVFUZZ_GPU_REFERENCE_MIN_WORK=N (a small
# batch's reference on the GPU by its arithmetic, kvfuzz.fuzz.harness.run.reference_work), compared with this tree's.
# CAMPAIGN=N (0: none): then per target benchmarks/campaign_speed.py, the campaign's own path (Hypothesis, the runner,
# the worker's pipe: the draw, hypothesis and other stages), N small and N/4 serving examples, old, new, new, old.
# TIERS: the tiers (default "small serving"); HARNESS=0: the campaign runs alone, no harness_speed.py replays.
# Usage: OUT=dir [TARGETS="vllm.flash_attn_varlen vllm.unified_attention"] [SMALL=200] [SERVING=60] [COUNT=40]
#        [WORK=4194304] [CAMPAIGN=300] [TIERS=small] [HARNESS=0] bash benchmarks/gpu_harness_speed.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
gpu_out
gpu_machine | tee "$R/machine.txt"
[ -d .old ] || { echo "gpu_harness_speed.sh: no .old/ tree carried" >&2; exit 2; }
( flock 9; [ -d /tmp/kv-old/kvfuzz ] || python3 -m pip install -q --no-deps --no-build-isolation --no-index \
    --target /tmp/kv-old ./.old > "$W/pip-old.log" 2>&1 ) 9>/tmp/kv-old.lock || { tail -5 "$W/pip-old.log"; exit 1; }
NEW_PATH=$PYTHONPATH
OLD_PATH=$(echo ":$PYTHONPATH:" | sed 's#:/tmp/kv:#:/tmp/kv-old:#; s#^:##; s#:$##')  # gpu_env.sh put this tree in /tmp/kv
export TRITON_CACHE_DIR=$W/triton
S=benchmarks/harness_speed.py
for T in ${TARGETS:-vllm.flash_attn_varlen vllm.unified_attention}; do
  for tier in ${TIERS:-small serving}; do
    [ "${HARNESS:-1}" = 1 ] || continue
    n=$([ $tier = small ] && echo "${SMALL:-200}" || echo "${SERVING:-60}")
    tag=${T#vllm.}-$tier
    # the earlier tree draws, and fills the Triton cache (this pass is not compared); then the four replays
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
    if [ -n "${WORK:-}" ]; then
      KVFUZZ_GPU_REFERENCE_MIN_WORK=$WORK PYTHONPATH=$NEW_PATH timeout 580 python3 $S --replay "$R/$tag-draw.json" \
        --count "${COUNT:-40}" --out "$R/$tag-work.json" > "$R/$tag-work.log" 2>&1 || echo "$tag work failed"
      echo "######## $tag (this tree, then with KVFUZZ_GPU_REFERENCE_MIN_WORK=$WORK)"
      python3 $S --compare "$R/$tag-new2.json" "$R/$tag-work.json"
    fi
  done
  [ "${CAMPAIGN:-0}" -gt 0 ] || continue
  for tier in ${TIERS:-small serving}; do
    n=$([ $tier = small ] && echo "$CAMPAIGN" || echo $(( (CAMPAIGN + 3) / 4 )))
    tag=${T#vllm.}-campaign-$tier
    for side in old new new2 old2; do
      P=$NEW_PATH; case $side in old*) P=$OLD_PATH;; esac
      PYTHONPATH=$P timeout 580 python3 benchmarks/campaign_speed.py --target "$T" --tier $tier --examples "$n" \
        --clock wall --out "$R/$tag-$side.json" > "$R/$tag-$side.log" 2>&1 \
        || { echo "$tag $side failed"; tail -3 "$R/$tag-$side.log"; }
    done
    echo "######## $tag (the campaign's path: old, new, new, old)"
    python3 benchmarks/campaign_speed.py --compare "$R/$tag-old.json" "$R/$tag-new.json" "$R/$tag-new2.json" \
      "$R/$tag-old2.json"
  done
done
