#!/usr/bin/env bash
# FlashInfer's re-injected bugs (bug.flashinfer-1416, bug.flashinfer-350, bug.flashinfer-4401;
# docs/bugs.md#flashinfer-bugs) under `kvfuzz bench bugs` on a lent GPU in one device call of about 7 minutes: one
# process per bug and seed (9 by default, concurrent: one GPU, 16 cores), each a default campaign of DURATION on the
# bug's target, run by a patched copy of the flashinfer package with a JIT workspace of its own
# (fuzz/bench/bugs/package_copy.py), then a summary.
#
# Compile cost: FlashInfer JIT-compiles one module per (q/kv/o dtype, head_size, window on/off, softcap on/off),
# 72 for batch_decode (350, 4401) and 72 for batch_prefill (1416: 24 FA3 "sm90" modules for 16-bit caches, 48 FA2
# ones for fp8 caches); heads, GQA group, page size and the window's size are run-time arguments. A campaign chunk
# stays in one module (up to 1000 examples, and since 2026-11-28 at most a quarter of DURATION past its first
# example; a group of three steered chunks shares one), so a seed compiles a module per group it starts (and per
# focused chunk moved to another head size or window): a decode module took
# 21 s alone and 23-30 s with 8 compiling at once on an H100, an FA2 prefill module 42-45 s, the sm90 one 86 s
# (benchmarks/results/flashinfer-first-calls-h100.txt, flashinfer-speed-h100.md). Expect 2-4 modules per seed (30-
# 90 s each here, 9 processes compiling at once) plus the widening shrink's (one module per configuration it tries,
# within KVFUZZ_SHRINK_GRACE). A bug's copy is shared by its seeds' processes (FileLock per module), so a module two
# seeds both draw compiles once. The bugs' targets restrict nothing: 350 needs a softcap-on module (36 of 72; then
# softcap 4 in half the examples), 1416 an fp8 one (48 of 72; v_scale != 1 in 4 of 5 examples), 4401 every logit
# of a row below -34,657, which the "shifted" value range draws (one example of six; a softcap-off module: a seed's
# second module, since the first two of a rotation differ in soft cap; benchmarks/bug_draws.py replays a seed's
# draws on the CPU).
#
# Needs .device/ with flashinfer.tgz (FLASHINFER=1 make device-bundle, or bash benchmarks/flashinfer_bundle.sh).
# Env: OUT (default /tmp/fi-bugs-out), BUGS (default the three), SEEDS (3), DURATION (180s per campaign), SHRINK_GRACE
# (90: seconds a shrink may run past DURATION, KVFUZZ_SHRINK_GRACE), PROC_TIMEOUT (DURATION + SHRINK_GRACE + 70 s).
# Writes under $OUT: fi-bugs-<bug>-<seed>.json and .log (each process), fi-bugs-jit.txt (each copy's JIT modules and
# their build times from ninja's logs), fi-bugs-summary.txt (the table printed at the end).
# Usage: OUT=/path bash benchmarks/gpu_flashinfer_bugs.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fi-bugs-out}
mkdir -p "$OUT"
[ -f .device/flashinfer.tgz ] || {
  echo "gpu_flashinfer_bugs.sh: no .device/flashinfer.tgz (FLASHINFER=1 make device-bundle)" >&2; exit 1; }
source benchmarks/gpu_env.sh || exit 1
BUGS=${BUGS:-"flashinfer-1416 flashinfer-350 flashinfer-4401"}
SEEDS=${SEEDS:-3}
DURATION=${DURATION:-180s}
export KVFUZZ_SHRINK_GRACE=${SHRINK_GRACE:-90}
export KVFUZZ_BUG_COPIES=${KVFUZZ_BUG_COPIES:-/tmp/kvfuzz-bug-copies}
PROC_TIMEOUT=${PROC_TIMEOUT:-$(( ${DURATION%s} + KVFUZZ_SHRINK_GRACE + 70 ))}
t0=$SECONDS
echo "=== [$((SECONDS - t0))s] versions"
timeout 120 python3 -c "
import torch, flashinfer
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())
print('installed flashinfer', flashinfer.__version__, flashinfer.__file__)
"
nvcc --version 2>&1 | tail -1; nproc
find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' 2>/dev/null | sort > "$OUT/fi-ws-before.txt"

echo "=== [$((SECONDS - t0))s] the patched copies (patches checked against the installed package, copies built once)"
timeout 120 python3 - $BUGS <<'EOF' || exit 1
import sys
from kvfuzz.fuzz.bench.bugs import BUGS
from kvfuzz.fuzz.bench.bugs.package_copy import build_copy
for slug in sys.argv[1:]:
    bug = BUGS[f"bug.{slug}"]
    print(slug, "->", build_copy(bug.package_copy()), "patched:", len(bug.patches()), "files")
EOF

echo "=== [$((SECONDS - t0))s] campaigns: $BUGS x seeds 0..$((SEEDS - 1)), $DURATION each (timeout ${PROC_TIMEOUT}s)"
for b in $BUGS; do
  for s in $(seq 0 $((SEEDS - 1))); do
    timeout -k 20 "$PROC_TIMEOUT" $KV bench bugs --bug "$b" --seeds 1 --first-seed "$s" --duration "$DURATION" \
      --json "$OUT/fi-bugs-$b-$s.json" > "$OUT/fi-bugs-$b-$s.log" 2>&1 &
  done
done
wait
echo "=== [$((SECONDS - t0))s] done"
find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' 2>/dev/null | sort > "$OUT/fi-ws-after.txt"

python3 - "$OUT" "$KVFUZZ_BUG_COPIES" $BUGS <<'EOF' 2>&1 | tee "$OUT/fi-bugs-summary.txt"
import glob, json, os, statistics, sys
from pathlib import Path

out, copies, bugs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
# the JIT modules each copy built, with ninja's build times (first start to last end, and the number of objects)
with open(out / "fi-bugs-jit.txt", "w") as f:
    for folder in sorted(copies.glob("flashinfer-*")):
        for log in sorted(folder.glob("jit/.cache/flashinfer/*/*/cached_ops/*/.ninja_log")):
            rows = [ln.split("\t") for ln in log.read_text().splitlines() if ln and not ln.startswith("#")]
            if rows:
                start, end = min(int(r[0]) for r in rows), max(int(r[1]) for r in rows)
                print(f"{folder.name}\t{log.parent.name}\t{(end - start) / 1000:.1f} s\t{len(rows)} steps", file=f)
jit = [ln.split("\t") for ln in (out / "fi-bugs-jit.txt").read_text().splitlines()]
print("bug | found | s to 1st (per seed) | examples to 1st | kind (blame): check | shrunk to | replayed | "
      "examples, s (per seed)")
for b in bugs:
    runs, notes = [], []
    for f in sorted(glob.glob(str(out / f"fi-bugs-{b}-*.json"))):
        e = json.load(open(f))["bugs"][0]
        if "skipped" in e:
            notes.append(f"skipped: {e['skipped']}")
        runs += e.get("runs", [])
    logs = sorted(glob.glob(str(out / f"fi-bugs-{b}-*.log")))
    no_json = [Path(l).stem for l in logs if not Path(l).with_suffix(".json").exists()]
    found = [r for r in runs if r["found"]]
    kinds = sorted({f"{r['kind']} ({r['blame']}): {r['check']}" for r in found})
    sizes = [f"{r['size']['seqs']}s {r['size']['tokens']}t {r['size']['kv_tokens']}kv H{r['size']['heads']} "
             f"D{r['size']['head_size']} BS{r['size']['block_size']}" for r in found]
    print(f"{b} | {len(found)}/{len(runs)} | {[r['seconds_to_first'] for r in runs]} | "
          f"{[r['examples_to_first'] for r in runs]} | {'; '.join(kinds) or '-'} | {sizes or '-'} | "
          f"{sum(bool(r['replays']) for r in found)}/{len(found)} | "
          f"{[(r['examples_total'], r['seconds_total']) for r in runs]}")
    modules = [m for m in jit if m[0].startswith(b + "-")]
    if modules:
        secs = [float(m[2].split()[0]) for m in modules]
        print(f"   JIT modules built by its copy: {len(modules)}, median {statistics.median(secs):.0f} s, "
              f"max {max(secs):.0f} s")
    for n in notes:
        print("  ", n)
    for n in no_json:
        print(f"   {n}: no JSON (timed out or failed; see {n}.log)")
before = (out / "fi-ws-before.txt").read_text() if (out / "fi-ws-before.txt").exists() else ""
after = (out / "fi-ws-after.txt").read_text() if (out / "fi-ws-after.txt").exists() else ""
new = sorted(set(after.split()) - set(before.split()))
print("compiled modules in the unpatched JIT workspace ($FLASHINFER_WORKSPACE_BASE) unchanged by the bugs' runs:",
      before == after, f"({len(after.split())} before and after)" if before == after else f"(new: {new})")
EOF
