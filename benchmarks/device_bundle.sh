#!/usr/bin/env bash
# Builds .device/, the offline bundle that benchmarks/gpu_env.sh installs on a lent GPU machine (x86-64,
# Python 3.12, torch + triton + numpy already there, no network): `make device-bundle`.
#   .device/whl/          cp312 manylinux x86_64 (or pure-Python) wheels of what kvfuzz, its pytest plugin
#                         (with -n: pytest-xdist) and vLLM's kernel imports need that the GPU image may lack
#   .device/vllm-py.tgz   vLLM 0.33.0's Python files: the wheel without *.so, vllm/vllm-rs, vllm/models,
#                         vllm/entrypoints and vllm/third_party except pynvml.py (CUDA detection); plus an empty
#                         vllm/_C_stable_libtorch.py standing in for the compiled module vllm/platforms/cuda.py
#                         imports (without both, vLLM's own tests see current_platform.device_type == "")
#   .device/sglang/       the sglang 0.5.23 kernel files `make setup` extracts into .venv/share/kvfuzz/sglang
# Idempotent: wheels already in .device/whl/ are not downloaded again, stale versions are removed, and the
# vLLM wheel (~hundreds of MB, never carried) is cached in $DEVICE_CACHE. A device call carries 64 MiB in all,
# working tree included: this fails if the bundle is over $BUNDLE_MAX_MIB (56).
# Usage: bash benchmarks/device_bundle.sh   (env: PY, DEST, DEVICE_CACHE, SGLANG_TREE, BUNDLE_MAX_MIB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.device}
DEVICE_CACHE=${DEVICE_CACHE:-.venv/share/kvfuzz/device-cache}
SGLANG_TREE=${SGLANG_TREE:-.venv/share/kvfuzz/sglang}
BUNDLE_MAX_MIB=${BUNDLE_MAX_MIB:-56}
VLLM_VERSION=0.33.0

# One pinned version each (the versions `make setup` installs here). Requires-Dist closure, less what the GPU
# image brings (torch, triton, numpy, typing_extensions, filelock, jinja2, sympy, ...):
WHEELS=(
  hypothesis==6.170.15 sortedcontainers==2.4.0 attrs==26.1.0   # kvfuzz
  click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3  # the guard plugin, vLLM's tests
  pytest-xdist==3.8.0 execnet==2.1.2                            # pytest -n
  regex==2026.11.15 pyzmq==27.3.0 psutil==7.2.2                 # vllm.platforms, vllm.distributed
  cachetools==8.0.1 blake3==1.0.11                              # vllm.utils
  requests==2.34.2 certifi==2026.10.18 charset-normalizer==3.5.2 idna==3.20 urllib3==2.8.0  # vllm.utils.flashinfer
  py-spy==0.4.3                                                 # benchmarks/gpu_profile.sh: workers' profiles
)

[ -x "$PY" ] || { echo "device_bundle: $PY not found (run make setup, or set PY=)" >&2; exit 1; }
[ -d "$SGLANG_TREE/sglang" ] || { echo "device_bundle: no $SGLANG_TREE/sglang (run make setup)" >&2; exit 1; }
mkdir -p "$DEST/whl" "$DEVICE_CACHE"

norm() { echo "$1" | tr 'A-Z.-' 'a-z__'; }
key() { local b; b=$(basename "$1"); echo "$(norm "$(echo "$b" | cut -d- -f1)")-$(norm "$(echo "$b" | cut -d- -f2)")"; }
want=" " have=" "
for f in "$DEST"/whl/*.whl; do [ ! -e "$f" ] || have+="$(key "$f") "; done
missing=()
for spec in "${WHEELS[@]}"; do
  name=$(norm "${spec%%==*}") version=${spec#*==}
  want+="$name-$(norm "$version") "
  [[ "$have" == *" $name-$(norm "$version") "* ]] || missing+=("$spec")
done
for f in "$DEST"/whl/*.whl; do              # stale versions and dropped packages: one version each
  [ -e "$f" ] || continue
  b=$(basename "$f")
  [[ "$want" == *" $(key "$b") "* ]] || { echo "removing $b"; rm -f "$f"; }
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "downloading ${#missing[@]} wheels: ${missing[*]}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST/whl" "${missing[@]}"
fi

# vLLM's Python files, rebuilt when missing or when this recipe changed (its hash is kept beside the tarball)
recipe=$(sed -n '/^ *# vllm-py recipe/,/^ *# end vllm-py recipe/p' "$0" | sha256sum | cut -c1-16)
if [ ! -f "$DEST/vllm-py.tgz" ] || [ "$(cat "$DEST/vllm-py.recipe" 2>/dev/null)" != "$recipe" ]; then
  ls "$DEVICE_CACHE"/vllm-$VLLM_VERSION-*.whl >/dev/null 2>&1 || \
    "$PY" -m pip download -q --no-deps -d "$DEVICE_CACHE" "vllm==$VLLM_VERSION"
  # vllm-py recipe
  "$PY" - "$(ls "$DEVICE_CACHE"/vllm-$VLLM_VERSION-*.whl | head -1)" "$DEVICE_CACHE/vllm-py.tgz" <<'EOF'
import io, sys, tarfile, zipfile

wheel, out = sys.argv[1], sys.argv[2]
DROP = ("vllm/vllm-rs", "vllm/models/", "vllm/entrypoints/", "vllm/third_party/")  # vllm-rs: a binary
KEEP = ("vllm/third_party/pynvml.py", "vllm/third_party/__init__.py")
STAND_IN = "vllm/_C_stable_libtorch.py"  # the compiled module's name; vllm/platforms/cuda.py imports it


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


with zipfile.ZipFile(wheel) as z, tarfile.open(out + ".part", "w:gz") as tar:
    for name in sorted(z.namelist()):
        if name.endswith("/") or name.endswith(".so") or ".so." in name:
            continue
        if name.startswith(DROP) and name not in KEEP:
            continue
        add(tar, name, z.read(name))
    add(tar, STAND_IN, b"# empty stand-in for the compiled vllm._C_stable_libtorch (kvfuzz device bundle)\n")
EOF
  # end vllm-py recipe
  mv "$DEVICE_CACHE/vllm-py.tgz.part" "$DEST/vllm-py.tgz"
  echo "$recipe" > "$DEST/vllm-py.recipe"
fi

rm -rf "$DEST/sglang" && cp -r "$SGLANG_TREE" "$DEST/sglang"

ls "$DEST/whl"
bytes=$(du -sb "$DEST" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "device bundle: $DEST, $(ls "$DEST/whl" | wc -l) wheels, vllm-py.tgz $(du -h "$DEST/vllm-py.tgz" | cut -f1), total $mib MiB"
if [ "$mib" -gt "$BUNDLE_MAX_MIB" ]; then
  echo "device_bundle: $mib MiB is over $BUNDLE_MAX_MIB MiB (a device call carries 64 MiB, working tree included)" >&2
  exit 1
fi
