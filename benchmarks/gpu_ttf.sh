#!/usr/bin/env bash
# Time to first failure of plain default campaigns, one seed after another on one GPU (a lane of
# benchmarks/gpu_lanes.sh), with the GPU's busy share sampled every second: issues 51 and 52's goals (FA3's window
# bug on 5 of 5 seeds within 60 s, vllm#56862 within 90 s, each shrunk to at most 2 sequences). TREE "new" runs the
# tree gpu_env.sh installed; "old" installs the tree carried in .old/ (an earlier kvfuzz, for before/after side by
# side in one device call) and runs that. Each seed's campaign: `kvfuzz fuzz --target TARGET --duration SECONDS
# --seed S --out $OUT/TREE-TARGET-S` and nothing else (plain defaults); one line per seed in $OUT/ttf.txt: first
# failure (s), its signature, the reproducer's sequences, the shrink's seconds, examples, examples/s, mean GPU busy.
# Usage: OUT=dir bash benchmarks/gpu_ttf.sh TREE TARGET SECONDS SEED...   (after gpu_env.sh)
set -uo pipefail
TREE=$1 TARGET=$2 SECONDS_=$3
shift 3
R=${OUT:?set OUT}
mkdir -p "$R"
if [ "$TREE" = old ]; then
  [ -d .old ] || { echo "gpu_ttf.sh: no .old/ tree carried" >&2; exit 2; }
  ( flock 9; [ -d /tmp/kv-old/kvfuzz ] || python3 -m pip install -q --no-deps --no-build-isolation --no-index \
      --target /tmp/kv-old ./.old ) 9>/tmp/kv-old.lock || exit 1
  export PYTHONPATH=/tmp/kv-old:${PYTHONPATH#/tmp/kv:}
fi
GPU=${CUDA_VISIBLE_DEVICES:-0}
for S in "$@"; do
  out="$R/$TREE-$TARGET-$S"
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -i "$GPU" -lms 1000 > "$out.util" 2>/dev/null &
  smi=$!
  start=$(date +%s)
  python3 -m kvfuzz.fuzz.cli fuzz --target "$TARGET" --duration "${SECONDS_}s" --seed "$S" --out "$out" \
    > "$out.log" 2>&1
  rc=$?
  kill $smi 2>/dev/null
  python3 - "$out" "$TREE" "$TARGET" "$S" "$rc" "$(( $(date +%s) - start ))" >> "$R/ttf.txt" <<'EOF'
import json, sys
from pathlib import Path
out, tree, target, seed, rc, wall = sys.argv[1:]
try:
    s = json.loads((Path(out) / "summary.json").read_text())
except (OSError, ValueError) as e:
    print(f"{tree} {target} seed {seed}: exit {rc}, no summary ({e})")
    sys.exit()
t = next(x for x in s["targets"] if x["target"] == target)
util = [int(x) for x in Path(out + ".util").read_text().split() if x.isdigit()] if Path(out + ".util").exists() else []
busy = round(sum(util) / len(util), 1) if util else None
fails = []
for f in t["failures"]:
    case = Path(f.get("reproducer") or "") / "case.json"
    seqs = shrink = None
    if case.exists():
        c = json.loads(case.read_text())
        seqs = len(c["example"]["batch"]["query_lens"])
        shrink = ((c.get("details") or {}).get("structural_shrink") or {}).get("seconds")
    fails.append(f"{f['kind']}/{f['check']} seqs={seqs} shrink_s={shrink}")
print(f"{tree} {target} seed {seed}: exit {rc}, wall {wall} s, first failure {t['first_failure_s']} s, "
      f"{t['examples']} examples ({t['examples_per_s']}/s), GPU busy {busy}%, failures: {'; '.join(fails) or 'none'}")
EOF
  # what comes back from a device call is small: the summary, each reproducer's case.json and the logs
  rm -rf "$out/hypothesis-db" "$out/workers" "$out"/*/tensors.safetensors "$out"/*.png
done
cat "$R/ttf.txt"
