#!/usr/bin/env bash
# Packs what the FlashAttention 2 and 4 targets (vllm.flash_attn_varlen_fa2, vllm.flash_attn_varlen_fa4) need on a lent
# GPU (no network there) into parts small enough for one device call each, for benchmarks/fa_stage.sh to collect on
# the device and benchmarks/gpu_env.sh to install:
#   fa2/_vllm_fa2_C.abi3.so   FlashAttention 2's extension from the vLLM 0.33.0 wheel (308 MB: sm_80 cubins, 232 MB,
#                             and compute_80 PTX, 65 MB already compressed inside the fatbin; an H100 runs the PTX
#                             through the driver's JIT, an A100 the cubins)
#   fa4-site/                 FlashAttention 4's packages as `pip install --no-deps --target` lays them out, from the
#                             cp312 wheels vLLM 0.33.0 pins: nvidia-cutlass-dsl 4.8.0 with its libs-core (the DSL's
#                             Python: cutlass.cute), libs-base and libs-cu13 (the MLIR compiler and runtime: 92 MB
#                             zipped, 237 MB unpacked; libs-cu12, which the package lists too, is left out: the GPU
#                             image is CUDA 13), cuda-bindings 13.x, cuda-pathfinder, protobuf, quack-kernels 0.6.5,
#                             apache-tvm-ffi, torch-c-dlpack-ext, einops (FA4's Python itself is in vLLM's tree,
#                             vllm_flash_attn/cute); gpu_env.sh puts nvidia_cutlass_dsl/dsl_packages on PYTHONPATH (the
#                             .pth file that does it in a site directory is not read from PYTHONPATH)
#   stable/_C_stable_libtorch.abi3.so   with STABLE=1 only: vLLM's stable-ABI extension (92.6 MB; its CUDA ops,
#                             merge_attn_states among them, for vllm.merge_attn_states_cuda; the device bundle holds an
#                             empty stand-in for it), from the installed vllm or the wheel
# One tar of both, `xz -9e` (the GPU image has xz and no zstd; FA2 alone 76 MiB: 3 parts of 26 MiB), split into .device-fa/part-<k>/fa.tar.xz.<k>
# of at most $PART_MIB MiB (50),
# with .device-fa/part-<k>/MANIFEST (parts, sizes, sha256 of the whole stream) in every part. A device call carries
# 64 MiB in all, the working tree (~9 MiB) included: carry one part a call (benchmarks/fa_stage.sh keeps it in the
# ignored .fa-stage/, which a warm machine keeps between calls, and unpacks the lot once every part is there), then
# .device in the next call.
# Measured on this project's CPU (2 cores): the FA2 .so packs to 77 MiB (zstd -19 --long=30; plain -19: 97 MB);
# dropping its sm_80 cubins (no nvprune here; zeroing them in a copy) left 62.5 MiB, still a call of its own and
# an H100-only file: not done. FA4=0 packs FA2's extension alone; PART_MIB=26 then makes 3 parts that each ride
# beside .device in a call of other work. Usage: bash benchmarks/fa_bundle.sh   (env: PY, DEVICE_CACHE, PART_MIB,
# DEST, FA4, FA2: FA2=0 packs FA4's packages alone, for a machine that has FA2 already or does not need it; STABLE=1
# adds vLLM's _C_stable_libtorch, which benchmarks/gpu_env.sh installs only if it loads there)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.device-fa}
DEVICE_CACHE=${DEVICE_CACHE:-.venv/share/kvfuzz/device-cache}
PART_MIB=${PART_MIB:-50}
VLLM_VERSION=0.33.0
FA4_WHEELS=("nvidia-cutlass-dsl==4.8.0" "nvidia-cutlass-dsl-libs-core==4.8.0" "nvidia-cutlass-dsl-libs-base==4.8.0"
            "nvidia-cutlass-dsl-libs-cu13==4.8.0" "cuda-bindings==13.5.0" "cuda-pathfinder==1.9.1" "protobuf==7.36.2"
            "quack-kernels==0.6.5" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" "einops==0.8.2")

[ -x "$PY" ] || { echo "fa_bundle: $PY not found (run make setup, or set PY=)" >&2; exit 1; }
command -v xz >/dev/null || { echo "fa_bundle: xz not found" >&2; exit 1; }
mkdir -p "$DEVICE_CACHE/fa4" && WORK=$(mktemp -d) && trap 'rm -rf "$WORK"' EXIT
# FA2's extension: from the installed vllm when it is the pinned one (make setup installs the wheel's files), else the wheel
INSTALLED=$("$PY" -c 'import importlib.metadata as m, importlib.util as u, os, sys
so = os.path.join(u.find_spec("vllm").submodule_search_locations[0], "vllm_flash_attn", "_vllm_fa2_C.abi3.so")
print(so if m.version("vllm") == sys.argv[1] and os.path.exists(so) else "")' "$VLLM_VERSION" 2>/dev/null || true)
if [ -z "$INSTALLED" ]; then
  ls "$DEVICE_CACHE"/vllm-$VLLM_VERSION-*.whl >/dev/null 2>&1 || \
    "$PY" -m pip download -q --no-deps -d "$DEVICE_CACHE" "vllm==$VLLM_VERSION"
fi
FA4_DIR="$DEVICE_CACHE/fa4"
if [ "${FA4:-1}" = 0 ]; then
  FA4_DIR="$WORK/no-fa4" && mkdir -p "$FA4_DIR"
else
  "$PY" -m pip download -q --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \
    -d "$FA4_DIR" "${FA4_WHEELS[@]}"
fi

"$PY" - "${INSTALLED:-$(ls "$DEVICE_CACHE"/vllm-$VLLM_VERSION-*.whl | head -1)}" "$FA4_DIR" "$WORK" <<'EOF'
import glob, os, shutil, sys, zipfile

source, fa4, work = sys.argv[1:]
name = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
os.makedirs(f"{work}/fa2")
os.makedirs(f"{work}/stable")
if os.environ.get("STABLE", "0") == "1":  # vLLM's stable-ABI extension (vllm.merge_attn_states_cuda's op)
    stable = "vllm/_C_stable_libtorch.abi3.so"
    with open(f"{work}/stable/_C_stable_libtorch.abi3.so", "wb") as dst:
        if source.endswith(".so"):  # next to the installed FA2 extension: vllm/vllm_flash_attn/ -> vllm/
            with open(os.path.join(os.path.dirname(os.path.dirname(source)), "_C_stable_libtorch.abi3.so"), "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            with zipfile.ZipFile(source) as z, z.open(stable) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
if os.environ.get("FA2", "1") != "0":
    with open(f"{work}/fa2/_vllm_fa2_C.abi3.so", "wb") as dst:
        if source.endswith(".so"):  # the installed file
            with open(source, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            with zipfile.ZipFile(source) as z, z.open(name) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
for w in sorted(glob.glob(f"{fa4}/*.whl")):  # what `pip install --no-deps --target` does with these wheels: unzip
    zipfile.ZipFile(w).extractall(f"{work}/fa4-site")
os.makedirs(f"{work}/fa4-site", exist_ok=True)
print(f"fa_bundle: {os.listdir(work + '/fa2') or 'no FA2'} and {len(glob.glob(fa4 + '/*.whl'))} FA4 wheels")
EOF

rm -rf "$DEST" && mkdir -p "$DEST"
tar -C "$WORK" -cf - fa2 fa4-site stable | xz -9e -T0 -q > "$WORK/fa.tar.xz"
total=$(stat -c %s "$WORK/fa.tar.xz")
sum=$(sha256sum "$WORK/fa.tar.xz" | cut -d' ' -f1)
split -b "${PART_MIB}M" -d -a 1 "$WORK/fa.tar.xz" "$WORK/fa.tar.xz."
parts=$(ls "$WORK"/fa.tar.xz.? | wc -l)
for f in "$WORK"/fa.tar.xz.?; do
  k=$(( ${f##*.} + 1 ))
  mkdir -p "$DEST/part-$k"
  mv "$f" "$DEST/part-$k/fa.tar.xz.$k"
  printf 'parts %s\nbytes %s\nsha256 %s\n' "$parts" "$total" "$sum" > "$DEST/part-$k/MANIFEST"
done
echo "fa_bundle: $parts parts of at most $PART_MIB MiB ($((total >> 20)) MiB in all) in $DEST:"
du -sh "$DEST"/part-*
echo "carry each in its own call, one after another while the machine stays warm, then .device:"
for k in $(seq 1 "$parts"); do
  echo "  call $k: carry [\"$DEST/part-$k\"], command: bash benchmarks/fa_stage.sh"
done
echo "  call $((parts + 1)): carry [\".device\"], command: bash benchmarks/gpu_fa.sh (gpu_env.sh installs .fa-stage/)"
