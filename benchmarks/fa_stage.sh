#!/usr/bin/env bash
# On a lent GPU: collects the parts benchmarks/fa_bundle.sh made (.device-fa/part-<k>/, one carried per device call)
# into .fa-stage/ (ignored; a warm machine keeps it between calls), and once every part of the MANIFEST is there,
# checks the stream's sha256 and unpacks it into .fa-stage/unpacked/ (fa2/_vllm_fa2_C.abi3.so, fa4-site/), which
# benchmarks/gpu_env.sh then installs into the carried vllm tree and PYTHONPATH. Prints what it has; exits 0 while
# parts are missing (the next call brings one), 1 on a wrong checksum or a part from another bundle.
# Usage: bash benchmarks/fa_stage.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.fa-stage
mkdir -p "$STAGE"
for d in .device-fa*/part-*; do
  [ -d "$d" ] || continue
  if [ -f "$STAGE/MANIFEST" ] && ! cmp -s "$d/MANIFEST" "$STAGE/MANIFEST"; then
    echo "fa_stage: $d is from another bundle than the parts in $STAGE (rm -rf $STAGE to start again)" >&2
    exit 1
  fi
  cp "$d/MANIFEST" "$STAGE/MANIFEST"
  cp "$d"/fa.tar.xz.* "$STAGE/"
done
[ -f "$STAGE/MANIFEST" ] || { echo "fa_stage: no part carried (carry .device-fa/part-<k>)" >&2; exit 1; }
parts=$(awk '/^parts/ {print $2}' "$STAGE/MANIFEST")
sum=$(awk '/^sha256/ {print $2}' "$STAGE/MANIFEST")
have=$(ls "$STAGE"/fa.tar.xz.* 2>/dev/null | wc -l)
echo "fa_stage: $have of $parts parts in $STAGE"
[ "$have" -lt "$parts" ] && exit 0
if [ -f "$STAGE/unpacked/.sha256" ] && [ "$(cat "$STAGE/unpacked/.sha256")" = "$sum" ]; then
  echo "fa_stage: already unpacked in $STAGE/unpacked"
  exit 0
fi
got=$(for k in $(seq 1 "$parts"); do cat "$STAGE/fa.tar.xz.$k"; done | sha256sum | cut -d' ' -f1)
[ "$got" = "$sum" ] || { echo "fa_stage: sha256 $got, the MANIFEST says $sum" >&2; exit 1; }
rm -rf "$STAGE/unpacked" && mkdir -p "$STAGE/unpacked"
for k in $(seq 1 "$parts"); do cat "$STAGE/fa.tar.xz.$k"; done | xz -d -q | tar -C "$STAGE/unpacked" -xf -
echo "$sum" > "$STAGE/unpacked/.sha256"
echo "fa_stage: unpacked: $(du -sh "$STAGE/unpacked" | cut -f1) (FA2's extension, FA4's packages)"
