"""The caller's side of one example, for both properties (attention and writer): does the call keep the
target's contract? Three sources, in this order (a check already reported for a sequence is not repeated):

1. the ground-truth invariants (:mod:`kvfuzz.contracts.checks.invariants`): the cache against every token
   kvfuzz generated;
2. the call's metadata against the batch (:func:`metadata_violations`): only the harness knows each
   sequence's lengths, so only it can tell a shifted but well-formed ``query_start_loc``, ``kv_indptr`` or
   ``kv_last_page_len`` from the right one;
3. the runtime guard's own checks of the call (:func:`call_violations`), for a target naming its kernel's
   signature (``Target.checked_kernel``, from the target's family home; a name resolves through the guard's
   table, :func:`kvfuzz.fuzz.guard.signatures.signature_of`): a
   :class:`~kvfuzz.fuzz.targets.signature.KernelSignature`'s checks for the kernels the guard intercepts, a
   :class:`~kvfuzz.fuzz.targets.signature.PageListSignature`'s for FlashInfer's plan()/run() and
   append_paged_kv_cache.

Every violation is named by the :class:`~kvfuzz.contracts.checks.violations.Check` the guard uses for the same
argument, so a caller fault reads the same in a campaign and under ``pytest --kvfuzz-guard``.
:func:`caller_finding` turns them into the finding.

:func:`caller_checks_due` says when they run before the kernel (docs/checks.md, "When the caller checks run"):
always for a caller fault or any target but kvfuzz's own built-in classes; for a built-in target's own call, on
the first call of each call shape in the process and on a hash-selected share of the others. Whatever ran
before the kernel, an example that fails runs them before its finding is named (attention.check_example).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch

from kvfuzz.contracts.checks.failures import CallerContractViolation
from kvfuzz.contracts.checks.invariants import check_contract
from kvfuzz.contracts.checks.violations import Check, Violation, violation
from kvfuzz.contracts.model.csr import indptr, page_lists
from kvfuzz.fuzz.guard.signatures import signature_of
from kvfuzz.fuzz.harness.faults import page_list_names
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.harness.states import active_hooks
from kvfuzz.fuzz.harness.states import call_check_args as state_check_args
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.fuzz.targets.registry import BUILTIN
from kvfuzz.fuzz.targets.signature import CheckedKernel, PageListSignature


def checked_signature(target: Target) -> CheckedKernel | None:
    """The signature of ``target``'s checked kernel (its ``checked_kernel``, or the one its name resolves to in
    the guard's table); None when it names none. Raises KeyError for a name the guard does not know."""
    return None if target.checked_kernel is None else signature_of(target.checked_kernel)


def _mismatch(check: Check, got: Any, want: list[int], what: str, kernel: str) -> list[Violation]:
    """A violation of ``check`` when the call's tensor ``got`` differs from ``want`` (the batch's), located at
    the first differing entry (a prefix-sum argument's entry ``i`` belongs to sequence ``i - 1``)."""
    if not isinstance(got, torch.Tensor):
        return []
    got_l = got.cpu().tolist()
    if got_l == list(want):
        return []
    i = next((k for k, (a, b) in enumerate(zip(got_l, want)) if a != b), min(len(got_l), len(want)))
    prefix_sums = check in (Check.QUERY_START_LOC, Check.KV_INDPTR)
    seq = max(0, i - 1) if prefix_sums else i
    return [violation(check, f"{check.value} does not match the batch's {what}: entry {i} is "
                             f"{got_l[i] if i < len(got_l) else None} ({check.value} = {got_l})",
                      kernel=kernel, seq=seq, expected=list(want), found=got_l)]


def _page_list_metadata(kernel: str, run: Run) -> list[Violation]:
    """FlashInfer's page lists against the batch: every call lists all ``seq_len`` positions (the wrappers'
    run() reads the new tokens from the pages, flashinfer/decode.py and prefill.py; append_paged_kv_cache's lists
    "incorporate the appended k/v", flashinfer/page.py), so ``kv_indptr`` ``[N + 1]`` holds ``[0,
    cumsum(ceil(seq_len / page_size))]`` and ``kv_last_page_len`` ``[N]`` ``(seq_len - 1) % page_size + 1``
    (:func:`kvfuzz.contracts.model.csr.page_lists`; FlashInfer reads kv_len back with flashinfer/page.py
    ``get_seq_lens``); a prefill's ``qo_indptr`` ``[N + 1]`` = query_start_loc. Violations: ``kv_indptr``,
    ``kv_last_page_len``, ``query_start_loc`` at the first sequence that differs (shape errors are the guard
    checks' to report)."""
    kw = run.call.kwargs
    names = page_list_names(kw)
    batch = run.example.batch
    want = page_lists(batch, batch.seq_lens)
    bs = batch.block_size
    return (_mismatch(Check.QUERY_START_LOC, kw.get("qo_indptr"), list(batch.query_start_loc), "query tokens",
                      kernel)
            + _mismatch(Check.KV_INDPTR, kw[names[0]], want.page_indptr.tolist(),
                        f"pages per sequence (ceil(seq_len / page_size), page_size {bs})", kernel)
            + _mismatch(Check.LAST_PAGE_LEN, kw[names[2]], want.last_page_len.tolist(),
                        f"last page lengths ((seq_len - 1) % page_size + 1, page_size {bs})", kernel))


def metadata_violations(target: Target, run: Run) -> list[Violation]:
    """With ground truth: do the call's query_start_loc and seq_lens (CSR calls: kv_indptr, against the
    positions the target's contract says the kernel reads; FlashInfer's page lists: kv_indptr over pages and
    kv_last_page_len) describe the batch? (A shifted query_start_loc still starts at 0, rises and ends at T, so
    only the harness, which knows each sequence's query_len, can tell.) Named after the argument, as the
    guard's checks are."""
    sig = checked_signature(target)
    if sig is None:
        return []
    if isinstance(sig, PageListSignature):
        return _page_list_metadata(sig.name, run) if page_list_names(run.call.kwargs) else []
    call = sig.build_call(run.call.kwargs)
    batch = run.example.batch
    # rows a state appends after the real sequences (CUDA-graph pads), as the engine builds them
    pads, qsl = next(filter(None, (h.call_rows(target, batch) for h in active_hooks(batch))),
                     ((), batch.query_start_loc))
    lengths = (Check.SEQ_LENS, call.seq_lens, batch.seq_lens + pads, "sequence lengths")
    if call.csr is not None:  # CSR: kv_indptr lists what the contract says the kernel reads
        listed = target.capabilities.contract.cached_lens(batch)
        lengths = (Check.KV_INDPTR, call.csr.kv_indptr, tuple(indptr(tuple(listed) + pads).tolist()),
                   "positions the kernel reads (" + ("ctx_lens" if listed == batch.ctx_lens else "seq_lens") + ")")
    out = _mismatch(Check.QUERY_START_LOC, call.query_start_loc, qsl, "query tokens", sig.name)
    return out + _mismatch(*lengths, sig.name)


def call_violations(target: Target, run: Run) -> list[Violation]:
    """Error-level findings of the runtime guard's argument checks on this call
    (:mod:`kvfuzz.contracts.calls.call_checks` through its
    :meth:`~kvfuzz.fuzz.targets.signature.KernelSignature.check`; FlashInfer's plan/run/append checks through
    its :meth:`~kvfuzz.fuzz.targets.signature.PageListSignature.check`); [] when the target declares no
    ``checked_kernel``. A unified kernel's checks get the new tokens (the current-token checks)."""
    sig = checked_signature(target)
    if sig is None:
        return []
    key = value = None
    if not target.capabilities.contract.passes_new_kv:  # unified: hand the guard the new tokens, where the call is
        key, value = (t.to(run.call.key_cache.device) for t in run.data.new_kv(run.example.batch))
    if isinstance(sig, PageListSignature):
        found = sig.check(run.call.kwargs, getattr(run.call.layout, "kv_layout", "NHD"), key=key, value=value)
    else:
        # the production states' arguments (fuzz/harness/states.py), e.g. freed window columns' null block
        found = sig.check(run.call.kwargs, key=key, value=value, vacuity=False,
                          **state_check_args(run.example.batch))
    return [v for v in found if v.is_error]


def caller_violations(target: Target, run: Run) -> list[Violation]:
    """Ground-truth invariants (:mod:`kvfuzz.contracts.checks.invariants`), then the call's metadata against the
    batch, then the runtime guard's argument checks (a check already reported for a sequence is not repeated);
    [] when the call keeps the contract."""
    batch = run.example.batch
    violations = check_contract(target.capabilities.contract, batch, run.data, run.cache.layout,
                                run.call.key_cache, run.call.value_cache, run.call.key, run.call.value)
    violations += metadata_violations(target, run)
    seen = {(v.check, v.seq) for v in violations}
    return violations + [v for v in call_violations(target, run) if (v.check, v.seq) not in seen]


#: Of a built-in target's own calls (no caller fault) past the first of each call shape, one in this many has its
#: caller checks run before the kernel, chosen by a hash of the batch (the same choice for the same batch in every
#: process). Environment: KVFUZZ_CALLER_CHECK_EVERY (1: every call).
CALLER_CHECK_EVERY = max(1, int(os.environ.get("KVFUZZ_CALLER_CHECK_EVERY", 16)))
#: The call shapes (:func:`call_shape`) whose first call this process has checked, the most recently seen last: at
#: most :data:`SHAPES_KEPT`. A CPU campaign draws a new kernel configuration at nearly every example, so an unbounded
#: set grew with the campaign; a shape dropped from it is a first call again when it comes back (checked once more).
_SHAPES_CHECKED: dict[tuple, None] = {}
#: The most call shapes :data:`_SHAPES_CHECKED` remembers (a few hundred bytes each).
SHAPES_KEPT = 4096


def is_builtin(target: Target) -> bool:
    """Whether ``target`` is an instance of one of kvfuzz's built-in target classes itself (:data:`BUILTIN`, not a
    subclass: a test's or a user's subclass may build its call otherwise): its ``build_call`` is kvfuzz's own, a
    function of the batch, the data and the cache."""
    cls = type(target)
    return BUILTIN.get(getattr(target, "name", None)) == f"{cls.__module__}:{cls.__qualname__}"


def call_shape(target: Target, batch) -> tuple:
    """What decides how a built-in target builds its call, apart from the lengths and block ids: the kernel
    configuration (dtypes, heads, head size, block size, the features and the latent head size), the states
    (CUDA-graph pads, freed window blocks, a CSR tail), which kinds of sequences are in the batch (decode,
    prefill) and the target's path for the batch (``Target.path``)."""
    kinds = (any(q == 1 for q in batch.query_lens), any(q > 1 for q in batch.query_lens))
    return (target.name, batch.dtype, batch.kv_cache_dtype, batch.num_heads, batch.num_kv_heads, batch.head_size,
            batch.block_size, batch.value_head_size, batch.features, bool(batch.num_pad_seqs),
            batch.freed_window_blocks, bool(batch.csr_tail), kinds, target.path(batch))


def caller_checks_due(target: Target, batch, fault: Any = None) -> bool:
    """Whether the caller checks (:func:`caller_violations`) run on this call before the kernel: always with a
    caller ``fault`` or for a target that is not built in (:func:`is_builtin`: an adapter, a subclass); for a
    built-in target's own call, on the first call of its :func:`call_shape` in this process (of the
    :data:`SHAPES_KEPT` shapes seen last: one that comes back after more new ones is a first call again) and on one in
    :data:`CALLER_CHECK_EVERY` others (a CRC-32 of the batch's seed and lengths). The attention property runs them
    after the kernel on every failing example they skipped (docs/checks.md, "When the caller checks run")."""
    if fault is not None or CALLER_CHECK_EVERY == 1 or not is_builtin(target):
        return True
    shape = call_shape(target, batch)
    first = shape not in _SHAPES_CHECKED
    _SHAPES_CHECKED.pop(shape, None)
    _SHAPES_CHECKED[shape] = None  # the most recently seen end
    if len(_SHAPES_CHECKED) > SHAPES_KEPT:
        del _SHAPES_CHECKED[next(iter(_SHAPES_CHECKED))]  # the least recently seen
    return first or _hash_selected(batch)


def _hash_selected(batch) -> bool:
    """Whether a CRC-32 of the batch's seed, lengths and block count picks it (one batch in
    :data:`CALLER_CHECK_EVERY`)."""
    key = f"{batch.seed}:{batch.query_lens}:{batch.ctx_lens}:{batch.num_blocks}".encode()
    return zlib.crc32(key) % CALLER_CHECK_EVERY == 0


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


__all__ = ["CALLER_CHECK_EVERY", "SHAPES_KEPT", "call_shape", "call_violations", "caller_checks_due", "caller_finding",
           "caller_violations", "checked_signature", "is_builtin", "metadata_violations"]
