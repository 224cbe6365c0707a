# Sourced by the GPU scripts: installs what was carried in .device/ (no network on the lent GPUs) and sets
# PYTHONPATH. .device/whl/*.whl: hypothesis, attrs, click, rich, pyzmq, cachetools, blake3, regex, ...;
# .device/vllm-py.tgz: vLLM 0.33.0's Python files (no .so); .device/sglang/: the four files of the sglang 0.5.23
# wheel its Triton attention kernels need (as `make setup` extracts them into .venv/share/kvfuzz/sglang/).
# Defines KV (the kvfuzz CLI).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .device/whl/*.whl || exit 1
mkdir -p /tmp/vllm && tar xzf .device/vllm-py.tgz -C /tmp/vllm || exit 1
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/kv . || exit 1
export PYTHONPATH=/tmp/kv:/tmp/site:/tmp/vllm
[ -d .device/sglang ] && export KVFUZZ_SGLANG_TREE=$PWD/.device/sglang
KV="python3 -m kvfuzz.fuzz.cli"
