#!/usr/bin/env bash
# Plain default campaigns (kvfuzz fuzz's defaults: workers, MPS, --tier auto, --sanitize auto) of each target in
# TARGETS for each seed in SEEDS (default 0), SECS seconds each (default 100), one after another, for issue 40's
# "no harness error of kvfuzz's own" and issue 39's "found by a plain campaign". Per run, from summary.json: exit
# status, wall seconds against --duration, examples and examples/s, examples sanitized (the "sanitize" coverage
# label), skipped for memory, lost, problems (harness errors, flaky reports), and each failure (kind, check, known,
# first failure s, the shrunk batch). Writes OUT/soak.txt (and OUT/soak.jsonl). Carry .device/.
# EXTRA: more `kvfuzz fuzz` arguments (e.g. "--sanitize 0" for a sanitizer-off A/B run; TAG names such runs apart).
# Each campaign's output goes to OUT/TAG<target>-<seed>.log with the epoch second before every line, so
# benchmarks/sanitize_cost.py can compare examples/s over the same window of two runs (progress every 10 s).
# PARALLEL=1 runs every campaign at once (give each fewer workers through EXTRA, e.g. "--workers 4"), each stopped
# PAD seconds past SECS (default 240).
# Usage: OUT=dir TARGETS="vllm.unified_attention ..." SEEDS="0 1" SECS=100 [EXTRA=...] [TAG=...] [PARALLEL=1] [PAD=s]
#        bash benchmarks/gpu_soak.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || exit 1
mkdir -p "${OUT:?set OUT to the folder the results go to}" || exit 1
one() {  # target seed
    local t=$1 s=$2 name d start rc
    name=${TAG:-}$(echo "$t" | tr -c 'A-Za-z0-9._-' '_')-$s
    d=/tmp/soak-$name
    start=$(date +%s)
    # shellcheck disable=SC2086  # EXTRA is a list of arguments
    timeout $(( ${SECS:-100} + ${PAD:-240} )) $KV fuzz --target "$t" --seed "$s" --duration "${SECS:-100}s" --out "$d" \
      ${EXTRA:-} 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(date +%s)" "$line"; done > "$d.log"
    rc=${PIPESTATUS[0]}
    cp "$d.log" "$OUT/$name.log" 2>/dev/null
    python3 - "$d" "$t" "$s" "$rc" "$(( $(date +%s) - start ))" "${SECS:-100}" <<'PY' | tee -a "$OUT/soak.txt"
import json, os, sys
d, t, s, rc, wall, secs = sys.argv[1:7]
try:
    doc = json.load(open(f"{d}/summary.json"))
    x = doc["targets"][0]
except (OSError, ValueError, KeyError, IndexError) as e:
    print(f"{t} seed {s}: exit {rc}, {wall} s, no summary ({e})")
    sys.exit(0)
row = {"target": t, "seed": int(s), "extra": os.environ.get("EXTRA", ""), "exit": int(rc), "wall_s": int(wall), "duration_s": int(secs),
       "examples": x.get("examples"), "examples_per_s": x.get("examples_per_s"),
       "sanitized": (x.get("coverage", {}).get("sanitize") or {}).get("memcheck", 0),
       "skipped_memory": x.get("skipped_for_memory"), "lost": x.get("lost"),
       "problems": [str(p)[:300] for p in doc.get("problems", [])], "worker_restarts": doc.get("worker_restarts"),
       "warnings": [str(w)[:200] for w in doc.get("warnings", [])],
       "first_failure_s": x.get("first_failure_s"),
       "failures": [{"kind": f["kind"], "check": f["check"], "known": f.get("known"), "batch": f["batch"][:240],
                     "message": f["message"][:240]} for f in x.get("failures", [])]}
open(f"{d}.row.json", "w").write(json.dumps(row))
print(json.dumps(row))
PY
    cat "$d.row.json" >> "$OUT/soak.jsonl" 2>/dev/null; echo >> "$OUT/soak.jsonl"
}
for t in ${TARGETS:?set TARGETS}; do
  for s in ${SEEDS:-0}; do
    if [ "${PARALLEL:-0}" = 1 ]; then one "$t" "$s" & else one "$t" "$s"; fi
  done
done
wait
