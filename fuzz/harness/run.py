"""What one example produces as it moves through the harness: its data, cache, call, output and reference
(:class:`Run`), the seconds spent per stage (:class:`Timings`), and the two steps every property shares:
drawing the ground truth (:func:`generate`) and running the kernel (:func:`run_kernel`)."""

from __future__ import annotations

import time
import traceback

import attrs
import torch

from kvfuzz.contracts.data import BatchData, make_batch_data
from kvfuzz.contracts.example import Example
from kvfuzz.contracts.materialize import CacheState
from kvfuzz.fuzz.targets.base import KernelCall, Target


@attrs.define
class Timings:
    """Seconds spent per stage of one example."""

    generate: float = 0.0
    materialize: float = 0.0
    check_caller: float = 0.0
    kernel: float = 0.0
    reference: float = 0.0
    check_output: float = 0.0


@attrs.define
class Run:
    """Everything one example produced: inputs, the call, the output and the reference (for reproducers)."""

    example: Example
    data: BatchData
    cache: CacheState
    call: KernelCall
    output: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    timings: Timings = attrs.Factory(Timings)
    path: str = ""
    ratio: float = 0.0


def generate(example: Example) -> tuple[BatchData, Timings]:
    """The example's ground-truth tensors, and a Timings with the generation time filled in."""
    t = Timings()
    s = time.perf_counter()
    data = make_batch_data(example.batch)
    t.generate = time.perf_counter() - s
    return data, t


def run_kernel(target: Target, call: KernelCall) -> tuple[torch.Tensor | None, str | None]:
    """Run the kernel (synchronizing CUDA so its errors surface here); returns ``(output, None)`` or
    ``(None, "<error and the last frames of its traceback>")`` when it raised."""
    try:
        out = target.run(call)
        if call.key_cache.is_cuda:
            torch.cuda.synchronize()
        return out, None
    except Exception as e:  # the kernel's own error, reported as a finding
        return None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
