# Sourced by the GPU scripts: installs what was carried in .device/ (no network on the lent GPUs) and sets
# PYTHONPATH. `make device-bundle` builds .device/ (benchmarks/device_bundle.sh says what is in it):
# .device/whl/*.whl: hypothesis, attrs, click, rich, pytest, pytest-xdist, pyzmq, regex, requests, ... (cp312);
# .device/vllm-py.tgz: vLLM 0.33.0's Python files (no .so) with vllm/third_party/pynvml.py and an empty
# vllm/_C_stable_libtorch.py, so vllm.platforms detects CUDA (vLLM's own tests need current_platform.device_type);
# .device/sglang/: the four files of the sglang 0.5.23 wheel its Triton attention kernels need (as `make setup`
# extracts them into .venv/share/kvfuzz/sglang/); optionally .device/flashinfer.tgz and .device/flashinfer-whl/
# (benchmarks/flashinfer_bundle.sh). Defines KV (the kvfuzz CLI).
export PYTHONUNBUFFERED=1
[ -f .device/vllm-py.tgz ] && ls .device/whl/*.whl >/dev/null 2>&1 || {
  echo "gpu_env.sh: no .device/ bundle here: run 'make device-bundle' where pip works and carry .device" >&2
  exit 1
}
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .device/whl/*.whl || exit 1
rm -rf /tmp/vllm && mkdir -p /tmp/vllm && tar xzf .device/vllm-py.tgz -C /tmp/vllm || exit 1
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/kv . || exit 1
export PYTHONPATH=/tmp/kv:/tmp/site:/tmp/vllm${PYTHONPATH:+:$PYTHONPATH}
[ -d .device/sglang ] && export KVFUZZ_SGLANG_TREE=$PWD/.device/sglang
# FlashInfer (benchmarks/flashinfer_bundle.sh, opt-in): the trimmed flashinfer package and apache-tvm-ffi, and its JIT
# settings: cache under /tmp/fi-ws, 16 nvcc jobs, sm90 only
if [ -f .device/flashinfer.tgz ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/fi-site .device/flashinfer-whl/*.whl || exit 1
  rm -rf /tmp/fi && mkdir -p /tmp/fi && tar xzf .device/flashinfer.tgz -C /tmp/fi || exit 1
  export PYTHONPATH=/tmp/fi:/tmp/fi-site:$PYTHONPATH
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws} MAX_JOBS=${MAX_JOBS:-16} \
    FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
fi
KV="python3 -m kvfuzz.fuzz.cli"
