"""The attention property (split, prefix and unified contracts): the caller keeps the target's contract, and
the kernel, given that, returns finite output that agrees with the fp64 reference."""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import torch

from kvfuzz.contracts.caches.materialize import CacheState, materialize
from kvfuzz.contracts.checks.failures import KernelCrash, KernelMismatch, NonFiniteOutput, hide_frame_for_finding
from kvfuzz.contracts.checks.oracles import Oracle, check_output
from kvfuzz.contracts.checks.reference import reference_and_envelope, same_precision_attention
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.harness.caller import (
    call_violations,
    caller_checks_due,
    caller_finding,
    caller_violations,
    metadata_violations,
)
from kvfuzz.fuzz.harness.faults import CallerFault
from kvfuzz.fuzz.harness.run import (  # noqa: F401
    GPU_REFERENCE_MIN_KV,
    Run,
    Timings,
    error_name,
    generate,
    reference_device,
    run_kernel,
)
from kvfuzz.fuzz.harness.states import active_hooks
from kvfuzz.fuzz.targets.base import Target


def prepare(target: Target, example: Example, fault: CallerFault | None = None,
            after_materialize: Callable[[Batch, BatchData, CacheState], None] | None = None,
            data: BatchData | None = None) -> Run:
    """Generate the data, materialize the cache the (possibly faulty) caller writes, and build the call.
    ``after_materialize(batch, data, cache)``: changes the cache before the call is built (the baseline's
    re-run with some poisoned slots made finite, kvfuzz.fuzz.campaign.store.baseline). ``data``: this batch's ground
    truth, already generated (``make_batch_data(example.batch)``, on any device; nothing here changes it),
    instead of generating it again. The data is drawn where the reference will be computed
    (:func:`~kvfuzz.fuzz.harness.run.reference_device`: a large batch of a CUDA target on its GPU), so it is
    copied to that device once, if at all."""
    batch = example.batch
    own = data is None  # the data drawn here: with nothing changed after materializing, Run.prepared is set
    if own:
        data, t = generate(example, reference_device(target, batch))
    else:
        t = Timings()
    s = time.perf_counter()
    data = target.call_data(batch, data)  # what the caller hands the kernel (an fp8 query): the reference's too
    lens = target.capabilities.contract.cached_lens(batch)
    if fault is not None:
        lens = fault.cached_lens(batch, lens)
    cache = materialize(batch, data, target.layout(batch), lens, example.poison, device=target.device)
    if after_materialize is not None:
        after_materialize(batch, data, cache)
    for hooks in active_hooks(batch):  # the production states' (fuzz/harness/states.py)
        hooks.prepare(target, batch, data, cache)
    call = target.build_call(batch, data, cache)
    if fault is not None and fault.applies(batch, call.kwargs):
        fault.mutate(batch, data, cache, call)
    t.materialize = time.perf_counter() - s
    run = Run(example, data, cache, call, timings=t, path=target.path(batch), fault=fault)
    if own and after_materialize is None:
        run.prepared = run.fingerprint()
    return run


def poison_output(output) -> None:
    """Fill the output buffer the kernel is handed with NaN before it runs: a row the kernel never writes is
    then always a non-finite output, whatever ``torch.empty`` happened to return (garbage made the same bug a
    mismatch on one run and non-finite on the next, and kept it from shrinking)."""
    if isinstance(output, torch.Tensor) and output.dtype.is_floating_point:
        output.fill_(float("nan"))


def _kernel_summary(out: torch.Tensor | None, finite_fail, agree_fail, crash: str | None,
                    not_run: bool = False) -> dict[str, Any]:
    if not_run:
        return {"outcome": "not run", "error": crash}
    if crash is not None:
        return {"outcome": "crashed", "error": crash}
    if finite_fail is not None:
        return {"outcome": "non-finite", **finite_fail.to_dict()}
    if agree_fail is not None:
        return {"outcome": "mismatch", **agree_fail.to_dict()}
    return {"outcome": "agrees with reference"}


def check_example(target: Target, example: Example, fault: CallerFault | None = None,
                  run: Run | None = None, run_unsafe: bool = False,
                  on_phase: Callable[[str], None] | None = None, caller_checked: bool = False) -> Run:
    """Run one example end to end; returns the :class:`Run` or raises a
    :class:`~kvfuzz.contracts.checks.failures.Finding`:

    - CallerContractViolation when the call breaks the target's contract (checked before the kernel runs, unless
      ``run`` is exactly as :func:`prepare` built it (``Run.prepared``) and
      :func:`~kvfuzz.fuzz.harness.caller.caller_checks_due` says no: then only on a failing example, on the call
      as it was before the kernel; the kernel still runs and its outcome is in ``details["kernel"]``);
    - KernelCrash when the kernel raises on a call that keeps the contract;
    - NonFiniteOutput / KernelMismatch when its output has NaN/inf or disagrees with the fp64 reference.

    ``caller_checked``: the caller checks (:func:`caller_violations`) are known to pass for this call and are
    not run (the baseline's re-run of a fault-free call that passed them, whose cache differs only in slots
    those checks never read).
    """
    __tracebackhide__ = hide_frame_for_finding  # kvfuzz.check_example in a user's test: the Finding, not this frame
    run = run or prepare(target, example, fault)
    batch, t = example.batch, run.timings
    # sampled only on a run exactly as prepare built it (a run changed since, by whoever handed it over, is checked)
    pristine = run.prepared is not None and run.prepared == run.fingerprint()
    due = not caller_checked and (not pristine or caller_checks_due(target, batch, fault))
    s = time.perf_counter()
    violations = caller_violations(target, run) if due else []
    t.check_caller = time.perf_counter() - s

    crash = None
    unsafe = sorted({v.check.value for v in violations if v.check.memory_unsafe})
    s = time.perf_counter()
    if unsafe and not run_unsafe:
        crash = (f"not run: this call ({', '.join(unsafe)}) can make the kernel read or write outside its "
                 "tensors; `kvfuzz fuzz` runs such calls in its isolated worker processes")
        states = []
    else:
        poison_output(run.call.output)
        states = [(hooks, hooks.before(batch, run.call)) for hooks in active_hooks(batch)]
        t.materialize += time.perf_counter() - s  # the call made ready: the output's poison, the states' snapshots
        run.output, crash = run_kernel(target, run.call, on_phase, timings=t)

    s = time.perf_counter()
    # on the reference device (a large batch of a CUDA target on its GPU, asynchronously until the checks);
    # the same-precision model only when an element exceeds the envelope, and on the CPU, where it is the same
    # on every machine (oracles.agreement). A run that carries both already (the baseline's re-run of this
    # example's data) keeps them: they depend on the data only.
    if run.device_reference is not None and run.envelope is not None:
        envelope = run.envelope
        reference = run.device_reference.to(envelope.device)
    else:
        reference, envelope = reference_and_envelope(batch, run.data.to(reference_device(target, batch)),
                                                     target.numerics_for(batch))
    t.reference = time.perf_counter() - s

    s = time.perf_counter()
    fails = _output_failures(batch, run, reference, envelope, states)
    run.reference, run.envelope = reference, envelope  # Run.reference copies it to the CPU when read
    t.check_output = time.perf_counter() - s
    if not due and not caller_checked and (crash is not None or any(f is not None for f in fails)):
        s = time.perf_counter()  # a failing example is never named the kernel's before the caller checks ran
        violations = _violations_before_the_kernel(target, run)
        t.check_caller += time.perf_counter() - s
    _raise_finding(run, violations, crash, *fails, not_run=bool(unsafe and not run_unsafe))
    return run


def _violations_before_the_kernel(target: Target, run: Run) -> list:
    """The caller checks of a pristine run (``Run.prepared``) whose checks did not run before the kernel: on the run
    as the kernel left it, and when they find anything, again on the run prepare builds afresh for the example (the
    same call, as it was before the kernel ran), whose violations are the answer: a kernel that wrote into its own
    cache or arguments is not the caller's fault."""
    if not caller_violations(target, run):
        return []
    return caller_violations(target, prepare(target, run.example, run.fault))


def _output_failures(batch: Batch, run: Run, reference: torch.Tensor, envelope: torch.Tensor, states: list):
    """``(finite, agreement, state)`` failures of the run's output (each None when it passes; all None without an
    output), in the order they win: the real rows' finiteness, then their agreement (finite rows only), then the
    states' own checks (a state's failure is named only alone). Sets ``run.ratio``. One host sync when the real
    rows pass (:func:`~kvfuzz.contracts.checks.oracles.check_output`), plus the states' own."""
    if run.output is None:
        return None, None, None
    real = run.output[:batch.num_tokens]  # rows past the real tokens are a state's (pads), its hooks check them
    finite_fail, agree_fail, run.ratio = check_output(batch, real, reference,
                                                      partial(_same_precision_on_cpu, batch, run.data), envelope)
    state_fail = None
    if finite_fail is None and agree_fail is None:
        state_fail = next((f for f in (hooks.after(snap, batch, run.output, run.call) for hooks, snap in states)
                           if f is not None), None)
    return finite_fail, agree_fail, state_fail


def _raise_finding(run: Run, violations: list, crash: str | None, finite_fail, agree_fail, state_fail,
                   not_run: bool) -> None:
    """Raise the example's finding, if any: a caller violation first (with what the kernel computed), then the
    kernel's crash, non-finite output, disagreement, and a state's own failure."""
    __tracebackhide__ = hide_frame_for_finding
    kernel = _kernel_summary(run.output, finite_fail, agree_fail, crash, not_run=not_run)
    common = {"path": run.path, "kernel": kernel}
    if violations:
        raise caller_finding(violations, kernel, {"path": run.path})
    if crash is not None:
        raise KernelCrash(f"raised {error_name(crash)}", crash.splitlines()[0], {**common, "traceback": crash})
    if finite_fail is not None:
        raise NonFiniteOutput(Oracle.FINITE.value, finite_fail.message(), {**common, "oracle": finite_fail.to_dict()})
    if agree_fail is not None:
        raise KernelMismatch(Oracle.AGREEMENT.value, agree_fail.message(), {**common, "oracle": agree_fail.to_dict()})
    if state_fail is not None:
        kind = NonFiniteOutput if state_fail.oracle is Oracle.PAD_FINITE else KernelMismatch
        raise kind(state_fail.oracle.value, state_fail.message(), {**common, "oracle": state_fail.to_dict()})


def _same_precision_on_cpu(batch: Batch, data: BatchData, tokens: list[int]) -> torch.Tensor:
    """:func:`~kvfuzz.contracts.checks.reference.same_precision_attention` of output rows ``tokens`` on the CPU,
    wherever ``data`` is: the same on every machine (a GPU's low-precision matmuls are not)."""
    return same_precision_attention(batch, data.to("cpu"), tokens)


__all__ = ["GPU_REFERENCE_MIN_KV", "call_violations", "caller_finding", "caller_violations", "check_example",
           "metadata_violations", "poison_output", "prepare", "reference_device"]
