"""What one example produces as it moves through the harness: its data, cache, call, output and reference
(:class:`Run`), the seconds spent per stage (:class:`Timings`), and the two steps every property shares:
drawing the ground truth (:func:`generate`) and running the kernel (:func:`run_kernel`, which follows the
isolated-process rules of :mod:`kvfuzz.fuzz.harness.isolation`)."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import attrs
import torch

from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.model.data import BatchData, make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.harness import memory
from kvfuzz.fuzz.harness.isolation import STOP, exit_if_device_unusable
from kvfuzz.fuzz.harness.kernel_clock import KernelClock
from kvfuzz.fuzz.harness.memory import RETRIES_OUT_OF_MEMORY
from kvfuzz.fuzz.targets.base import KernelCall, Target


@attrs.define
class Timings:
    """Seconds spent per stage of one example. ``kernel`` is the kernel call's own time; ``compile`` (JIT compiles
    and kernel loads during the call) and ``queued`` (the call waiting on the device for work queued before it)
    are apart (:class:`~kvfuzz.fuzz.harness.kernel_clock.KernelClock`)."""

    generate: float = 0.0
    materialize: float = 0.0
    check_caller: float = 0.0
    kernel: float = 0.0
    reference: float = 0.0
    check_output: float = 0.0
    compile: float = 0.0
    queued: float = 0.0


@attrs.define
class Run:
    """Everything one example produced: inputs, the call, the output and the reference (for reproducers).
    ``reference`` (fp64, on the CPU) and ``envelope`` (fp64, on the reference device), both
    ``[num_tokens, num_heads, head_size]``, are set by the attention property; a run handed to it with both set
    is checked against them instead of computing them again. ``data`` is on the reference device
    (:func:`reference_device`; any device when a caller hands it over). ``fault``: the caller fault
    (:class:`~kvfuzz.fuzz.harness.faults.CallerFault`) it was prepared with, None for none.

    The reference stays where it was computed (``device_reference``, the reference device) until ``reference`` is
    read, which copies it to the CPU once: a passing example of a large batch never pays for the copy.

    ``prepared``: the run's :meth:`fingerprint` when the attention property's prepare built it from the example
    alone (no data handed over, nothing changed after materializing), else None. While the fingerprint still
    matches, the run holds exactly the call that prepare builds for the example (kvfuzz.fuzz.harness.attention)."""

    example: Example
    data: BatchData
    cache: CacheState
    call: KernelCall
    output: torch.Tensor | None = None
    device_reference: torch.Tensor | None = attrs.field(default=None, alias="reference")
    envelope: torch.Tensor | None = None
    timings: Timings = attrs.Factory(Timings)
    path: str = ""
    ratio: float = 0.0
    fault: Any = None
    prepared: tuple | None = None

    def fingerprint(self) -> tuple | None:
        """The identity of the data, cache and call objects and the identity and version counter of every tensor
        in them (the call's keyword arguments included): any in-place change to one of them, or any of them
        replaced, changes it; a kernel writing through a pointer does not. None when a tensor keeps no version
        counter (an inference tensor)."""
        tensors = [*(getattr(self.data, f.name) for f in attrs.fields(BatchData)), self.cache.key_cache,
                   self.cache.value_cache, self.call.key_cache, self.call.value_cache, self.call.key, self.call.value,
                   *self.call.kwargs.values()]
        try:
            return (id(self.data), id(self.cache), id(self.call)) + tuple(
                (id(t), t._version) for t in tensors if isinstance(t, torch.Tensor))
        except RuntimeError:
            return None

    @property
    def reference(self) -> torch.Tensor | None:
        """The fp64 reference on the CPU (None until the attention property set it)."""
        if self.device_reference is not None and self.device_reference.device.type != "cpu":
            self.device_reference = self.device_reference.cpu()
        return self.device_reference

    @reference.setter
    def reference(self, value: torch.Tensor | None) -> None:
        self.device_reference = value


#: Batches of a CUDA target with at least this many KV elements (``Batch.kv_elements``)
#: get their fp64 reference on the GPU; smaller ones on the CPU (a small reference is a few hundred tiny kernel
#: launches, which workers sharing one GPU queue behind each other). Environment: KVFUZZ_GPU_REFERENCE_MIN_KV.
GPU_REFERENCE_MIN_KV = int(os.environ.get("KVFUZZ_GPU_REFERENCE_MIN_KV", 1 << 16))
#: Batches of a CUDA target whose reference costs at least this many fp64 multiply-adds (:func:`reference_work`)
#: get it on the GPU however few KV elements they hold; 0: off (the default, until measured on a GPU). The KV
#: elements leave out the query heads (up to 16 per kv head) and the query rows: on a 2-core CPU, over a third of
#: FA3's small examples hold under 2**16 KV elements yet need 2**22 or more multiply-adds, ~10 ms of one CPU thread
#: each, and those examples take 88% of the tier's reference time (benchmarks/reference_placement.py).
#: Environment: KVFUZZ_GPU_REFERENCE_MIN_WORK (e.g. 4194304).
GPU_REFERENCE_MIN_WORK = int(os.environ.get("KVFUZZ_GPU_REFERENCE_MIN_WORK", 0))


def reference_work(batch) -> int:
    """The fp64 multiply-adds of ``batch``'s reference, at most: every query head's logits over its sequence's keys
    (``head_size`` each) and their products with the values (``head_size_v`` each),
    ``num_heads * (head_size + head_size_v) * sum_i query_len_i * seq_len_i``."""
    rows = sum(q * (c + q) for q, c in zip(batch.query_lens, batch.ctx_lens))
    return batch.num_heads * (batch.head_size + batch.head_size_v) * rows


def reference_device(target: Target, batch) -> str:
    """Where the attention property draws ``batch``'s data and computes its reference: the CPU, or a CUDA
    target's GPU for a batch of at least :data:`GPU_REFERENCE_MIN_KV` KV elements, or (when
    :data:`GPU_REFERENCE_MIN_WORK` is set) of at least that much :func:`reference_work`."""
    device = target.device
    if device == "cpu":
        return "cpu"
    if batch.kv_elements >= GPU_REFERENCE_MIN_KV:
        return device
    if GPU_REFERENCE_MIN_WORK and reference_work(batch) >= GPU_REFERENCE_MIN_WORK:
        return device
    return "cpu"


def generate(example: Example, device: str | torch.device = "cpu") -> tuple[BatchData, Timings]:
    """The example's ground-truth tensors, drawn on ``device`` (the same bits on every device:
    :func:`~kvfuzz.contracts.model.data.make_batch_data`), and a Timings with the generation time filled in."""
    t = Timings()
    s = time.perf_counter()
    data = make_batch_data(example.batch, device)
    t.generate = time.perf_counter() - s
    return data, t


#: The phases of an example a campaign's journal records: a process that dies in "kernel" died inside the
#: kernel call; in "prepare" or "check" it died in kvfuzz or the adapter.
PHASES = ("prepare", "kernel", "check")


def run_kernel(target: Target, call: KernelCall, on_phase: Callable[[str], None] | None = None,
               timings: Timings | None = None) -> tuple[torch.Tensor | None, str | None]:
    """Run the kernel (synchronizing CUDA so its errors surface here); returns ``(output, None)``, or
    ``(None, "<ExceptionType>: <message>\n<last frames>")`` when it raised anything: an Exception, SystemExit
    (a kernel must not end the process), MemoryError, or a KeyboardInterrupt that no stop request explains.
    Running out of device memory (:func:`kvfuzz.fuzz.harness.memory.is_out_of_memory`) while a campaign runs the
    example without the device-memory lock (:data:`kvfuzz.fuzz.harness.memory.RETRIES_OUT_OF_MEMORY`) propagates
    instead: other workers' memory may have filled the device, and the campaign re-runs the example holding the
    lock; alone on the device, it is the kernel's, unless the device is full all the same
    (:func:`~kvfuzz.fuzz.harness.memory.device_full`: other processes' memory), when it propagates too.
    ``on_phase`` is told "kernel" right before the call and "check" right after it. ``timings``: gets the call's
    ``kernel``, ``compile`` and ``queued`` seconds (:class:`~kvfuzz.fuzz.harness.kernel_clock.KernelClock`)."""
    if on_phase is not None:
        on_phase("kernel")
    clock = KernelClock(call.key_cache.is_cuda) if timings is not None else None
    try:
        out = target.run(call)
        if call.key_cache.is_cuda:
            if clock is not None:
                clock.ran()
            torch.cuda.synchronize()
        return out, None
    except KeyboardInterrupt as e:
        if STOP.is_set():
            raise
        return None, (f"{type(e).__name__} raised by the kernel (no stop was requested)\n"
                      f"{traceback.format_exc(limit=-3)}")
    except (Exception, SystemExit) as e:  # the kernel's own error, reported as a finding
        if memory.is_out_of_memory(e) and (RETRIES_OUT_OF_MEMORY.is_set() or memory.device_full()):
            # without the device-memory lock: the campaign re-runs it alone on the device (campaign.runner); on the
            # last retry too while other processes keep the device full (skipped, never the kernel's finding)
            raise
        crash = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
        # still in phase "kernel" (the finally below does not run): the parent decides whose fault it is
        exit_if_device_unusable(e, "the kernel", crash)
        return None, crash
    finally:
        if clock is not None:
            clock.stop(timings)
        if on_phase is not None:
            on_phase("check")


def error_name(crash: str) -> str:
    """The exception type a :func:`run_kernel` error text starts with (``"SystemExit"``, ``"RuntimeError"``)."""
    head = crash.split("\n", 1)[0]
    return head.split(":", 1)[0].split(" ", 1)[0]


__all__ = ["GPU_REFERENCE_MIN_KV", "GPU_REFERENCE_MIN_WORK", "PHASES", "Run", "Timings", "error_name", "generate",
           "reference_device", "reference_work", "run_kernel"]
