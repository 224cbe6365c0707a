"""The one entry point the campaign calls per example: :func:`prepare` builds a target's call from an example,
:func:`check` runs it through the target's property, chosen by the target's contract: the attention property
(:mod:`kvfuzz.fuzz.harness.attention`) for split, prefix and unified kernels, the writer property
(:mod:`kvfuzz.fuzz.harness.writer`) for :attr:`~kvfuzz.contracts.model.contract.Contract.WRITER`, the merge
property (:mod:`kvfuzz.fuzz.harness.merge`) for :attr:`~kvfuzz.contracts.model.contract.Contract.MERGE`. And
:func:`check_undeclared`, the property of configurations a target does not declare; :func:`check_example`, the
property as users call it (``kvfuzz.check_example``)."""

from __future__ import annotations

import re
from typing import Callable

import attrs
from hypothesis import reject

from kvfuzz.contracts.caches.layouts import LayoutError
from kvfuzz.contracts.checks.failures import (
    KernelCrash,
    KernelMismatch,
    NonFiniteOutput,
    SilentlyUnsupported,
    hide_frame_for_finding,
)
from kvfuzz.contracts.model.batch import Batch, contiguous_batch
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.states import PRODUCTION_STATES
from kvfuzz.fuzz.harness import attention, merge, writer
from kvfuzz.fuzz.harness.faults import CallerFault
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.targets.base import Target


def is_writer(target: Target) -> bool:
    return target.capabilities.contract is Contract.WRITER


def is_merge(target: Target) -> bool:
    return target.capabilities.contract is Contract.MERGE


def property_of(target: Target) -> tuple[Callable[..., Run], Callable[..., Run]]:
    """``target``'s property as ``(prepare, check)``, chosen by its contract: the writer property's
    (:func:`~kvfuzz.fuzz.harness.writer.prepare_writer`, :func:`~kvfuzz.fuzz.harness.writer.check_writer_example`)
    for :attr:`~kvfuzz.contracts.model.contract.Contract.WRITER`, the merge property's
    (:func:`~kvfuzz.fuzz.harness.merge.prepare_merge`, :func:`~kvfuzz.fuzz.harness.merge.check_merge_example`) for
    :attr:`~kvfuzz.contracts.model.contract.Contract.MERGE`, else the attention property's
    (:func:`~kvfuzz.fuzz.harness.attention.prepare`, :func:`~kvfuzz.fuzz.harness.attention.check_example`). Both
    take the arguments :func:`prepare` and :func:`check` take, by keyword; a campaign chooses once per target."""
    if is_writer(target):
        return writer.prepare_writer, writer.check_writer_example
    if is_merge(target):
        return merge.prepare_merge, merge.check_merge_example
    return attention.prepare, attention.check_example


def prepare(target: Target, example: Example, fault: CallerFault | None = None) -> Run:
    """Generate the example's data, materialize the cache its (possibly faulty) caller holds and build the
    call, by the target's contract. Raises LayoutError when the target's layout cannot hold the batch."""
    return property_of(target)[0](target, example, fault)


def check(target: Target, example: Example, fault: CallerFault | None = None, run: Run | None = None,
          run_unsafe: bool = False, on_phase: Callable[[str], None] | None = None) -> Run:
    """Run one example end to end through the target's property; returns the :class:`Run` or raises a
    :class:`~kvfuzz.contracts.checks.failures.Finding`. ``run_unsafe``: also run calls whose arguments could make
    the kernel read or write outside its tensors (isolated worker processes only). ``on_phase``: told "kernel"
    and "check" around the kernel call (a campaign's journal)."""
    __tracebackhide__ = hide_frame_for_finding  # a user's test shows its own frame and the Finding, not ours
    return property_of(target)[1](target, example, fault, run=run, run_unsafe=run_unsafe, on_phase=on_phase)


def rejection_text(message: str) -> str:
    """The first line of a kernel's error, as rejections are counted and grouped: glog's "[F1121 10:07:04.913680852 "
    time stamps dropped, absolute source paths cut to the file (FlashInfer's JIT errors name
    ``/<workspace>/.cache/flashinfer/<version>/<arch>/generated/<module>/batch_decode.cu:63``, which would push
    the message itself past the 200 characters kept)."""
    line = re.sub(r"\[[A-Z]\d{4} [\d:.]+ ", "[", message.splitlines()[0] if message else "")
    return re.sub(r"(?:/[\w.+=-]+)+/([\w.+=-]+:\d+)", r"\1", line)[:200]


def check_undeclared(target: Target, example: Example, run: Run | None = None) -> tuple[Run, str]:
    """The property for a configuration the target does *not* declare (kvfuzz fuzz --undeclared).

    Returns ``(run, outcome)`` with outcome "rejected: <first line of the kernel's error>" (the expected
    answer to an unsupported configuration: a clear error, counted, not a failure) or "accepted, correct"
    (the declaration could be widened). Raises SilentlyUnsupported when the kernel accepted it and computed
    it wrongly or non-finitely: wrong answers instead of an error. Raises hypothesis's UnsatisfiedAssumption
    (via ``reject()``) when kvfuzz's own cache layout cannot hold the configuration.
    """
    try:
        run = run or prepare(target, example)
    except LayoutError:
        reject()  # kvfuzz's layout (or the op's own cache writer) cannot hold it: nothing to ask the kernel
    what = ", ".join(target.capabilities.outside(example.batch)) or "declared"
    try:
        check(target, example, run=run)
    except KernelCrash as e:
        return run, "rejected: " + rejection_text(e.message)
    except (KernelMismatch, NonFiniteOutput) as f:
        twin = declared_twin(target, example.batch)
        if twin is not None and _fails_alike(target, attrs.evolve(example, batch=twin), type(f)):
            moved = ", ".join(f"{k} {getattr(twin, k)}" for k in _TWIN_FIELDS if getattr(twin, k) != getattr(
                example.batch, k))
            raise type(f)(f.check, f"{f.message} (the same batch at the declared {moved} fails alike: a failure "
                                   f"inside the declaration, not of its {what})", f.details) from None
        raise SilentlyUnsupported(
            f.check, f"{target.name} accepted an undeclared configuration ({what}) without an error and "
                     f"computed it wrongly: {f.message}. Either the kernel should reject it or its "
                     f"declaration is too narrow and it has a bug there.", f.details) from None
    return run, "accepted, correct"


#: The fields :func:`declared_twin` moves into a target's declaration.
_TWIN_FIELDS = ("dtype", "kv_cache_dtype", "head_size", "block_size")


def declared_twin(target: Target, batch: Batch) -> Batch | None:
    """``batch`` with each of its dtype, kv_cache_dtype, head_size and block_size the target does not declare moved
    to the nearest declared value (a new block size gets a contiguous block table, :func:`contiguous_batch`); None
    when that leaves something else outside the declaration, when nothing moves, or when a new block table would
    drop a production state the batch holds (kvfuzz.contracts.model.states). The undeclared property runs it to
    tell a failure of the undeclared configuration from one inside the declaration (a known finding met at an
    undeclared block size is not the block size's)."""
    caps = target.capabilities
    kv = batch.kv_cache_dtype if batch.kv_cache_dtype in caps.kv_cache_dtypes else caps.kv_cache_dtypes[0]
    sizes = caps.head_sizes_for(kv)
    dtypes = caps.dtypes_for(kv) or caps.dtypes
    fields = {"dtype": batch.dtype if batch.dtype in dtypes else dtypes[0], "kv_cache_dtype": kv,
              "head_size": batch.head_size if batch.head_size in sizes or not sizes else min(
                  sizes, key=lambda h: (abs(h - batch.head_size), h))}
    twin = attrs.evolve(batch, **fields)
    blocks = caps.block_sizes_for(kv)
    if batch.block_size not in blocks:
        if not blocks or any(s.in_batch(batch) for s in PRODUCTION_STATES.values()):
            return None
        block_size = min(blocks, key=lambda b: (abs(b - batch.block_size), b))
        rest = {k: v for k, v in attrs.asdict(twin, recurse=False).items()
                if k not in ("query_lens", "ctx_lens", "block_size", "num_blocks", "block_table")}
        twin = contiguous_batch(batch.query_lens, batch.ctx_lens, block_size=block_size, **rest)
    return None if twin == batch or caps.outside(twin) else twin


def _fails_alike(target: Target, example: Example, kind: type) -> bool:
    """Whether ``example`` fails ``target``'s property with a finding of type ``kind``."""
    try:
        check(target, example)
    except kind:
        return True
    except Exception:  # noqa: BLE001 - any other ending (a LayoutError included): not the same failure
        return False
    return False


def check_example(target: Target, example: Example, *, fault: CallerFault | None = None) -> Run:
    """Run one example through ``target``'s property, as ``kvfuzz fuzz`` does for each example it draws; the
    public name is ``kvfuzz.check_example``, meant for a Hypothesis test::

        @given(kvfuzz.examples(MyKernel.capabilities))
        def test_my_kernel(example):
            kvfuzz.check_example(MyKernel(), example)

    What it does: draws the example's ground truth (query, keys, values: seeded by ``example.batch.seed``, the
    same on every device), writes the paged cache the target's layout names (``Target.layout``) with
    ``example.poison`` in every slot the contract leaves unwritten, has the target build its call
    (``Target.build_call``), checks the call against the target's contract (the caller's invariants), runs the
    kernel (``Target.run``) and compares its output with the fp64 reference. A writer target
    (``Contract.WRITER``) is checked by what it wrote into the cache instead, a merge target (``Contract.MERGE``)
    against the exact merge of the attention states it was handed.

    ``target``: a :class:`~kvfuzz.fuzz.targets.base.Target` (an instance, e.g. ``kvfuzz.get_target(name)``)
    whose ``availability().ok`` holds here. ``example``: an :class:`~kvfuzz.contracts.model.example.Example`,
    usually drawn from ``kvfuzz.examples(target.capabilities)``; outside the target's declaration the kernel is
    asked anyway. ``fault``: a :class:`~kvfuzz.fuzz.harness.faults.CallerFault` (``kvfuzz.get_fault(name)``)
    to break the caller's side of the contract on purpose (one that cannot apply to the example, see
    ``fault.applies``, leaves it alone); None for a correct caller.

    Returns the :class:`~kvfuzz.fuzz.harness.run.Run` on a pass: ``run.output`` is the kernel's output and
    ``run.reference`` the fp64 reference (on the CPU), both ``[num_tokens, num_heads, head_size]`` (tokens in
    the batch's query order, ``sum(query_lens)``) for attention targets; ``run.data`` and ``run.cache`` hold
    the inputs, ``run.call`` the call.

    Raises a :class:`~kvfuzz.contracts.checks.failures.Finding` (an AssertionError, so Hypothesis shrinks it;
    ``finding.kind`` says whose fault, ``finding.check`` which invariant or oracle, ``finding.details`` the
    evidence): CallerContractViolation when the call breaks the contract (the kernel still runs unless the call
    could make it read or write outside its tensors, and its outcome is in ``details["kernel"]``), KernelCrash
    when the kernel raises on a correct call, NonFiniteOutput when its output holds NaN/inf, KernelMismatch
    when it disagrees with the reference beyond the tolerance (docs/tolerance.md). Raises LayoutError when the
    target's layout cannot hold the batch (a declaration wider than its layout), and whatever the adapter's
    ``layout``/``build_call`` raise, unchanged (``kvfuzz fuzz`` reports those as harness errors).
    """
    __tracebackhide__ = hide_frame_for_finding  # pytest shows the user's frame, the Finding and the shrunk example
    return check(target, example, fault)


__all__ = ["check", "check_example", "check_undeclared", "declared_twin", "is_merge", "is_writer", "prepare",
           "property_of", "rejection_text"]
