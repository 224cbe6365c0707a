#!/usr/bin/env bash
# Opt-in addition to .device/ (benchmarks/device_bundle.sh) for the FlashInfer targets on a lent GPU machine
# (no network there): `bash benchmarks/flashinfer_bundle.sh` (or `FLASHINFER=1 make device-bundle`).
#   .device/flashinfer.tgz     the flashinfer package of flashinfer-python==0.7.2.post1 (a pure-Python wheel of
#                              ~62 MB whose CUDA sources are JIT-compiled on first use) trimmed as
#                              /work/shared/REFERENCE.md §2 says it still imports and compiles decode and sm90
#                              prefill: without the subfolders of flashinfer/data/csrc/ (the top-level files there,
#                              which flashinfer/jit/attention/modules.py and jit/page.py compile, and
#                              flashinfer/data/include, cutlass, ... stay) and without non-.py files under
#                              flashinfer/experimental/ (flashinfer/__init__.py imports fused_moe, gemm ->
#                              experimental, so its .py files stay); plus the wheel's dist-info
#   .device/flashinfer-whl/    apache-tvm-ffi==0.1.15.post2, the cp312 manylinux x86_64 wheel (flashinfer's FFI)
# benchmarks/gpu_env.sh unpacks/installs both when present and sets FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws,
# MAX_JOBS=16, FLASHINFER_CUDA_ARCH_LIST=9.0. Fails if flashinfer.tgz is over $FLASHINFER_MAX_MIB (26) or .device/
# over $BUNDLE_MAX_MIB (56; a device call carries 64 MiB in all, working tree included).
# Usage: bash benchmarks/flashinfer_bundle.sh   (env: PY, DEST, DEVICE_CACHE, FLASHINFER_MAX_MIB, BUNDLE_MAX_MIB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.device}
DEVICE_CACHE=${DEVICE_CACHE:-.venv/share/kvfuzz/device-cache}
FLASHINFER_MAX_MIB=${FLASHINFER_MAX_MIB:-26}
BUNDLE_MAX_MIB=${BUNDLE_MAX_MIB:-56}
FLASHINFER_VERSION=0.7.2.post1
TVM_FFI_VERSION=0.1.15.post2

[ -x "$PY" ] || { echo "flashinfer_bundle: $PY not found (run make setup, or set PY=)" >&2; exit 1; }
mkdir -p "$DEST/flashinfer-whl" "$DEVICE_CACHE"

ls "$DEVICE_CACHE"/flashinfer_python-$FLASHINFER_VERSION-*.whl >/dev/null 2>&1 || \
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEVICE_CACHE" "flashinfer-python==$FLASHINFER_VERSION"
ls "$DEST"/flashinfer-whl/apache_tvm_ffi-$TVM_FFI_VERSION-*.whl >/dev/null 2>&1 || \
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST/flashinfer-whl" "apache-tvm-ffi==$TVM_FFI_VERSION"
for f in "$DEST"/flashinfer-whl/*.whl; do     # one version only
  case "$(basename "$f")" in apache_tvm_ffi-$TVM_FFI_VERSION-*) ;; *) echo "removing $(basename "$f")"; rm -f "$f" ;; esac
done

"$PY" - "$(ls "$DEVICE_CACHE"/flashinfer_python-$FLASHINFER_VERSION-*.whl | head -1)" "$DEST/flashinfer.tgz" <<'EOF'
import io, sys, tarfile, zipfile

wheel, out = sys.argv[1], sys.argv[2]


def keep(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top != "flashinfer" and not (top.startswith("flashinfer_python-") and top.endswith(".dist-info")):
        return False
    if name.startswith("flashinfer/data/csrc/") and "/" in name[len("flashinfer/data/csrc/"):]:
        return False  # subfolders of csrc (fused_moe, xqa, nv_internal, ...): not what decode/prefill/page compile
    if name.startswith("flashinfer/experimental/") and not name.endswith(".py"):
        return False
    return not name.endswith("/")


kept = dropped = 0
with zipfile.ZipFile(wheel) as z, tarfile.open(out, "w:gz", compresslevel=9) as tar:
    for info in z.infolist():
        if not keep(info.filename):
            dropped += 1
            continue
        data = z.read(info)
        t = tarfile.TarInfo(info.filename)
        t.size, t.mode, t.mtime = len(data), 0o644, 0
        tar.addfile(t, io.BytesIO(data))
        kept += 1
print(f"flashinfer.tgz: {kept} files kept, {dropped} left out")
EOF
size=$(du -m "$DEST/flashinfer.tgz" | cut -f1)
total=$(du -sm "$DEST" | cut -f1)
echo "flashinfer bundle: $(du -h "$DEST/flashinfer.tgz" | cut -f1) flashinfer.tgz + $(du -ch "$DEST"/flashinfer-whl/*.whl | tail -1 | cut -f1) tvm-ffi; .device/ ${total} MiB"
[ "$size" -le "$FLASHINFER_MAX_MIB" ] || { echo "flashinfer_bundle: flashinfer.tgz is ${size} MiB > ${FLASHINFER_MAX_MIB}" >&2; exit 1; }
[ "$total" -le "$BUNDLE_MAX_MIB" ] || { echo "flashinfer_bundle: .device/ is ${total} MiB > ${BUNDLE_MAX_MIB}" >&2; exit 1; }
