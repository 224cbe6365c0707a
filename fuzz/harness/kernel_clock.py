"""The kernel call's own time (:class:`KernelClock`, for :func:`kvfuzz.fuzz.harness.run.run_kernel`): the wall time
of ``Target.run`` and the device synchronization after it, split into

- ``compile``: seconds the call spent compiling or loading kernels (:data:`COMPILES`): Triton's JIT (from its
  ``jit_cache_hook`` to its ``jit_post_compile_hook``, and from ``kernel_load_start_hook`` to
  ``kernel_load_end_hook`` where Triton has them: ``triton.knobs.runtime``, Triton 3.4 and later; the hooks a
  target or library set before are still called), TorchDynamo's frame compiles
  (``torch._dynamo.utils.compilation_time_metrics["_compile.compile_inner"]``), and the whole call when it started a
  compiler process (:data:`COMPILERS`, seen through Python's ``subprocess.Popen`` audit event: FlashInfer's JIT runs
  ninja and nvcc);
- ``queued``: on CUDA, the call waiting for device work queued before it (the harness's own asynchronous work: data
  drawn on the device, the materialized cache, the output's poison; other processes' kernels under CUDA MPS): the
  call's wall time, less its compiles, beyond the device time between two CUDA events recorded around it;
- ``kernel``: the rest, the call's own time.

A first call that compiles is not the kernel's speed, and a synchronization that waits for the harness's own queued
work is not the kernel's either: both used to be counted as kernel time. The compile hooks are installed only in a
process that asks (:meth:`Compiles.listen`: a campaign's worker); elsewhere (``kvfuzz.check_example`` in a user's
test) only TorchDynamo's own metrics are read.
"""

from __future__ import annotations

import os
import sys
import time

#: Process names (as ``/proc/PID/stat``'s comm and an executable's base name) of the compilers a kernel's first call
#: may run: FlashInfer's JIT (ninja, nvcc and what nvcc runs), Triton (ptxas) and host compilers.
COMPILERS = frozenset({"ninja", "nvcc", "cicc", "ptxas", "cudafe++", "fatbinary", "nvlink", "cc1plus", "cc1", "c++",
                       "g++", "gcc", "ld", "clang", "clang++"})


class Compiles:
    """Seconds this process has spent compiling kernels, from every source it can see (the module docstring), and
    how many compiler processes it started. A process that wants them calls :meth:`listen` (a campaign's worker:
    the hooks stay for the process's life); :meth:`seconds` is then a running total. TorchDynamo's compiles are
    read without listening."""

    def __init__(self) -> None:
        self._closed = 0.0  # finished Triton compiles and loads
        self._open: dict[str, float] = {}  # a Triton compile or load in progress: its start
        self.compilers = 0  # compiler processes started (subprocess.Popen of a COMPILERS name)
        self.listening = self._triton = False
        self._dynamo = (0, 0.0)  # entries of compilation_time_metrics["_compile.compile_inner"] summed, and their sum

    def listen(self) -> None:
        """Hook what tells of compiles in this process (Python's audit hook: once; Triton's JIT hooks: once Triton
        is imported, checked again by :meth:`catch_up`). Idempotent."""
        if not self.listening:
            self.listening = True
            sys.addaudithook(self._on_audit)
        self.catch_up()

    def catch_up(self) -> None:
        """Hook Triton if it was imported since (cheap when there is nothing to do; nothing unless listening)."""
        if self.listening and not self._triton and "triton" in sys.modules:
            self._triton = True
            self._hook_triton()

    def seconds(self) -> float:
        """Seconds spent compiling so far (a Triton compile in progress counted up to now)."""
        now = time.perf_counter()
        return self._closed + sum(now - s for s in self._open.values()) + self._dynamo_seconds()

    def _on_audit(self, event: str, args: tuple) -> None:
        if event == "subprocess.Popen":
            exe = args[0] or (args[1][0] if args[1] else "")
            if os.path.basename(os.fsdecode(exe)) in COMPILERS:
                self.compilers += 1

    def _dynamo_seconds(self) -> float:
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return 0.0
        times = getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner", ())
        n, total = self._dynamo
        if len(times) != n:
            self._dynamo = n, total = len(times), sum(times)
        return total

    def _begin(self, what: str) -> None:
        self._open[what] = time.perf_counter()

    def _end(self, what: str) -> None:
        start = self._open.pop(what, None)
        if start is not None:
            self._closed += time.perf_counter() - start

    def _hook_triton(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime
        for name, what, begin in (("jit_cache_hook", "compile", True), ("jit_post_compile_hook", "compile", False)):
            if hasattr(runtime, name):
                setattr(runtime, name, self._chained(getattr(runtime, name), what, begin))
        for name, what, begin in (("kernel_load_start_hook", "load", True), ("kernel_load_end_hook", "load", False)):
            chain = getattr(runtime, name, None)
            if hasattr(chain, "add"):
                chain.add(self._loading(what, begin))

    def _chained(self, before, what: str, begin: bool):
        """A JIT hook that marks a compile's start or end and returns what the hook set before it returns (Triton
        skips the compile when the cache hook returns True)."""
        def hook(*args, **kwargs):
            (self._begin if begin else self._end)(what)
            return before(*args, **kwargs) if before is not None else None
        return hook

    def _loading(self, what: str, begin: bool):
        def hook(*args, **kwargs):
            (self._begin if begin else self._end)(what)
        return hook


#: This process's compiles.
COMPILES = Compiles()


class KernelClock:
    """Times one kernel call: made right before it, :meth:`ran` right after ``Target.run`` returns (before the
    synchronization), :meth:`stop` at the end. ``cuda``: the call's tensors are on a CUDA device (CUDA events are
    recorded around it)."""

    def __init__(self, cuda: bool) -> None:
        COMPILES.catch_up()
        self._events = None
        if cuda:
            import torch

            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._compilers = COMPILES.compilers
        self._compiled = COMPILES.seconds()
        self._start = time.perf_counter()
        self._ran = False

    def ran(self) -> None:
        """``Target.run`` returned: mark its end on the device."""
        if self._events is not None:
            self._events[1].record()
            self._ran = True

    def stop(self, timings) -> None:
        """Set ``timings.kernel``, ``.compile`` and ``.queued`` (a :class:`~kvfuzz.fuzz.harness.run.Timings`) for
        this call. Never raises."""
        wall = time.perf_counter() - self._start
        compiled = wall if COMPILES.compilers > self._compilers else min(wall, COMPILES.seconds() - self._compiled)
        own = wall - compiled
        kernel = own
        if self._ran:
            try:
                kernel = min(own, self._events[0].elapsed_time(self._events[1]) / 1000.0)
            except Exception:  # an error left on the device: its crash is the finding, the split is moot
                kernel = own
        timings.compile, timings.kernel, timings.queued = compiled, max(0.0, kernel), max(0.0, own - kernel)


__all__ = ["COMPILERS", "COMPILES", "Compiles", "KernelClock"]
