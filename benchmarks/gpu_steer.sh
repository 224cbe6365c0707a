#!/usr/bin/env bash
# Issue 52 on one lent Hopper GPU (no network; carry .device/ from `make device-bundle FA3=1`, as
# benchmarks/gpu_serving.sh does): coverage that steers (--steer on, the default) against the fixed split (--steer
# off), run as a user runs kvfuzz: a plain `kvfuzz fuzz --target TARGET --duration DURATION --steer STEER` (no --tier:
# auto, every declared tier on CUDA; no --baseline unless BASELINE=1, so a finding is shrunk), one run per seed.
# Each run stops STOP_AFTER seconds after its first reproducer appears (its shrink grace: KVFUZZ_SHRINK_GRACE is 120 s
# past --duration) or at DURATION + CAP s (CAP 150; a time-to-first-failure run within D seconds: DURATION=D CAP=10).
# Per run: time and examples to the first failure, the sequences of each
# failure's reproducer and how long each shrink took (summary.json's shrink: structural_first, hypothesis,
# structural), each tier's share of the examples and of the time (the stage table, summary.json's stages), and the
# declared bins no example reached
# (summary.json's bins), one JSON object a line in OUT/steer.jsonl, a table at the end; the sanitize stage by phase
# (benchmarks/sanitize_phases.py) in OUT/phases-STEER-SEED.txt.
# Made for benchmarks/gpu_lanes.sh (a 4-GPU host, one lane a campaign: before and after side by side at the same
# time), e.g. in one 10-minute device call:
#   OUT=$OUT LANE_TIMEOUT=560 bash benchmarks/gpu_lanes.sh \
#     'STEER=on  SEEDS="1 2 3" bash benchmarks/gpu_steer.sh'  'STEER=off SEEDS="1 2 3" bash benchmarks/gpu_steer.sh' \
#     'STEER=on  SEEDS="4 5" bash benchmarks/gpu_steer.sh'    'STEER=off SEEDS="4 5" bash benchmarks/gpu_steer.sh'
# Bins after 5 minutes: DURATION=300 STOP_AFTER= (run to the end) TARGET=... SEEDS=0.
# Usage: OUT=dir [TARGET=vllm.flash_attn_varlen] [STEER=on] [SEEDS="1 2 3 4 5"] [DURATION=120] [STOP_AFTER=40]
#        [BASELINE=1] [CAP=150] bash benchmarks/gpu_steer.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed (carry .device/)"; exit 1; }
gpu_out
T=${TARGET:-vllm.flash_attn_varlen}; S=${DURATION:-120}; STEER=${STEER:-on}; STOP=${STOP_AFTER-40}; CAP=${CAP:-150}
{
  gpu_machine
  echo "$T, --steer $STEER, ${S}s, stop ${STOP:-never} s after the first reproducer"
  for s in ${SEEDS:-1 2 3 4 5}; do
    o="$W/$STEER-$s"
    $KV fuzz --target "$T" --seed "$s" --duration "${S}s" --steer "$STEER" --out "$o" \
      ${BASELINE:+--baseline kvfuzz-baseline.toml} > "$R/$STEER-$s.log" 2>&1 &
    cli=$!
    start=$(date +%s); found=""
    while kill -0 "$cli" 2>/dev/null; do
      sleep 1
      now=$(date +%s)
      if [ -z "$found" ] && ls "$o" 2>/dev/null | grep -q "^$T-"; then found=$now; fi
      if [ -n "$STOP" ] && [ -n "$found" ] && [ $((now - found)) -ge "$STOP" ]; then kill -TERM "$cli"; fi
      if [ $((now - start)) -ge $((S + CAP)) ]; then kill -TERM "$cli"; fi
    done
    wait "$cli"; rc=$?
    python3 - "$o/summary.json" "$T" "$STEER" "$s" "$rc" "$(( $(date +%s) - start ))" >> "$R/steer.jsonl" <<'PY'
import json, sys
path, target, steer, seed, rc, wall = sys.argv[1:]
row = {"target": target, "steer": steer, "seed": int(seed), "exit": int(rc), "wall_s": int(wall)}
try:
    (t,) = json.load(open(path))["targets"]
except (OSError, ValueError) as e:
    print(json.dumps({**row, "error": repr(e)}))
    raise SystemExit
tiers = t.get("stages", {})  # the stage table per size tier: its examples and every second of its tasks
n = sum(v["examples"] for v in tiers.values()) or 1
secs = {k: sum(v["seconds"].values()) for k, v in tiers.items()}
row.update({k: t.get(k) for k in ("examples", "elapsed_s", "examples_per_s", "first_failure_s",
                                   "first_failure_examples")})
row["tier_examples_pct"] = {k: round(100 * v["examples"] / n, 1) for k, v in tiers.items()}
row["tier_time_pct"] = {k: round(100 * v / (sum(secs.values()) or 1), 1) for k, v in secs.items()}
row["bins_empty"] = {d: [b for b, c in bins.items() if not c] for d, bins in t.get("bins", {}).items()}
row["bins_declared"] = {d: len(bins) for d, bins in t.get("bins", {}).items()}
row["failures"] = [{"kind": f["kind"], "known": f.get("known"), "seqs": len(f["example"]["batch"]["query_lens"]),
                    "batch": f["batch"][:200], "shrink": f.get("shrink")} for f in t["failures"]]
print(json.dumps(row))
PY
    tail -1 "$R/steer.jsonl" | cut -c1-400
    # the sanitize stage by phase (a target with the memory-safety oracle on: benchmarks/sanitize_phases.py)
    python3 "$(dirname "$0")/sanitize_phases.py" "$o/summary.json" > "$R/phases-$STEER-$s.txt" 2>&1
  done
  python3 - "$R/steer.jsonl" <<'PY'
import json, sys
print("steer seed first_failure_s examples_to_it failure_seqs shrink_s(first+hyp+after) serving%ex serving%time "
      "empty_bins")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(r["steer"], r["seed"], r["error"])
        continue
    seqs = [f["seqs"] for f in r["failures"]]
    shrink = ["+".join(f"{(f['shrink'] or {}).get(k, 0):.0f}" for k in ("structural_first", "hypothesis",
                                                                        "structural")) for f in r["failures"]]
    empty = {d.split(" x ")[0]: f"{len(v)}/{r['bins_declared'][d]}" for d, v in r["bins_empty"].items()}
    print(r["steer"], r["seed"], r["first_failure_s"], r["first_failure_examples"], seqs, shrink,
          r["tier_examples_pct"].get("serving"), r["tier_time_pct"].get("serving"), empty)
PY
} 2>&1 | tee -a "$R/log.txt"
