#!/usr/bin/env bash
# Issue 52: confirming a memory-safety hit in the standby (fuzz/harness/sanitizer_standby.py) against a fresh child
# started for it (the behaviour before), side by side at the same time on ONE GPU. ARMS (default "fresh standby"):
# fresh is KVFUZZ_SANITIZE_STANDBY=0, standby KVFUZZ_SANITIZE_STANDBY=1 (it starts with the long-lived child; off
# by default), ready
# KVFUZZ_SANITIZE_STANDBY=ready (once the long-lived child is ready). For each seed, one `kvfuzz fuzz --target TARGET
# --duration DURATIONs --seed S --baseline kvfuzz-baseline.toml` campaign per arm, all at once, each on its share of
# the cores (taskset; kvfuzz's default workers count them), all else default (--sanitize auto).
# vllm#56862 is known to the baseline, so a hit is the first failure, is not shrunk, and the campaign runs to its
# --duration; each is stopped with SIGTERM CAP s past it. One tree: the arms differ only in the environment variable.
# Prints a line per seed and arm: exit status, first failure (s), examples, sanitized examples, where the hits were
# confirmed (summary.json time.sanitize confirms) and the confirm phase's seconds per confirmation; then a table of
# the arms; the sanitize stage by phase (benchmarks/sanitize_phases.py) goes to OUT/phases-ARM-SEED.txt. Halfway
# through each seed it prints each arm's compute-sanitizer processes and their host and GPU memory (OUT/memory.txt).
# Each campaign's summary.json is kept as OUT/summary-ARM-SEED.json.
# At most DURATION + CAP s a seed (DURATION 90: three seeds fit a 10-minute device call). Carry .device/.
# Usage: OUT=dir [TARGET=vllm.unified_attention] [DURATION=90] [CAP=40] [ARMS="fresh standby"]
#        [EXTRA="more kvfuzz fuzz options"] bash benchmarks/gpu_standby_ab.sh SEED...
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed (carry .device/)"; exit 1; }
gpu_out
export PATH=$PATH:/usr/local/cuda/bin
T=${TARGET:-vllm.unified_attention}; S=${DURATION:-90}; CAP=${CAP:-40}
read -ra A <<< "${ARMS:-fresh standby}"
C=$(( $(nproc) / ${#A[@]} ))
[ "$C" -ge 1 ] || { echo "ARMS: ${#A[@]} arms for $(nproc) cores"; exit 2; }
declare -A MODE=([fresh]=0 [standby]=1 [ready]=ready)
for arm in "${A[@]}"; do
  [ -n "${MODE[$arm]:-}" ] || { echo "ARMS: $arm is none of fresh, standby, ready"; exit 2; }
done
[ "$#" -gt 0 ] || set -- 1
{
  gpu_machine
  command -v compute-sanitizer || echo "no compute-sanitizer: nothing is sanitized"
  echo "$T, ${S}s, --baseline kvfuzz-baseline.toml; arms at once on GPU 0, $C cores each: ${A[*]}" \
       "(KVFUZZ_SANITIZE_STANDBY $(for a in "${A[@]}"; do printf '%s=%s ' "$a" "${MODE[$a]}"; done))"
} | tee "$R/machine.txt"
for seed in "$@"; do
  pids=(); i=0
  for arm in "${A[@]}"; do
    KVFUZZ_SANITIZE_STANDBY=${MODE[$arm]} timeout -s TERM $((S + CAP)) taskset -c "$((i * C))-$((i * C + C - 1))" \
      $KV fuzz --target "$T" --duration "${S}s" --seed "$seed" --baseline kvfuzz-baseline.toml --out "$W/$arm-$seed" \
      ${EXTRA:-} > "$R/$arm-$seed.log" 2>&1 &
    pids+=("$arm=$!"); i=$((i + 1))
  done
  # halfway: each arm's sanitized children (the standby's extra one included) and their host and GPU memory
  ( sleep $((S / 2)); python3 - "$seed" "${pids[@]}" <<'PY' | tee -a "$R/memory.txt" ) &
import os, subprocess, sys
seed, procs, kids, gpu = sys.argv[1], {}, {}, {}
roots = {a: int(p) for a, p in (x.split("=") for x in sys.argv[2:])}
for d in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{d}/stat").read()
        rss = int(open(f"/proc/{d}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        continue
    procs[int(d)] = (int(stat[stat.rindex(")") + 2:].split()[1]), stat[stat.index("(") + 1:stat.rindex(")")], rss)
for pid, (ppid, _, _) in procs.items():
    kids.setdefault(ppid, []).append(pid)
def tree(pid):
    out, stack = [], [pid]
    while stack:
        out.append(stack.pop())
        stack.extend(kids.get(out[-1], []))
    return out
try:
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout
except OSError:
    q = ""
for line in q.splitlines():
    try:
        pid, mib = line.split(",")
        gpu[int(pid)] = float(mib)
    except ValueError:
        pass
for arm, root in roots.items():
    sanitizers = [p for p in tree(root) if procs.get(p, (0, "", 0))[1].startswith("compute-saniti")]
    under = {p for s in sanitizers for p in tree(s) if p in procs}
    rss, mib = sum(procs[p][2] for p in under) / 2**30, sum(gpu.get(p, 0.0) for p in under)
    print(f"seed {seed} {arm}: {len(sanitizers)} compute-sanitizer processes, {rss:.1f} GiB RSS under them (shared "
          f"pages counted per process), {mib / 1024:.1f} GiB of GPU memory (nvidia-smi, the pids it shows)")
PY
  sampler=$!
  for ap in "${pids[@]}"; do
    arm=${ap%%=*}
    wait "${ap#*=}"; rc=$?
    python3 - "$W/$arm-$seed/summary.json" "$arm" "$seed" "$rc" <<'PY' | tee -a "$R/standby.jsonl"
import json, sys
path, arm, seed, rc = sys.argv[1:]
row = {"arm": arm, "seed": int(seed), "exit": int(rc)}
try:
    summary = json.load(open(path))
    (t,) = summary["targets"]
except (OSError, ValueError) as e:
    print(json.dumps({**row, "error": repr(e)}))
    raise SystemExit
s = next(iter((summary.get("time") or {}).get("sanitize") or []), {})
skipped = s.get("groups", {}).get("skipped", {}).get("examples", 0)
confirm = s.get("phases", {}).get("confirm", {})
row.update(first_failure_s=t.get("first_failure_s"), examples=t.get("examples"),
           sanitized=s.get("examples", 0) - skipped, confirms=s.get("confirms", {}),
           confirm_s=confirm.get("seconds", 0.0), confirm_n=confirm.get("count", 0),
           failures=[f.get("known") or f.get("kind") for f in t.get("failures", [])])
print(json.dumps(row))
PY
    python3 "$HERE/sanitize_phases.py" "$W/$arm-$seed/summary.json" > "$R/phases-$arm-$seed.txt" 2>&1
    cp "$W/$arm-$seed/summary.json" "$R/summary-$arm-$seed.json" 2>/dev/null
  done
  wait "$sampler"
done
python3 - "$R/standby.jsonl" <<'PY' | tee "$R/table.txt"
import json, sys
print(f"{'seed':>4} {'arm':>8} {'exit':>4} {'first failure s':>15} {'examples':>8} {'sanitized':>9} "
      f"{'confirm s/n':>12}  confirmed in")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(f"{r['seed']:>4} {r['arm']:>8} {r['exit']:>4} {r['error']}")
        continue
    per = f"{r['confirm_s'] / r['confirm_n']:.1f}/{r['confirm_n']}" if r["confirm_n"] else "-"
    print(f"{r['seed']:>4} {r['arm']:>8} {r['exit']:>4} {str(r['first_failure_s']):>15} {r['examples']:>8} "
          f"{r['sanitized']:>9} {per:>12}  {r['confirms']}")
PY
