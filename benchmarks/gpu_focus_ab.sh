#!/usr/bin/env bash
# Issue 52, declared bins after 5 minutes: focused chunks limited in time (KVFUZZ_FOCUS_SECONDS, the default
# kvfuzz.fuzz.campaign.chunks FOCUS_CHUNK_SECONDS) against focused chunks of FOCUS_EXAMPLES examples whatever they cost
# (KVFUZZ_FOCUS_SECONDS=0, the behaviour before), side by side at the same time on ONE GPU, each arm on its share of
# the cores (taskset; kvfuzz's default workers count them). One tree: the arms differ only in the variable.
# VAR: the variable the arms set (default KVFUZZ_FOCUS_SECONDS; KVFUZZ_FREE_SECONDS limits the steered free chunks,
# kvfuzz.fuzz.campaign.chunks FREE_CHUNK_SECONDS and Target.free_chunk_seconds; KVFUZZ_CHUNK_CLOCK, ARMS="wall work":
# whether the limits count the worker's compiles; other variables, e.g. KVFUZZ_FREE_SECONDS=5, pass to every arm). ARMS: its values, one campaign each (default "0 3");
# an arm holding '=' is its own assignments instead, comma-separated, e.g. ARMS="KVFUZZ_FREE_SECONDS=0
# KVFUZZ_FREE_SECONDS=5,KVFUZZ_CHUNK_CLOCK=work" (VAR is then unused; files name the arm with '=' and ',' as '_'). Per arm: a plain
# `kvfuzz fuzz --target TARGET --duration DURATIONs --seed SEED --baseline kvfuzz-baseline.toml` (known findings are
# not shrunk, so the campaign keeps drawing), stopped with SIGTERM CAP s past --duration.
# Prints a JSON line per arm (OUT/focus.jsonl): exit status, examples, first failure (s) and what failed, the
# declared bins by dimension and how many are empty (summary.json bins), the empty ones, the examples per aimed-at
# (ctx_len x query_len) bin's quartiles, each tier's share of the examples and of the time; then a table.
# Each campaign's summary.json is kept as OUT/summary-ARM.json, its failures' reproducer folders in OUT/cases-ARM.tgz. Carry .device/ (with FA3: `make device-bundle FA3=1`).
# SEEDS="2 3" runs every arm on each seed at once (arms x seeds campaigns, the cores split evenly; an arm's files then
# end in -sSEED); SEED=1 is the one seed otherwise.
# Usage: OUT=dir [TARGET=vllm.flash_attn_varlen] [DURATION=300] [CAP=60] [SEED=1 | SEEDS="2 3"] [VAR=KVFUZZ_FOCUS_SECONDS] [ARMS="0 3"]
#        [EXTRA="more kvfuzz fuzz options"] bash benchmarks/gpu_focus_ab.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed (carry .device/)"; exit 1; }
gpu_out
export PATH=$PATH:/usr/local/cuda/bin
T=${TARGET:-vllm.flash_attn_varlen}; S=${DURATION:-300}; CAP=${CAP:-60}; SEED=${SEED:-1}
V=${VAR:-KVFUZZ_FOCUS_SECONDS}
read -ra A <<< "${ARMS:-0 3}"
read -ra SS <<< "${SEEDS:-$SEED}"
C=$(( $(nproc) / (${#A[@]} * ${#SS[@]}) ))
[ "$C" -ge 1 ] || { echo "ARMS x SEEDS: $((${#A[@]} * ${#SS[@]})) campaigns for $(nproc) cores"; exit 2; }
{
  gpu_machine
  echo "$T, ${S}s, seeds ${SS[*]}, --baseline kvfuzz-baseline.toml; arms at once on GPU 0, $C cores each:" \
       "$V ${A[*]}"
} | tee "$R/machine.txt"
pids=(); i=0
for seed in "${SS[@]}"; do
  for arm in "${A[@]}"; do
    if [[ $arm == *=* ]]; then IFS=, read -ra set <<< "$arm"; else set=("$V=$arm"); fi
    arm=${arm//[=,]/_}
    [ "${#SS[@]}" -gt 1 ] && arm=$arm-s$seed
    env "${set[@]}" timeout -s TERM $((S + CAP)) taskset -c "$((i * C))-$((i * C + C - 1))" \
      $KV fuzz --target "$T" --duration "${S}s" --seed "$seed" --baseline kvfuzz-baseline.toml --out "$W/$arm" \
      ${EXTRA:-} > "$R/focus-$arm.log" 2>&1 &
    pids+=("$arm=$!"); i=$((i + 1))
  done
done
for ap in "${pids[@]}"; do
  arm=${ap%%=*}
  wait "${ap#*=}"; rc=$?
  cp "$W/$arm/summary.json" "$R/summary-$arm.json" 2>/dev/null
  # each failure's reproducer folder, kept (W goes when the script exits) as one archive: a device call returns
  # files, not folders this deep
  cases=(); for c in "$W/$arm"/*/case.json; do [ -f "$c" ] && cases+=("$(basename "$(dirname "$c")")"); done
  [ "${#cases[@]}" -gt 0 ] && tar czf "$R/cases-$arm.tgz" -C "$W/$arm" "${cases[@]}"
  python3 - "$W/$arm/summary.json" "$arm" "$rc" <<'PY' | tee -a "$R/focus.jsonl"
import json, statistics, sys
path, arm, rc = sys.argv[1:]
row = {"arm": arm, "exit": int(rc)}
try:
    (t,) = json.load(open(path))["targets"]
except (OSError, ValueError) as e:
    print(json.dumps({**row, "error": repr(e)}))
    raise SystemExit
tiers = t.get("stages", {})
n = sum(v["examples"] for v in tiers.values()) or 1
secs = {k: sum(v["seconds"].values()) for k, v in tiers.items()}
bins = t.get("bins", {})
row.update({k: t.get(k) for k in ("examples", "elapsed_s", "first_failure_s", "chunks")})
row["failures"] = [f.get("known") or f.get("kind") for f in t.get("failures", [])]
row["bins_declared"] = {d: len(b) for d, b in bins.items()}
row["bins_empty_n"] = {d: sum(1 for c in b.values() if not c) for d, b in bins.items()}
row["bins_empty"] = {d: [k for k, c in b.items() if not c] for d, b in bins.items()}
shape = sorted(c for c in next(iter(bins.values()), {}).values() if c)
row["shape_bin_examples_quartiles"] = statistics.quantiles(shape, n=4) if len(shape) > 1 else shape
row["tier_examples_pct"] = {k: round(100 * v["examples"] / n, 1) for k, v in tiers.items()}
row["tier_time_pct"] = {k: round(100 * v / (sum(secs.values()) or 1), 1) for k, v in secs.items()}
print(json.dumps(row))
PY
done
python3 - "$R/focus.jsonl" <<'PY' | tee "$R/table.txt"
import json, sys
print(f"{'arm':>7} {'exit':>4} {'examples':>8} {'first failure s':>15}  empty bins (of declared)  tiers % examples")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(f"{r['arm']:>7} {r['exit']:>4} {r['error']}")
        continue
    empty = ", ".join(f"{d}: {r['bins_empty_n'][d]}/{r['bins_declared'][d]}" for d in r["bins_declared"])
    print(f"{r['arm']:>7} {r['exit']:>4} {r['examples']:>8} {str(r['first_failure_s']):>15}  {empty}  "
          f"{r['tier_examples_pct']}")
PY
