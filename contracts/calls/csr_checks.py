"""The runtime guard's checks of a CSR call (SGLang's Triton ``extend_attention_fwd`` and ``decode_attention_fwd``,
sglang/kernels/ops/attention/ in sglang 0.5.23), without ground truth.

A CSR call arrives as a :class:`~kvfuzz.contracts.calls.paged_call.PagedCall` whose ``csr``
(:class:`~kvfuzz.contracts.calls.paged_call.CsrArgs`) holds the call's own ``kv_indptr``/``kv_indices``/``qo_indptr``
and decode scratch, and whose block table is the token-level table those lists describe (block_size 1 over the
pool viewed as ``[slots, 1, Hkv, D]``), so the block-table checks of :mod:`kvfuzz.contracts.calls.call_checks` (the
decode/unified invariant with the new tokens handed over, vacuity, kv_cache_dtype) apply unchanged. This module
adds what only CSR lists can get wrong, measured on the kernels (kvfuzz's notes, sglang 0.5.23 under Triton
3.9's interpreter):

- shapes: ``q [T, H, D]``, pools ``[slots, Hkv, D]`` and ``[slots, Hkv, Dv]`` (3-D: the kernels raise on a 4-D
  paged view), ``kv_indptr``/``qo_indptr`` 1-D with ``N + 1`` entries, decode ``q.shape[0] <= N``
  (:func:`check_csr_shapes`);
- index dtypes: int32 or int64 (both give identical results; the kernels load them with the pointer's type),
  on the query's device (:func:`check_csr_index_tensors`);
- ``kv_indptr`` never decreases and every entry it makes the kernel read exists (``kv_indptr[-1] <=
  len(kv_indices)``), every slot read is in the pool, a decode sequence lists at least its current token (an
  empty one outputs NaN: 0/0 in stage 2), and no two decode sequences name one slot for their current token
  (:func:`check_csr`). ``kv_indptr[0]`` need not be 0: the kernels read only ``kv_indptr[i] ..
  kv_indptr[i + 1]`` (measured with padding before and after), so kvfuzz does not flag it;
- decode's split-KV scratch: ``1 <= num_kv_splits[i] <= max_kv_splits`` (more drops keys silently: 8 splits
  with max 2 gave a 0.56 error), ``max_kv_splits == attn_logits.shape[2]``, ``attn_logits`` contiguous fp32 with
  last dim exactly ``Dv`` and ``attn_lse`` fp32 ``[N, H, max_kv_splits]`` (the LSE is addressed as
  ``offset // Lv``: a last dim of 128 at Dv = 80 wrote out of bounds and killed the interpreter)
  (:func:`check_decode_scratch`).

What no CSR check can see without ground truth: whether ``kv_indptr`` lists the right lengths (extend takes no
lengths besides it) and whether ``k_extend`` holds the new tokens (the harness checks both against ground
truth). Every check here is pure and vectorized over entries; Python loops run over offending sequences only.
"""

from __future__ import annotations

import torch

from ..checks.violations import MAX_RECORDS_PER_CHECK, Category, Check, Severity, Violation, capped, violation
from ..model.csr import token_table
from .paged_call import CsrArgs, Lens, PagedCall, index_values, is_tensor, scalar_int


def _shape(t) -> str:
    return str(tuple(t.shape)) if is_tensor(t) else type(t).__name__


def check_csr_shapes(call: PagedCall) -> list[Violation]:
    """The CSR call's tensors have the kernel's shapes; a violation here stops the other checks."""
    csr: CsrArgs = call.csr
    k, out = call.kernel, []

    def bad(what, expected, found):
        out.append(violation(Check.SHAPES, what, kernel=k, expected=expected, found=found))

    q, kp, vp = call.query, csr.key_pool, csr.value_pool
    for name, t in ((call.name("query"), q), ("k_buffer", kp), ("v_buffer", vp), ("kv_indptr", csr.kv_indptr),
                    ("kv_indices", csr.kv_indices)):
        if not is_tensor(t):
            bad(f"{name} is not a tensor", "a torch.Tensor", type(t).__name__)
    if out:
        return out
    if q.dim() != 3:
        bad(f"{call.name('query')} must be [tokens, num_heads, head_dim]", "3 dims", _shape(q))
    if kp.dim() != 3 or vp.dim() != 3:
        bad("k_buffer and v_buffer must be the pool [slots, num_kv_heads, head_dim] (3-D: the kernel's "
            "_extract_kv_strides raises on another ndim)", "3 dims each", f"{_shape(kp)} and {_shape(vp)}")
    elif kp.shape[:2] != vp.shape[:2]:
        bad("k_buffer and v_buffer must have the same slots and kv heads", f"{tuple(kp.shape[:2])} for both",
            f"{_shape(kp)} and {_shape(vp)}")
    if out:
        return out
    d, hkv = int(q.shape[2]), int(kp.shape[1])
    if int(kp.shape[2]) != d:
        bad(f"k_buffer's head_dim must be {call.name('query')}'s", d, int(kp.shape[2]))
    if hkv == 0 or q.shape[1] % hkv:
        bad(f"{call.name('query')} has {int(q.shape[1])} heads, not a multiple of the pool's {hkv} kv heads "
            "(GQA maps head h to kv head h // (H // Hkv); the kernels do not check it)", f"a multiple of {hkv}",
            int(q.shape[1]))
    for arg, dim in (("key", d), ("value", int(vp.shape[2]))):
        t = getattr(call, arg)
        if t is not None and (not is_tensor(t) or t.dim() != 3 or t.shape[1] != hkv or t.shape[2] != dim):
            bad(f"{call.name(arg)} must be [tokens, num_kv_heads, head_dim]", f"[*, {hkv}, {dim}]", _shape(t))
    for name, t in (("kv_indptr", csr.kv_indptr), ("kv_indices", csr.kv_indices)):
        if t.dim() != 1:
            bad(f"{name} must be 1-D", "1 dim", _shape(t))
    if csr.qo_indptr is not None and (not is_tensor(csr.qo_indptr) or csr.qo_indptr.dim() != 1):
        bad("qo_indptr must be a 1-D tensor [batch + 1]", "1 dim", _shape(csr.qo_indptr))
    if out:
        return out
    n = int(csr.kv_indptr.shape[0]) - 1
    if n < 0:
        bad("kv_indptr must have batch + 1 entries", ">= 1 entry", 0)
    elif csr.qo_indptr is not None and int(csr.qo_indptr.shape[0]) != n + 1:
        bad(f"qo_indptr and kv_indptr must both have batch + 1 entries (kv_indptr has {n + 1})", n + 1,
            int(csr.qo_indptr.shape[0]))
    elif csr.qo_indptr is None and int(q.shape[0]) > n:
        bad(f"q has {int(q.shape[0])} rows but kv_indptr describes {n} sequences (the kernel asserts "
            "q.shape[0] <= kv_indptr.shape[0] - 1)", f"<= {n} rows", int(q.shape[0]))
    ps = scalar_int(csr.page_size)
    if ps is None or ps < 1:
        bad("page_size must be an int >= 1", ">= 1", repr(csr.page_size))
    return out


def check_csr_index_tensors(call: PagedCall) -> list[Violation]:
    """kv_indptr, kv_indices, qo_indptr and num_kv_splits have a dtype every path of the call's declaration
    reads (SGLang's kernels: int32 or int64; its backend passes int32 indptrs and int64 kv_indices, its kernel
    tests int32 or int64; every combination gave identical results), and every tensor is on the query's
    device."""
    csr: CsrArgs = call.csr
    out = []
    dev = call.query.device
    accepted = frozenset.intersection(*(p.index_dtypes for p in call.declaration.paths if p.taken_on is None))
    named = (("kv_indptr", csr.kv_indptr), ("kv_indices", csr.kv_indices), ("qo_indptr", csr.qo_indptr),
             ("num_kv_splits", csr.num_kv_splits))
    for name, t in named:
        if is_tensor(t) and t.dtype not in accepted:
            want = " or ".join(sorted(map(str, accepted)))
            out.append(violation(Check.INDEX_DTYPE, f"{name} is {t.dtype}; the kernel loads it with its element "
                                 f"type and is written (and tested) for {want} indices", kernel=call.kernel,
                                 expected=want, found=t.dtype, fix=f"create {name} as {want}"))
    for name, t in (*named, ("k_buffer", csr.key_pool), ("v_buffer", csr.value_pool), (call.name("key"), call.key),
                    (call.name("value"), call.value), ("attn_logits", csr.attn_logits), ("attn_lse", csr.attn_lse)):
        if is_tensor(t) and t.device != dev:
            out.append(violation(Check.DEVICE, f"{name} is on {t.device}, the query on {dev}", kernel=call.kernel,
                                 expected=dev, found=t.device))
    return out


def check_csr(call: PagedCall, lens: Lens) -> tuple[list[Violation], torch.Tensor]:
    """kv_indptr and kv_indices (see the module docstring). Returns the violations and a bool ``[N]`` mask of
    sequences whose listed slots are all readable (the cache-content checks use only those)."""
    csr: CsrArgs = call.csr
    k = call.kernel
    ptr, idx = index_values(csr.kv_indptr), index_values(csr.kv_indices)
    n = len(lens.seq_lens)  # the sequences the kernel reads (decode: the first q.shape[0])
    ptr = ptr[: n + 1]
    ok = torch.ones(n, dtype=torch.bool)
    out: list[Violation] = []
    starts, ends = ptr[:-1], ptr[1:]
    m = len(idx)
    # kv_indptr never decreases
    dec = torch.nonzero(ends < starts).flatten()
    recs = [violation(Check.KV_INDPTR, f"kv_indptr decreases from entry {i} to {i + 1}, so sequence {i} lists "
                      f"{int(ends[i] - starts[i])} slots", kernel=k, seq=i,
                      expected=f"kv_indptr[{i + 1}] >= {int(starts[i])}", found=int(ends[i]))
            for i in dec[:MAX_RECORDS_PER_CHECK].tolist()]
    out += capped(recs, len(dec))
    ok &= ends >= starts
    # every entry read exists
    outside = torch.nonzero((ends > starts) & ((starts < 0) | (ends > m))).flatten()
    recs = [violation(Check.KV_INDICES_RANGE, f"kv_indptr makes the kernel read kv_indices[{int(starts[i])}:"
                      f"{int(ends[i])}] for sequence {i}, but kv_indices has {m} entries", kernel=k, seq=i,
                      expected=f"0 <= kv_indptr[i] and kv_indptr[i + 1] <= {m}",
                      found=f"kv_indptr[{i}:{i + 2}] = [{int(starts[i])}, {int(ends[i])}]")
            for i in outside[:MAX_RECORDS_PER_CHECK].tolist()]
    out += capped(recs, len(outside))
    ok[outside] = False
    # every slot read is in the pool
    table = token_table(ptr, idx).table
    slots = int(csr.key_pool.shape[0])
    lens_listed = (ends - starts).clamp(min=0)
    if table.numel():
        cols = torch.arange(table.shape[1])
        read = ok[:, None] & (cols[None, :] < lens_listed[:, None])
        oob = read & ((table < 0) | (table >= slots))
        bad_seqs = torch.nonzero(oob.any(dim=1)).flatten()
        recs = []
        for i in bad_seqs[:MAX_RECORDS_PER_CHECK].tolist():
            p = int(torch.nonzero(oob[i]).flatten()[0])
            s = int(table[i, p])
            recs.append(violation(Check.KV_INDICES_RANGE, f"kv_indices[{int(starts[i]) + p}] = {s} (sequence {i}'s "
                        f"entry {p}) is outside the pool's {slots} slots (k_buffer.shape[0])", kernel=k, seq=i,
                        position=p, slot=s, expected=f"0 <= slot < {slots}", found=s, count=int(oob[i].sum())))
        out += capped(recs, len(bad_seqs))
        ok &= ~oob.any(dim=1)
    if csr.listed == "all":  # decode: each sequence lists its current token, last
        empty = torch.nonzero((lens_listed == 0) & (ends >= starts)).flatten()
        recs = [violation(Check.KV_INDPTR, f"sequence {i} lists no slot (kv_indptr[{i}] == kv_indptr[{i + 1}] == "
                          f"{int(starts[i])}); a decode sequence reads at least its current token, and an empty "
                          "one gives NaN (0/0 in the split merge)", kernel=k, seq=i, expected=">= 1 slot",
                          found="0 slots") for i in empty[:MAX_RECORDS_PER_CHECK].tolist()]
        out += capped(recs, len(empty))
        out += _shared_current_slots(call, table, lens_listed, ok)
    return out, ok


def _shared_current_slots(call: PagedCall, table: torch.Tensor, lens: torch.Tensor, ok: torch.Tensor
                          ) -> list[Violation]:
    """Decode: no two sequences name one slot for their current token (the last listed): the backend writes
    each current token there before the kernel runs, and the second write clobbers the first."""
    if not table.numel():
        return []
    live = torch.nonzero(ok & (lens > 0)).flatten()
    if len(live) < 2:
        return []
    last = table[live, lens[live] - 1]
    uniq, inverse, counts = torch.unique(last, return_inverse=True, return_counts=True)
    out = []
    shared = torch.nonzero(counts > 1).flatten()
    for u in shared[:MAX_RECORDS_PER_CHECK].tolist():
        seqs = live[inverse == u].tolist()
        writes = call.declaration.writes_cache
        story = (f"slot {int(uniq[u])} is the current token's slot of sequences {seqs}: "
                 + ("writing one current token clobbers the other's" if writes else
                    f"a state a serving engine never creates (each current token gets its own out_cache_loc); "
                    f"{call.kernel} writes nothing, so it reads what the pool holds"))
        out.append(violation(Check.BLOCK_SHARING, story, kernel=call.kernel,
                             seq=seqs[1], slot=int(uniq[u]), expected="one current token per slot",
                             found=f"{len(seqs)} sequences", count=len(seqs),
                             severity=Severity.ERROR if writes else Severity.WARNING,
                             category=None if writes else Category.REALISM,
                             fix="give every decode sequence its own slot for its current token (out_cache_loc); "
                                 "only full prefix pages may be shared (SGLang's radix cache)"))
    return capped(out, len(shared))


def check_decode_scratch(call: PagedCall) -> list[Violation]:
    """decode_attention_fwd's split-KV scratch and split counts (see the module docstring); [] for extend."""
    csr: CsrArgs = call.csr
    if csr.attn_logits is None and csr.num_kv_splits is None:
        return []
    k, out = call.kernel, []
    rows, heads = int(call.query.shape[0]), int(call.query.shape[1])
    dv = int(csr.value_pool.shape[2])
    mks = scalar_int(csr.max_kv_splits)

    def bad(check, what, expected, found):
        out.append(violation(check, what, kernel=k, expected=expected, found=found))

    lg, lse = csr.attn_logits, csr.attn_lse
    if is_tensor(lg):
        want_last = dv if lse is not None else dv + 1  # before attn_lse existed the LSE was attn_logits[..., Dv]
        if lg.dtype != torch.float32 or lg.dim() != 4 or not lg.is_contiguous() or int(lg.shape[-1]) != want_last \
                or int(lg.shape[0]) < rows or int(lg.shape[1]) != heads:
            bad(Check.SCRATCH, "attn_logits must be contiguous float32 [batch, num_heads, max_kv_splits, v_head_dim]",
                f"float32 [>= {rows}, {heads}, max_kv_splits, {want_last}], contiguous",
                f"{lg.dtype} {tuple(lg.shape)}{'' if lg.is_contiguous() else ', not contiguous'}")
        elif mks is not None and int(lg.shape[2]) != mks:
            bad(Check.SCRATCH, f"max_kv_splits = {mks} must equal attn_logits.shape[2] (the kernel asserts it)",
                mks, int(lg.shape[2]))
    if is_tensor(lse) and is_tensor(lg) and lg.dim() == 4:
        want = (int(lg.shape[0]), heads, int(lg.shape[2]))
        if lse.dtype != torch.float32 or lse.dim() != 3 or not lse.is_contiguous() or int(lse.shape[0]) < rows \
                or tuple(int(x) for x in lse.shape[1:]) != want[1:]:
            bad(Check.SCRATCH, "attn_lse must be contiguous float32 [batch, num_heads, max_kv_splits]",
                f"float32 [>= {rows}, {heads}, {want[2]}], contiguous", f"{lse.dtype} {tuple(lse.shape)}")
    splits = index_values(csr.num_kv_splits)
    if splits is None or splits.dim() != 1 or len(splits) < rows:
        bad(Check.NUM_KV_SPLITS, "num_kv_splits must be an integer tensor with one value per sequence",
            f"[>= {rows}] integers", _shape(csr.num_kv_splits))
    elif mks is not None:
        wrong = torch.nonzero((splits[:rows] < 1) | (splits[:rows] > mks)).flatten()
        recs = [violation(Check.NUM_KV_SPLITS, f"num_kv_splits[{i}] = {int(splits[i])} is outside 1..max_kv_splits"
                          f" = {mks}" + (": the kernel's grid has only max_kv_splits splits, so the keys past "
                                         f"{mks} splits are dropped silently" if int(splits[i]) > mks else
                                         ": the split length divides by it"),
                          kernel=k, seq=i, expected=f"1..{mks}", found=int(splits[i]))
                for i in wrong[:MAX_RECORDS_PER_CHECK].tolist()]
        out += capped(recs, len(wrong))
    return out


__all__ = ["check_csr", "check_csr_index_tensors", "check_csr_shapes", "check_decode_scratch"]
