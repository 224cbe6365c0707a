"""The property every example must satisfy: the caller keeps the target's contract, and the kernel, given
that, returns finite output that agrees with the fp64 reference."""

from __future__ import annotations

import time
import traceback
from typing import Any

import attrs
import torch

from kvfuzz.contracts.data import BatchData, make_batch_data
from kvfuzz.contracts.example import Example
from kvfuzz.contracts.invariants import check_contract
from kvfuzz.contracts.materialize import CacheState, materialize
from kvfuzz.contracts.oracles import check_agreement, check_finite, error_ratio
from kvfuzz.contracts.reference import reference_attention, same_precision_attention

from .faults import CallerFault
from .findings import CallerContractViolation, KernelCrash, KernelMismatch, NonFiniteOutput
from .targets.base import KernelCall, Target


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


def prepare(target: Target, example: Example, fault: CallerFault | None = None) -> Run:
    """Generate the data, materialize the cache the (possibly faulty) caller writes, and build the call."""
    t = Timings()
    s = time.perf_counter()
    batch = example.batch
    data = make_batch_data(batch)
    t.generate = time.perf_counter() - s
    s = time.perf_counter()
    lens = target.capabilities.contract.cached_lens(batch)
    if fault is not None:
        lens = fault.cached_lens(batch, lens)
    cache = materialize(batch, data, target.layout(batch), lens, example.poison, device=target.device)
    call = target.build_call(batch, data, cache)
    t.materialize = time.perf_counter() - s
    return Run(example, data, cache, call, timings=t, path=target.path(batch))


def _kernel_summary(out: torch.Tensor | None, finite_fail, agree_fail, crash: str | None) -> dict[str, Any]:
    if crash is not None:
        return {"outcome": "crashed", "error": crash}
    if finite_fail is not None:
        return {"outcome": "non-finite", **finite_fail.to_dict()}
    if agree_fail is not None:
        return {"outcome": "mismatch", **agree_fail.to_dict()}
    return {"outcome": "agrees with reference"}


def check_example(target: Target, example: Example, fault: CallerFault | None = None,
                  run: Run | None = None) -> Run:
    """Run one example end to end; returns the :class:`Run` or raises a
    :class:`~kvfuzz.fuzz.findings.Finding`:

    - CallerContractViolation when the call breaks the target's contract (checked before the kernel runs;
      the kernel still runs and its outcome is in ``details["kernel"]``);
    - KernelCrash when the kernel raises on a call that keeps the contract;
    - NonFiniteOutput / KernelMismatch when its output has NaN/inf or disagrees with the fp64 reference.
    """
    run = run or prepare(target, example, fault)
    batch, t = example.batch, run.timings
    s = time.perf_counter()
    violations = check_contract(target.capabilities.contract, batch, run.data, run.cache.layout,
                                run.call.key_cache, run.call.value_cache, run.call.key, run.call.value)
    t.check_caller = time.perf_counter() - s

    crash = None
    s = time.perf_counter()
    try:
        run.output = target.run(run.call)
        if run.output.is_cuda:
            torch.cuda.synchronize()
    except Exception as e:  # the kernel's own error, reported as a finding
        crash = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    t.kernel = time.perf_counter() - s

    s = time.perf_counter()
    run.reference = reference_attention(batch, run.data)
    lowp = same_precision_attention(batch, run.data)
    t.reference = time.perf_counter() - s

    s = time.perf_counter()
    finite_fail = agree_fail = None
    if run.output is not None:
        finite_fail = check_finite(batch, run.output)
        agree_fail = check_agreement(batch, run.output, run.reference, lowp)
        run.ratio = error_ratio(batch, run.output, run.reference, lowp) if agree_fail is None else 0.0
    t.check_output = time.perf_counter() - s
    kernel = _kernel_summary(run.output, finite_fail, agree_fail, crash)
    common = {"path": run.path, "kernel": kernel}

    if violations:
        first = violations[0]
        msg = first.message()
        if len(violations) > 1:
            msg += f" (+{len(violations) - 1} more violations)"
        msg += f" Kernel computed from this cache: {kernel['outcome']}"
        if "message" in kernel:
            msg += f" ({kernel['message']})"
        raise CallerContractViolation(first.invariant, msg,
                                      {**common, "violations": [v.to_dict() for v in violations]})
    if crash is not None:
        raise KernelCrash("kernel raised", crash.splitlines()[0], {**common, "traceback": crash})
    if finite_fail is not None:
        raise NonFiniteOutput("finite", finite_fail.message(), {**common, "oracle": finite_fail.to_dict()})
    if agree_fail is not None:
        raise KernelMismatch("agreement", agree_fail.message(), {**common, "oracle": agree_fail.to_dict()})
    return run


def prepare_any(target: Target, example: Example, fault: CallerFault | None = None) -> Run:
    """:func:`prepare` for attention targets; the cache-writer preparation for ``kind == "cache-writer"``."""
    if target.kind == "cache-writer":
        from .writer_property import prepare_writer

        return prepare_writer(target, example, fault)
    return prepare(target, example, fault)


def check_any(target: Target, example: Example, fault: CallerFault | None = None, run: Run | None = None) -> Run:
    """:func:`check_example` for attention targets; the cache-writer property for ``kind == "cache-writer"``."""
    if target.kind == "cache-writer":
        from .writer_property import check_writer_example

        return check_writer_example(target, example, fault, run=run)
    return check_example(target, example, fault, run=run)
