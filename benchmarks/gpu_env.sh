# Sourced by the GPU scripts: installs what was carried in .device/ (no network on the lent GPUs) and sets
# PYTHONPATH. `make device-bundle` builds .device/ (benchmarks/device_bundle.sh says what is in it):
# .device/whl/*.whl: hypothesis, attrs, click, rich, pytest, pytest-xdist, pyzmq, regex, requests, ... (cp312);
# .device/vllm-py.tgz: vLLM 0.33.0's Python files (no .so) with vllm/third_party/pynvml.py and an empty
# vllm/_C_stable_libtorch.py, so vllm.platforms detects CUDA (vLLM's own tests need current_platform.device_type);
# .device/sglang/: the four files of the sglang 0.5.23 wheel its Triton attention kernels need (as `make setup`
# extracts them into .venv/share/kvfuzz/sglang/); optionally .device/flashinfer.tgz and .device/flashinfer-whl/
# (benchmarks/flashinfer_bundle.sh); optionally .device/hopper/ (benchmarks/hopper_bundle.sh: FA3's and FlashMLA's
# extensions, xz-packed, and FlashMLA's Python interface), unpacked into the vllm tree; optionally .fa-stage/unpacked/
# (benchmarks/fa_bundle.sh, fa_stage.sh: FA2's extension, FA4's packages). Defines KV (the kvfuzz CLI).
export PYTHONUNBUFFERED=1
# The start every run driver that writes under OUT shares (call it right after sourcing this file): R=$OUT (the script
# stops, naming OUT, when it is unset), made; W a scratch folder, removed when the script exits.
gpu_out() {
  R=${OUT:?set OUT to the folder the results go to}
  mkdir -p "$R" || exit 1
  W=$(mktemp -d)
  trap 'rm -rf "$W"' EXIT
}
# The head of a run's log: the GPUs (name, driver version; $1: nvidia-smi fields before them, e.g. index) and the cores.
gpu_machine() {
  nvidia-smi --query-gpu="${1:+$1,}name,driver_version" --format=csv,noheader
  echo "cpus $(nproc)"
}
# Sourced again under a script that already did it (benchmarks/gpu_lanes.sh runs scripts that source it, in
# parallel): keep what is installed, set KV, and install nothing (a second install would race the first's users)
if [ -n "${KVFUZZ_GPU_ENV:-}" ]; then
  KV="python3 -m kvfuzz.fuzz.cli"
  return 0 2>/dev/null || exit 0
fi
# KVFUZZ_GPU_KEEP=1 (a later call of one lease, e.g. beside benchmarks/gpu_soak_lease.sh's soak): what an earlier
# call installed stays as it is (replacing files a running campaign has open or mapped would break it); only what is
# missing is installed (FlashInfer or FA2 carried by this call)
kept() { [ -n "${KVFUZZ_GPU_KEEP:-}" ] && [ -e "$1" ]; }
[ -f .device/vllm-py.tgz ] && ls .device/whl/*.whl >/dev/null 2>&1 || {
  echo "gpu_env.sh: no .device/ bundle here: run 'make device-bundle' where pip works and carry .device" >&2
  exit 1
}
kept /tmp/site || python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .device/whl/*.whl || exit 1
kept /tmp/vllm/vllm || { rm -rf /tmp/vllm && mkdir -p /tmp/vllm && tar xzf .device/vllm-py.tgz -C /tmp/vllm; } || exit 1
kept /tmp/kv/kvfuzz || python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/kv . || exit 1
export PYTHONPATH=/tmp/kv:/tmp/site:/tmp/vllm${PYTHONPATH:+:$PYTHONPATH}
[ -d .device/sglang ] && export KVFUZZ_SGLANG_TREE=$PWD/.device/sglang
# FA3 and FlashMLA (benchmarks/hopper_bundle.sh, opt-in): .device/hopper/vllm/ mirrors the vllm tree; *.xz files are
# unpacked with Python's lzma (the xz command if this Python lacks it), the rest copied
if [ -d .device/hopper/vllm ] && ! kept /tmp/vllm/.hopper-unpacked; then
  python3 - .device/hopper /tmp/vllm <<'EOF' || exit 1
import os, shutil, subprocess, sys
src, dst = sys.argv[1], sys.argv[2]
try:
    import lzma
except ImportError:
    lzma = None
for root, _, files in os.walk(src):
    for f in files:
        if f.endswith(".from") or f.endswith(".part"):
            continue
        s = os.path.join(root, f)
        d = os.path.join(dst, os.path.relpath(s, src))
        os.makedirs(os.path.dirname(d), exist_ok=True)
        if f.endswith(".xz"):
            d = d[:-3]
            if lzma is not None:
                with lzma.open(s) as i, open(d, "wb") as o:
                    shutil.copyfileobj(i, o, 1 << 20)
            else:
                with open(d, "wb") as o:
                    subprocess.run(["xz", "-dc", s], stdout=o, check=True)
            os.chmod(d, 0o755)
        else:
            shutil.copyfile(s, d)
EOF
  touch /tmp/vllm/.hopper-unpacked
fi
# FlashInfer (benchmarks/flashinfer_bundle.sh, opt-in): the trimmed flashinfer package and apache-tvm-ffi, and its JIT
# settings: cache under /tmp/fi-ws, 16 nvcc jobs, sm90 only
if [ -f .device/flashinfer.tgz ]; then
  kept /tmp/fi-site || python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/fi-site \
    .device/flashinfer-whl/*.whl || exit 1
  kept /tmp/fi/flashinfer || { rm -rf /tmp/fi && mkdir -p /tmp/fi && tar xzf .device/flashinfer.tgz -C /tmp/fi; } || exit 1
  export PYTHONPATH=/tmp/fi:/tmp/fi-site:$PYTHONPATH
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws} MAX_JOBS=${MAX_JOBS:-16} \
    FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
fi
# FlashAttention 2 and 4 (benchmarks/fa_bundle.sh, carried in parts and unpacked by benchmarks/fa_stage.sh into the
# ignored .fa-stage/): FA2's extension into the vllm tree, FA4's packages on the path. An H100 runs FA2's compute_80
# PTX through the driver's JIT: its cache made big enough for every module and kept in .fa-stage/ across calls
if [ -d .fa-stage/unpacked/fa2 ]; then
  [ ! -f .fa-stage/unpacked/fa2/_vllm_fa2_C.abi3.so ] || kept /tmp/vllm/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so || \
    cp .fa-stage/unpacked/fa2/_vllm_fa2_C.abi3.so /tmp/vllm/vllm/vllm_flash_attn/ || exit 1
  # nvidia-cutlass-dsl puts its dsl_packages on sys.path through a .pth file, which PYTHONPATH does not read
  export PYTHONPATH=$PWD/.fa-stage/unpacked/fa4-site/nvidia_cutlass_dsl/dsl_packages:$PWD/.fa-stage/unpacked/fa4-site:$PYTHONPATH
  export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$PWD/.fa-stage/nv-cache} CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
  # vLLM's stable-ABI extension (fa_bundle.sh STABLE=1; vllm.merge_attn_states_cuda): kept only if it loads with this
  # torch, else the bundle's empty stand-in stays the module (vllm.platforms must still import)
  s=.fa-stage/unpacked/stable/_C_stable_libtorch.abi3.so
  if [ -f "$s" ] && ! kept /tmp/vllm/vllm/_C_stable_libtorch.abi3.so; then
    cp "$s" /tmp/vllm/vllm/ && (cd /tmp/vllm && python3 -c "import torch, vllm._C_stable_libtorch" >/dev/null 2>&1) || {
      echo "gpu_env: vllm/_C_stable_libtorch.abi3.so does not load here; the stand-in stays" >&2
      rm -f /tmp/vllm/vllm/_C_stable_libtorch.abi3.so; }
  fi
fi
KV="python3 -m kvfuzz.fuzz.cli"
export KVFUZZ_GPU_ENV=1
