#!/usr/bin/env bash
# Several independent GPU jobs in one device call on a host with several GPUs (nvidia-h100-x4: 4 GPUs, 64 cores):
# lane i runs its command on GPU i alone (CUDA_VISIBLE_DEVICES=i) and on its own share of the cores (taskset: cores
# i*C .. i*C+C-1, C = cores / lanes), so each lane is a one-GPU machine with C cores (kvfuzz's default workers count
# the affinity mask: 14 under MPS with 16 cores). Each lane's command runs in bash with OUT=$OUT/lane-i (its own
# folder) after benchmarks/gpu_env.sh; what it writes there is packed into OUT/lane-i.tgz (a device call returns at
# most 8 files), its output into OUT/lane-i.log, and OUT/lanes.txt gives each lane's exit status and seconds.
# Each lane is stopped after LANE_TIMEOUT seconds (default 520, so the packing fits a 10-minute call).
# Usage: OUT=dir bash benchmarks/gpu_lanes.sh 'cmd for GPU 0' 'cmd for GPU 1' ...   (at most one lane per GPU)
set -uo pipefail
R=${OUT:?set OUT}
mkdir -p "$R"
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh" >/dev/null 2>&1 || { echo "gpu_env.sh failed" > "$R/lanes.txt"; exit 1; }
export KV HERE
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
CORES=$(nproc)
[ "$#" -le "$GPUS" ] || { echo "$# lanes for $GPUS GPUs" | tee "$R/lanes.txt"; exit 2; }
C=$((CORES / $#))
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$R/lanes.txt"
echo "cores $CORES, $C per lane" >> "$R/lanes.txt"
i=0
for cmd in "$@"; do
  mkdir -p "$R/lane-$i"
  (
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$i OUT="$R/lane-$i" timeout "${LANE_TIMEOUT:-520}" taskset -c "$((i * C))-$((i * C + C - 1))" bash -c "$cmd" \
      > "$R/lane-$i.log" 2>&1
    rc=$?
    echo "lane $i: exit $rc, $(( $(date +%s) - start )) s: $cmd" >> "$R/lanes.txt"
  ) &
  i=$((i + 1))
done
wait
for d in "$R"/lane-*/; do
  n=$(basename "$d")
  tar czf "$R/$n.tgz" -C "$R" "$n" && rm -rf "$d"
done
cat "$R/lanes.txt"
