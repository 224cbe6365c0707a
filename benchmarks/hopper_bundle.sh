#!/usr/bin/env bash
# Opt-in addition to .device/ (benchmarks/device_bundle.sh) for the Hopper-only targets vllm.flash_attn_varlen
# (FlashAttention 3) and vllm.flashmla_decode (FlashMLA) on a lent H100/H200 (no network there):
# `bash benchmarks/hopper_bundle.sh` (or `make device-bundle FA3=1`).
#   .device/hopper/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so.xz   FA3's extension (172 MB; xz -9: ~8 MB)
#   .device/hopper/vllm/_flashmla_C.abi3.so.xz                    FlashMLA's dense/sparse kernels (3.9 MB)
#   .device/hopper/vllm/_flashmla_extension_C.abi3.so.xz          FlashMLA's fp8 dense decode (0.2 MB)
#   .device/hopper/vllm/third_party/flashmla/*.py                 FlashMLA's Python interface (device_bundle.sh
#                                                                 leaves vllm/third_party out of vllm-py.tgz)
# all taken from the vLLM 0.33.0 wheel device_bundle.sh caches in $DEVICE_CACHE (abi3: any CPython >= 3.8).
# xz, not zstd: Python's standard library reads it (lzma), so benchmarks/gpu_env.sh unpacks it into the carried
# vllm tree (/tmp/vllm) without any package on the GPU image (the `xz` command is its fallback). Idempotent: a
# member already packed from the same wheel is kept. Fails if .device/ is over $BUNDLE_MAX_MIB (56; a device call
# carries 64 MiB in all, working tree included).
# Usage: bash benchmarks/hopper_bundle.sh   (env: PY, DEST, DEVICE_CACHE, BUNDLE_MAX_MIB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.device}
DEVICE_CACHE=${DEVICE_CACHE:-.venv/share/kvfuzz/device-cache}
BUNDLE_MAX_MIB=${BUNDLE_MAX_MIB:-56}
VLLM_VERSION=0.33.0

[ -x "$PY" ] || { echo "hopper_bundle: $PY not found (run make setup, or set PY=)" >&2; exit 1; }
mkdir -p "$DEST/hopper" "$DEVICE_CACHE"
ls "$DEVICE_CACHE"/vllm-$VLLM_VERSION-*.whl >/dev/null 2>&1 || \
  "$PY" -m pip download -q --no-deps -d "$DEVICE_CACHE" "vllm==$VLLM_VERSION"

"$PY" - "$(ls "$DEVICE_CACHE"/vllm-$VLLM_VERSION-*.whl | head -1)" "$DEST/hopper" <<'EOF'
import lzma, os, shutil, sys, zipfile

wheel, dest = sys.argv[1], sys.argv[2]
PACKED = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so")
PLAIN = ("vllm/third_party/flashmla/__init__.py", "vllm/third_party/flashmla/flash_mla_interface.py")
stamp = os.path.basename(wheel)
with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    for name in PACKED + PLAIN:
        if name not in names:
            sys.exit(f"hopper_bundle: {wheel} has no {name}")
    for name in PACKED:
        out = os.path.join(dest, name + ".xz")
        if os.path.exists(out) and open(out + ".from").read() == stamp:
            continue
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(name) as src, lzma.open(out + ".part", "wb", preset=9) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(out + ".part", out)
        open(out + ".from", "w").write(stamp)
        print(f"packed {name}: {z.getinfo(name).file_size >> 20} MiB -> {os.path.getsize(out) >> 20} MiB")
    for name in PLAIN:
        out = os.path.join(dest, name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(name) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
EOF

bytes=$(du -sb "$DEST" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "hopper bundle: $DEST/hopper $(du -sh "$DEST/hopper" | cut -f1); .device total $mib MiB"
if [ "$mib" -gt "$BUNDLE_MAX_MIB" ]; then
  echo "hopper_bundle: $mib MiB is over $BUNDLE_MAX_MIB MiB (a device call carries 64 MiB, working tree included)" >&2
  exit 1
fi
