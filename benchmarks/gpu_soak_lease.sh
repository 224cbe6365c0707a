#!/usr/bin/env bash
# benchmarks/soak.py on a lent GPU across several device calls: a device call runs at most 10 minutes, but a process
# that starts its own session (setsid) runs on until the machine goes back, so `start` launches the soak that way and
# returns at once, and each later call (while the machine stays warm) can `peek` at it; other work of those calls
# runs beside it on the other GPU and cores of a multi-GPU host.
#   start   the soak of the default CUDA targets (`kvfuzz fuzz` with no --target: every target available there) on
#           GPU $GPU (default 0) and cores $CORES (default 0-7, taskset), $HOURS long (default 0.37: a lease holds a
#           machine 30 minutes at most), sampled every $SAMPLE s (300), memory held to the first sample after
#           $WARMUP s (300), SIGKILLed at half time and restarted on the same --out (soak.py's defaults); into $SOAK
#           (default /tmp/soak-lease); EXTRA: more `kvfuzz fuzz` arguments (e.g. "--baseline kvfuzz-baseline.toml")
#   peek    copies what the soak has written so far (samples.jsonl, soak.json and soak.png once it ended, the
#           campaign's log tail and summary.json) into $OUT, and says whether it still runs
# Usage: OUT=dir bash benchmarks/gpu_soak_lease.sh start|peek   (source benchmarks/gpu_env.sh's install first: start
#        runs in this environment)
set -uo pipefail
cd "$(dirname "$0")/.."
SOAK=${SOAK:-/tmp/soak-lease}
case "${1:-}" in
  start)
    source benchmarks/gpu_env.sh >/dev/null || exit 1
    mkdir -p "$SOAK"
    # shellcheck disable=SC2086  # EXTRA is a list of arguments
    CUDA_VISIBLE_DEVICES=${GPU:-0} setsid nohup taskset -c "${CORES:-0-7}" python3 benchmarks/soak.py --out "$SOAK" \
      --hours "${HOURS:-0.37}" --sample "${SAMPLE:-300}" --warmup "${WARMUP:-300}" -- ${EXTRA:-} \
      > "$SOAK/soak.out" 2>&1 < /dev/null &
    echo $! > "$SOAK/pid"
    sleep 5
    echo "gpu_soak_lease: soak started (pid $(cat "$SOAK/pid"), GPU ${GPU:-0}, cores ${CORES:-0-7}, ${HOURS:-0.37} h)"
    tail -5 "$SOAK/soak.out" ;;
  peek)
    R=${OUT:?set OUT}
    mkdir -p "$R/soak"
    for f in samples.jsonl soak.json soak.png soak.out; do [ -f "$SOAK/$f" ] && cp "$SOAK/$f" "$R/soak/"; done
    [ -f "$SOAK/campaign.log" ] && tail -c 200000 "$SOAK/campaign.log" > "$R/soak/campaign-tail.log"
    [ -f "$SOAK/campaign/summary.json" ] && cp "$SOAK/campaign/summary.json" "$R/soak/summary.json"
    if kill -0 "$(cat "$SOAK/pid" 2>/dev/null)" 2>/dev/null; then echo "gpu_soak_lease: still running"
    else echo "gpu_soak_lease: ended"; fi
    echo "samples: $(wc -l < "$SOAK/samples.jsonl" 2>/dev/null || echo 0)"
    tail -3 "$SOAK/samples.jsonl" 2>/dev/null | cut -c1-600 ;;
  *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
