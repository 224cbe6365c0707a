"""The attention property (split, prefix and unified contracts): the caller keeps the target's contract, and
the kernel, given that, returns finite output that agrees with the fp64 reference."""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any, Callable

import torch

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.csr import indptr
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.checks.failures import CallerContractViolation, KernelCrash, KernelMismatch, NonFiniteOutput
from kvfuzz.contracts.checks.invariants import check_contract
from kvfuzz.contracts.caches.materialize import CacheState, materialize
from kvfuzz.contracts.checks.oracles import Oracle, agreement, check_finite
from kvfuzz.contracts.checks.reference import reference_and_envelope, same_precision_attention
from kvfuzz.contracts.checks.violations import Check, Violation, violation
from kvfuzz.fuzz.guard.signatures import build_call, check_kernel_call
from kvfuzz.fuzz.harness.faults import CallerFault
from kvfuzz.fuzz.harness.run import Run, Timings, error_name, generate, run_kernel
from kvfuzz.fuzz.targets.base import Target

#: Batches of a CUDA target with at least this many KV elements (``Batch.kv_elements``)
#: get their fp64 reference on the GPU; smaller ones on the CPU (a small reference is a few hundred tiny kernel
#: launches, which workers sharing one GPU queue behind each other). Environment: KVFUZZ_GPU_REFERENCE_MIN_KV.
GPU_REFERENCE_MIN_KV = int(os.environ.get("KVFUZZ_GPU_REFERENCE_MIN_KV", 1 << 16))


def reference_device(target: Target, batch) -> str:
    """Where :func:`check_example` computes ``batch``'s reference: the CPU, or a CUDA target's GPU for a batch
    of at least :data:`GPU_REFERENCE_MIN_KV` KV elements."""
    device = target.device
    if device == "cpu" or batch.kv_elements < GPU_REFERENCE_MIN_KV:
        return "cpu"
    return device


def prepare(target: Target, example: Example, fault: CallerFault | None = None,
            after_materialize: Callable[[Batch, BatchData, CacheState], None] | None = None,
            data: BatchData | None = None) -> Run:
    """Generate the data, materialize the cache the (possibly faulty) caller writes, and build the call.
    ``after_materialize(batch, data, cache)``: changes the cache before the call is built (the baseline's
    re-run with some poisoned slots made finite, kvfuzz.fuzz.campaign.baseline). ``data``: this batch's ground
    truth, already generated (``make_batch_data(example.batch)``; nothing here changes it), instead of
    generating it again."""
    batch = example.batch
    if data is None:
        data, t = generate(example)
    else:
        t = Timings()
    s = time.perf_counter()
    lens = target.capabilities.contract.cached_lens(batch)
    if fault is not None:
        lens = fault.cached_lens(batch, lens)
    cache = materialize(batch, data, target.layout(batch), lens, example.poison, device=target.device)
    if after_materialize is not None:
        after_materialize(batch, data, cache)
    call = target.build_call(batch, data, cache)
    if fault is not None and fault.applies(batch, call.kwargs):
        fault.mutate_call(batch, data, cache, call)
    t.materialize = time.perf_counter() - s
    return Run(example, data, cache, call, timings=t, path=target.path(batch), fault=fault)


def poison_output(output) -> None:
    """Fill the output buffer the kernel is handed with NaN before it runs: a row the kernel never writes is
    then always a non-finite output, whatever ``torch.empty`` happened to return (garbage made the same bug a
    mismatch on one run and non-finite on the next, and kept it from shrinking)."""
    if isinstance(output, torch.Tensor) and output.dtype.is_floating_point:
        output.fill_(float("nan"))


def metadata_violations(target: Target, run: Run) -> list[Violation]:
    """With ground truth: do the call's query_start_loc and seq_lens (CSR calls: kv_indptr, against the
    positions the target's contract says the kernel reads) describe the batch? (A shifted query_start_loc
    still starts at 0, rises and ends at T, so only the harness, which knows each sequence's query_len, can
    tell.) Named after the argument, as the guard's checks are."""
    if target.checked_kernel is None:
        return []
    call = build_call(target.checked_kernel, run.call.kwargs)
    batch = run.example.batch
    out = []
    lengths = (Check.SEQ_LENS, call.seq_lens, batch.seq_lens, "sequence lengths")
    if call.csr is not None:  # CSR: kv_indptr lists what the contract says the kernel reads
        listed = target.capabilities.contract.cached_lens(batch)
        lengths = (Check.KV_INDPTR, call.csr.kv_indptr, tuple(indptr(listed).tolist()),
                   "positions the kernel reads (" + ("ctx_lens" if listed == batch.ctx_lens else "seq_lens") + ")")
    for check, got, want, what in ((Check.QUERY_START_LOC, call.query_start_loc, batch.query_start_loc,
                                    "query tokens"), lengths):
        if not isinstance(got, torch.Tensor):
            continue
        got_l = got.cpu().tolist()
        if got_l != list(want):
            i = next((k for k, (a, b) in enumerate(zip(got_l, want)) if a != b), min(len(got_l), len(want)))
            seq = max(0, i - 1) if check in (Check.QUERY_START_LOC, Check.KV_INDPTR) else i
            out.append(violation(
                check, f"{check.value} does not match the batch's {what}: entry {i} is "
                       f"{got_l[i] if i < len(got_l) else None} ({check.value} = {got_l})",
                kernel=target.checked_kernel, seq=seq, expected=list(want), found=got_l))
    return out


def call_violations(target: Target, run: Run) -> list[Violation]:
    """Error-level findings of the runtime guard's argument checks (:mod:`kvfuzz.contracts.calls.call_checks`) on
    this call; [] when the target declares no ``checked_kernel``."""
    if target.checked_kernel is None:
        return []
    key = value = None
    if not target.capabilities.contract.passes_new_kv:  # unified: hand the guard the new tokens, where the call is
        key, value = (t.to(run.call.key_cache.device) for t in run.data.new_kv(run.example.batch))
    found = check_kernel_call(target.checked_kernel, run.call.kwargs, key=key, value=value, vacuity=False)
    return [v for v in found if v.is_error]


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


def caller_violations(target: Target, run: Run) -> list[Violation]:
    """Ground-truth invariants (:mod:`kvfuzz.contracts.checks.invariants`), then the call's metadata against the batch,
    then the runtime guard's argument checks (a check already reported for a sequence is not repeated); []
    when the call keeps the contract."""
    batch = run.example.batch
    violations = check_contract(target.capabilities.contract, batch, run.data, run.cache.layout,
                                run.call.key_cache, run.call.value_cache, run.call.key, run.call.value)
    violations += metadata_violations(target, run)
    seen = {(v.check, v.seq) for v in violations}
    return violations + [v for v in call_violations(target, run) if (v.check, v.seq) not in seen]


def caller_finding(violations: list[Violation], kernel: dict[str, Any], details: dict[str, Any]
                   ) -> CallerContractViolation:
    """The finding of a call that broke its contract: the first violation's check and message, the others
    named, and what the kernel computed from the call (``kernel``: its outcome, as in ``details["kernel"]``)."""
    first = violations[0]
    msg = first.message
    if len(violations) > 1:
        msg += f" (+{len(violations) - 1} more: {', '.join(sorted({v.check.value for v in violations[1:]}))})"
    msg += f" Kernel computed from this call: {kernel['outcome']}"
    if "message" in kernel:
        msg += f" ({kernel['message'][:300]})"
    elif kernel.get("error"):
        msg += f" ({kernel['error'].splitlines()[0][:300]})"
    return CallerContractViolation(first.check.value, msg, {**details, "kernel": kernel,
                                                            "violations": [v.to_dict() for v in violations]})


def check_example(target: Target, example: Example, fault: CallerFault | None = None,
                  run: Run | None = None, run_unsafe: bool = False,
                  on_phase: Callable[[str], None] | None = None, caller_checked: bool = False) -> Run:
    """Run one example end to end; returns the :class:`Run` or raises a
    :class:`~kvfuzz.contracts.checks.failures.Finding`:

    - CallerContractViolation when the call breaks the target's contract (checked before the kernel runs;
      the kernel still runs and its outcome is in ``details["kernel"]``);
    - KernelCrash when the kernel raises on a call that keeps the contract;
    - NonFiniteOutput / KernelMismatch when its output has NaN/inf or disagrees with the fp64 reference.

    ``caller_checked``: the caller checks (:func:`caller_violations`) are known to pass for this call and are
    not run (the baseline's re-run of a fault-free call that passed them, whose cache differs only in slots
    those checks never read).
    """
    run = run or prepare(target, example, fault)
    batch, t = example.batch, run.timings
    s = time.perf_counter()
    violations = [] if caller_checked else caller_violations(target, run)
    t.check_caller = time.perf_counter() - s

    crash = None
    unsafe = sorted({v.check.value for v in violations if v.check.memory_unsafe})
    s = time.perf_counter()
    if unsafe and not run_unsafe:
        crash = (f"not run: this call ({', '.join(unsafe)}) can make the kernel read or write outside its "
                 "tensors; `kvfuzz fuzz` runs such calls in its isolated worker processes")
    else:
        poison_output(run.call.output)
        run.output, crash = run_kernel(target, run.call, on_phase)
    t.kernel = time.perf_counter() - s

    s = time.perf_counter()
    # on the reference device (a large batch of a CUDA target on its GPU, asynchronously until the checks);
    # the same-precision model only when an element exceeds the envelope, and on the CPU, where it is the same
    # on every machine (oracles.agreement). A run that carries both already (the baseline's re-run of this
    # example's data) keeps them: they depend on the data only.
    if run.reference is not None and run.envelope is not None:
        envelope = run.envelope
        reference = run.reference.to(envelope.device)
    else:
        reference, envelope = reference_and_envelope(batch, run.data.to(reference_device(target, batch)))
    t.reference = time.perf_counter() - s

    s = time.perf_counter()
    finite_fail = agree_fail = None
    if run.output is not None:
        finite_fail = check_finite(batch, run.output)
        if finite_fail is None:  # a non-finite output fails agreement too, and its failure always wins
            agree_fail, run.ratio = agreement(batch, run.output, reference,
                                              partial(same_precision_attention, batch, run.data), envelope)
    run.reference, run.envelope = reference.cpu(), envelope
    t.check_output = time.perf_counter() - s
    kernel = _kernel_summary(run.output, finite_fail, agree_fail, crash, not_run=bool(unsafe and not run_unsafe))
    common = {"path": run.path, "kernel": kernel}

    if violations:
        raise caller_finding(violations, kernel, {"path": run.path})
    if crash is not None:
        raise KernelCrash(f"raised {error_name(crash)}", crash.splitlines()[0], {**common, "traceback": crash})
    if finite_fail is not None:
        raise NonFiniteOutput(Oracle.FINITE.value, finite_fail.message(), {**common, "oracle": finite_fail.to_dict()})
    if agree_fail is not None:
        raise KernelMismatch(Oracle.AGREEMENT.value, agree_fail.message(), {**common, "oracle": agree_fail.to_dict()})
    return run
