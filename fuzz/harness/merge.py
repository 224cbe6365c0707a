"""The merge property (:attr:`~kvfuzz.contracts.model.contract.Contract.MERGE`): a ``merge_attn_states`` call is
handed the two parts of the batch's attention (:mod:`kvfuzz.contracts.model.merge`) with well-formed arguments,
and, given that, returns the exact fp64 merge of those very inputs within the bound of its fp32 arithmetic
(:mod:`kvfuzz.contracts.checks.merge`, docs/tolerance.md "Merging attention states"), and, when it writes
``output_lse``, the merged log-sum-exp.

Caller checks, before the kernel runs: the arguments (shapes, dtypes, strides, ``prefill_tokens_with_context``:
:mod:`kvfuzz.contracts.calls.merge_checks`) and, with ground truth, that the parts handed over are the batch's
prefix and suffix attention bit for bit (``Check.MERGE_PARTS``). The parts are read before the kernel runs (an
in-place merge overwrites its prefix), and an output buffer that aliases no input is filled with NaN first (a row
the kernel never writes is a non-finite output); after it, the output is kept and the parts are written back
(the call recorded in a reproducer holds its inputs).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from kvfuzz.contracts.calls.merge_checks import check_merge_call
from kvfuzz.contracts.checks.failures import KernelCrash, KernelMismatch, NonFiniteOutput, hide_frame_for_finding
from kvfuzz.contracts.checks.merge import check_merge, check_merge_parts, check_merged_lse, exact_merge, merge_bound
from kvfuzz.contracts.checks.oracles import Oracle
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.merge import MergeInputs, merge_inputs
from kvfuzz.fuzz.harness.caller import caller_finding
from kvfuzz.fuzz.harness.faults import CallerFault
from kvfuzz.fuzz.harness.run import Run, error_name, generate, run_kernel
from kvfuzz.fuzz.targets.base import Target


def expected_parts(target: Target, batch, data) -> MergeInputs:
    """The parts ``target``'s call must hand over: the batch's prefix and suffix attention, rounded as a kernel
    returns them, an empty part's log-sum-exp as the target's path says (``target.empty_lse(batch)``, default
    ``-inf``)."""
    empty = getattr(target, "empty_lse", None)
    return merge_inputs(batch, data, float("-inf") if empty is None else empty(batch))


def prepare_merge(target: Target, example: Example, fault: CallerFault | None = None) -> Run:
    """Draw the example's data (on the CPU), compute the parts (:func:`expected_parts`) and have the target build
    its call from them (``build_call(batch, data, parts)``). ``Run.cache`` is None (no cache); a caller fault
    that applies mutates the call."""
    batch = example.batch
    data, t = generate(example, "cpu")
    s = time.perf_counter()
    call = target.build_call(batch, data, expected_parts(target, batch, data))
    if fault is not None and fault.applies(batch, call.kwargs):
        fault.mutate(batch, data, None, call)
    t.materialize = time.perf_counter() - s
    return Run(example, data, None, call, timings=t, path=target.path(batch), fault=fault)


def _handed(kw) -> MergeInputs:
    """The parts as the call hands them, copied to the CPU before the kernel runs."""
    def snap(name):
        v = kw.get(name)
        return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    return MergeInputs(snap("prefix_output"), snap("prefix_lse"), snap("suffix_output"), snap("suffix_lse"))


def _aliases(t: torch.Tensor | None, kw) -> bool:
    if not isinstance(t, torch.Tensor):
        return True
    return any(isinstance(kw.get(n), torch.Tensor) and kw[n].untyped_storage().data_ptr() ==
               t.untyped_storage().data_ptr() for n in ("prefix_output", "suffix_output", "prefix_lse", "suffix_lse"))


def _restore(kw, handed: MergeInputs) -> None:
    """Write the parts back into the call's own tensors (what an in-place merge, whose output is its prefix,
    overwrote), so the call recorded in a reproducer holds the inputs it was made with."""
    for name in ("prefix_output", "prefix_lse"):
        v = kw.get(name)
        if isinstance(v, torch.Tensor) and isinstance(getattr(handed, name), torch.Tensor) \
                and v.shape == getattr(handed, name).shape:
            v.copy_(getattr(handed, name).to(v.device))


def _summary(crash, fail, lse_fail, not_run: bool) -> dict:
    if not_run:
        return {"outcome": "not run", "error": crash}
    if crash is not None:
        return {"outcome": "crashed", "error": crash}
    for f in (fail, lse_fail):
        if f is not None:
            return {"outcome": "non-finite" if f.oracle is Oracle.FINITE else "mismatch", **f.to_dict()}
    return {"outcome": "agrees with the exact merge"}


def check_merge_example(target: Target, example: Example, fault: CallerFault | None = None, run: Run | None = None,
                        run_unsafe: bool = False, on_phase: Callable[[str], None] | None = None) -> Run:
    """Run one merge example end to end (module docstring); returns the :class:`Run` (``output`` the merged
    output, ``reference`` the exact merge, ``envelope`` its bound, all ``[T, H, D]``) or raises a Finding:
    CallerContractViolation (the arguments or the parts; the kernel still runs unless an argument could make it
    read or write outside its tensors), KernelCrash, NonFiniteOutput, KernelMismatch (the output: ``agreement with
    the exact merge``; the written log-sum-exp: ``merged log-sum-exp``)."""
    __tracebackhide__ = hide_frame_for_finding
    run = run or prepare_merge(target, example, fault)
    batch, t, kw = example.batch, run.timings, run.call.kwargs
    s = time.perf_counter()
    violations = check_merge_call(kw)
    handed = _handed(kw)
    if not violations:
        violations = check_merge_parts(expected_parts(target, batch, run.data), handed)
    t.check_caller = time.perf_counter() - s
    unsafe = sorted({v.check.value for v in violations if v.check.memory_unsafe})
    crash = fail = lse_fail = None
    s = time.perf_counter()
    if unsafe and not run_unsafe:
        crash = (f"not run: this call ({', '.join(unsafe)}) can make the kernel read or write outside its tensors; "
                 "`kvfuzz fuzz` runs such calls in its isolated worker processes")
    else:
        for name in ("output", "output_lse"):
            if not _aliases(kw.get(name), kw):
                kw[name].fill_(float("nan"))
        run.output, crash = run_kernel(target, run.call, on_phase)
    t.kernel = time.perf_counter() - s
    s = time.perf_counter()
    n = kw.get("prefill_tokens_with_context")
    lse_out = kw.get("output_lse")
    if run.output is not None:
        run.output = run.output.clone()
        lse_out = lse_out.clone() if isinstance(lse_out, torch.Tensor) else None
        _restore(kw, handed)  # an in-place merge wrote over its prefix: the call holds its inputs again
    if run.output is not None and not violations:
        exact, exact_lse = exact_merge(handed, n)
        bound, lse_bound = merge_bound(handed, exact, exact_lse, run.output.dtype, n)
        run.reference, run.envelope = exact, bound
        fail, run.ratio = check_merge(batch, run.output, exact, bound)
        if fail is None and lse_out is not None:
            lse_fail = check_merged_lse(batch, lse_out, exact_lse, lse_bound)
    t.check_output = time.perf_counter() - s
    kernel = _summary(crash, fail, lse_fail, not_run=bool(unsafe and not run_unsafe))
    common = {"path": run.path, "kernel": kernel}
    if violations:
        raise caller_finding(violations, kernel, {"path": run.path})
    if crash is not None:
        raise KernelCrash(f"raised {error_name(crash)}", crash.splitlines()[0], {**common, "traceback": crash})
    for f in (fail, lse_fail):
        if f is not None:
            kind = NonFiniteOutput if f.oracle is Oracle.FINITE else KernelMismatch
            raise kind(f.oracle.value, f.message(), {**common, "oracle": f.to_dict()})
    return run


__all__ = ["check_merge_example", "expected_parts", "prepare_merge"]
