"""A torch paged-attention kernel with a planted out-of-bounds read that only a memory checker sees, and a
stand-in for compute-sanitizer that runs the program (tests/fuzz/harness/test_sanitizer.py); :class:`CompilesPerConfig`
a correct one whose first call of each block_size "compiles" (the sanitized example's phases).

:class:`HalfTileOverrun` computes the right output (it is :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch`) but,
like vLLM#56862's unified_attention (a block-table entry loaded past the row on the final tile), "reads" past its
block table whenever a sequence's seq_len is even: in a sanitized child (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, as
kvfuzz.fuzz.harness.sanitizer sets it) it prints the access as compute-sanitizer memcheck would.
:data:`FAKE_SANITIZER` is a compute-sanitizer that runs its program, passes its output through and ends with an
``ERROR SUMMARY`` counting the invalid accesses printed.
"""

import os
import time

from kvfuzz.fuzz.bench.paged_torch import PagedTorch

ACCESS = """========= Invalid __global__ read of size 4 bytes
=========     at kernel_half_tile+0x40 in /planted/half_tile.py:7
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000000204 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f0000000200 of size 4 bytes
========="""

FAKE_SANITIZER = """#!{python}
import subprocess, sys
args = sys.argv[1:]
program = args[args.index({python!r}):]  # compute-sanitizer's own options come first
print("========= COMPUTE-SANITIZER", flush=True)
p = subprocess.Popen(program, stdout=subprocess.PIPE, text=True, bufsize=1)
errors = 0
for line in p.stdout:
    errors += "Invalid __global__" in line
    print(line, end="", flush=True)
p.wait()
print(f"========= ERROR SUMMARY: {{errors}} error{{'' if errors == 1 else 's'}}", flush=True)
sys.exit(p.returncode)
"""


class HalfTileOverrun(PagedTorch):
    name = "planted.half_tile_overrun"
    description = "torch paged attention, right output, an out-of-bounds read (seen by memcheck) at even seq_len"

    def run(self, call):
        out = super().run(call)
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1" and any(
                n % 2 == 0 for n in call.kwargs["seq_lens"].tolist()):
            print(ACCESS, flush=True)
        return out


class CompilesPerConfig(PagedTorch):
    """Correct (it is :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch`), but each process's first kernel call of a
    block_size first "compiles": it sleeps KVFUZZ_PLANTED_COMPILE_S seconds (default 0.05) between Triton's JIT
    hooks, as a Triton kernel's first call of a new specialization does (in a sanitized child: a new kernel
    configuration). With KVFUZZ_PLANTED_SANITIZE_ON_CPU=1 in the environment, making one lets
    kvfuzz.fuzz.harness.sanitizer run on CPU in this process (``applies``): a campaign's workers, which the kvfuzz
    command starts, cannot be monkeypatched, and the planted compute-sanitizer stands in for CUDA's there."""

    name = "planted.compiles_per_config"
    description = "torch paged attention whose first call of each block_size sleeps inside Triton's JIT hooks"
    compiled: set = set()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.environ.get("KVFUZZ_PLANTED_SANITIZE_ON_CPU") == "1":
            from kvfuzz.fuzz.harness import sanitizer

            sanitizer.applies = lambda target: True

    def build_call(self, batch, data, cache):
        import triton  # noqa: F401  (a Triton kernel's module is loaded before its first call)

        return super().build_call(batch, data, cache)

    def run(self, call):
        block_size = call.kwargs["key_cache"].shape[1]
        if block_size not in CompilesPerConfig.compiled:
            CompilesPerConfig.compiled.add(block_size)
            from triton import knobs

            hook = dict(key=f"planted-{block_size}", repr="planted", fn=None, compile={}, is_manual_warmup=False,
                        already_compiled=False)
            if knobs.runtime.jit_cache_hook is not None:
                knobs.runtime.jit_cache_hook(**hook)
            time.sleep(float(os.environ.get("KVFUZZ_PLANTED_COMPILE_S", "0.05")))
            if knobs.runtime.jit_post_compile_hook is not None:
                knobs.runtime.jit_post_compile_hook(**hook)
        return super().run(call)


class WarmUpWatch(PagedTorch):
    """Correct (it is :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch`); what a sanitized child's warm-up
    (kvfuzz.fuzz.harness.sanitizer_warmup) prepares is seen: each call it builds, after the cache is materialized,
    appends ``dtype kv_cache_dtype head_size`` to the file KVFUZZ_PLANTED_BUILDS names. A batch of the first declared
    head_size (the warm-up's; the tests' real examples use another) raises with KVFUZZ_PLANTED_WARM=raise, and prints
    an invalid access as memcheck would with KVFUZZ_PLANTED_WARM=access."""

    name = "planted.warm_up_watch"
    description = "torch paged attention that records the calls it builds and can refuse the warm-up's"

    def build_call(self, batch, data, cache):
        if os.environ.get("KVFUZZ_PLANTED_BUILDS"):
            with open(os.environ["KVFUZZ_PLANTED_BUILDS"], "a") as f:
                f.write(f"{batch.dtype} {batch.kv_cache_dtype} {batch.head_size}\n")
        if batch.head_size == self.capabilities.head_sizes[0]:
            if os.environ.get("KVFUZZ_PLANTED_WARM") == "raise":
                raise RuntimeError("planted: the warm-up's batch refused")
            if os.environ.get("KVFUZZ_PLANTED_WARM") == "access":
                print(ACCESS, flush=True)
        return super().build_call(batch, data, cache)


STALE = ACCESS.replace("kernel_half_tile+0x40 in /planted/half_tile.py:7", "kernel_stale+0x10 in /planted/stale.py:9")

#: FAKE_SANITIZER, but a standby child (``--serve`` with sanitize()'s options: no ``--destroy-on-device-error``)
#: hangs before it runs its program, as a child stuck in its start would.
HANGING_STANDBY = FAKE_SANITIZER.replace(
    'print("========= COMPUTE-SANITIZER", flush=True)',
    'print("========= COMPUTE-SANITIZER", flush=True)\n'
    'if "--serve" in program and "--destroy-on-device-error" not in args:\n'
    '    import time; time.sleep(3600)')


class CarriesState(HalfTileOverrun):
    """:class:`HalfTileOverrun`, but a process that ran an example before carries it: each later kernel call also
    prints a stale invalid access (``/planted/stale.py:9``), as a child whose earlier example left its state behind
    would. A confirmation in such a child counts that access; in a child that ran no example, it does not. Each call
    prints ``planted: run under PID``, PID the process that started it (the compute-sanitizer running the child)."""

    name = "planted.carries_state"
    description = "HalfTileOverrun whose process reports a stale access once it has run an example"
    calls = 0

    def run(self, call):
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
            print(f"planted: run under {os.getppid()}", flush=True)
            if CarriesState.calls:
                print(STALE, flush=True)
        CarriesState.calls += 1
        return super().run(call)
