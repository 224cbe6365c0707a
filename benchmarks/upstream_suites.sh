#!/usr/bin/env bash
# Runs upstream kernel test files plainly and under kvfuzz's guard, and tabulates what the guard changed.
# The project copies no upstream tests: pass the path of a test tree (e.g. a vLLM checkout, or
# /work/shared/upstream/vllm-0.33.0) and files relative to it. For each file:
#   python3 -m pytest -q -n N -p no:cacheprovider --junitxml=... FILE [EXTRA]
#   the same with --kvfuzz-guard --kvfuzz-guard-report=....json (the report only where the plugin has it)
# timing both; then benchmarks/upstream_table.py writes OUTDIR/upstream.md and upstream.json: per file, tests,
# passed plainly, passed/failed under the guard, tests the guard run failed that passed plainly, each check that
# fired (severity, count), wall time plain vs guard. Pytest runs in the tree (its conftest files apply), with
# whatever python3 and PYTHONPATH are set (on a GPU machine: `source benchmarks/gpu_env.sh` first).
# Usage: bash benchmarks/upstream_suites.sh [-n N] [-o OUTDIR] TREE FILE... [-- EXTRA PYTEST ARGS, e.g. -k ...]
#   -n N     pytest-xdist workers (default 8; 0: no -n)     -o OUTDIR  default /tmp/kvfuzz-upstream
# Env: GUARD_ARGS (default --kvfuzz-guard; e.g. add -p kvfuzz.fuzz.guard.plugin where no entry point is installed)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WORKERS=8
OUTDIR=/tmp/kvfuzz-upstream
while getopts "n:o:h" opt; do
  case $opt in
    n) WORKERS=$OPTARG ;;
    o) OUTDIR=$OPTARG ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || { sed -n '11,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
TREE=$(cd "$1" && pwd) || exit 2
shift
FILES=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do FILES+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
for f in "${FILES[@]}"; do [ -e "$TREE/$f" ] || { echo "upstream_suites: no $TREE/$f" >&2; exit 2; }; done
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || exit 2
read -r -a GUARD <<< "${GUARD_ARGS:---kvfuzz-guard}"
XDIST=()
[ "$WORKERS" != 0 ] && XDIST=(-n "$WORKERS")

# --kvfuzz-guard-report is newer than --kvfuzz-guard: does this plugin take it? (in an empty folder: no conftest)
EMPTY=$(mktemp -d)
probe=$(cd "$EMPTY" && python3 -m pytest -q --co -p no:cacheprovider "${GUARD[@]}" \
        --kvfuzz-guard-report="$EMPTY/r.json" 2>&1)
if [[ "$probe" == *"unrecognized arguments"*"--kvfuzz-guard-report"* ]]; then
  HAS_REPORT=
  echo "upstream_suites: this kvfuzz's pytest plugin has no --kvfuzz-guard-report: the table says 'no guard report'"
else
  HAS_REPORT=1
fi
rm -rf "$EMPTY"

now() { date +%s.%N; }
: > "$OUTDIR/runs.tsv"
for f in "${FILES[@]}"; do
  slug=$(echo "$f" | tr '/' '_' | sed 's/\.py$//')
  report=
  rm -f "$OUTDIR/$slug".{plain.xml,guard.xml,guard.json,plain.log,guard.log}
  echo "== $f: plain"
  t0=$(now)
  (cd "$TREE" && python3 -m pytest -q "${XDIST[@]}" -p no:cacheprovider --rootdir "$TREE" \
     --junitxml="$OUTDIR/$slug.plain.xml" "$f" "${EXTRA[@]}") > "$OUTDIR/$slug.plain.log" 2>&1
  rc_plain=$?
  t1=$(now)
  tail -n 3 "$OUTDIR/$slug.plain.log"
  echo "== $f: under the guard"
  REPORT_ARG=()
  [ -n "$HAS_REPORT" ] && report=$slug.guard.json && REPORT_ARG=(--kvfuzz-guard-report="$OUTDIR/$report")
  t2=$(now)
  (cd "$TREE" && python3 -m pytest -q "${XDIST[@]}" -p no:cacheprovider --rootdir "$TREE" \
     --junitxml="$OUTDIR/$slug.guard.xml" "${GUARD[@]}" "${REPORT_ARG[@]}" "$f" "${EXTRA[@]}") \
     > "$OUTDIR/$slug.guard.log" 2>&1
  rc_guard=$?
  t3=$(now)
  tail -n 3 "$OUTDIR/$slug.guard.log"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$f" "$slug.plain.xml" "$slug.guard.xml" "$report" \
    "$t0" "$t1" "$t2" "$t3" "$rc_plain" "$rc_guard" >> "$OUTDIR/runs.tsv"
done
echo
python3 "$HERE/upstream_table.py" "$OUTDIR"
