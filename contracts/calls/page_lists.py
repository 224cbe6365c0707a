"""The runtime guard's checks of FlashInfer's paged calls, whose caller contract is split between a wrapper's
``plan()`` (the page lists, heads, head_dim, page_size, dtypes) and its ``run()`` (q and the cache), plus
``append_paged_kv_cache`` (the cache writer). Pure functions over tensors (moved to the CPU), each returning
:class:`~kvfuzz.contracts.checks.violations.Violation` records; :mod:`kvfuzz.fuzz.guard.flashinfer` wires them to
the wrapper classes.

Sources (flashinfer-python 0.7.x; read at flashinfer-ai/flashinfer main, 2026-08):

- ``BatchDecodeWithPagedKVCacheWrapper.plan(indptr [N + 1], indices [indptr[-1]], last_page_len [N],
  num_qo_heads, num_kv_heads, head_dim, page_size, *, pos_encoding_mode, window_left, logits_soft_cap,
  q_data_type, kv_data_type, sm_scale, ...)`` (flashinfer/decode.py ``_plan_impl``): ``batch_size =
  len(last_page_len)``; the module is compiled for ``indptr.dtype`` (``get_batch_decode_module(..., indptr.dtype,
  ...)``), so ``indices`` and ``last_page_len`` must have that dtype too; kv lengths come from
  flashinfer/page.py ``get_seq_lens``: ``clamp(indptr[1:] - indptr[:-1] - 1, min=0) * page_size +
  last_page_len``. ``run(q [N, H, D], paged_kv_cache, *, k_scale, v_scale, ...)``: reads ``page_size`` from
  the cache's shape (``k_cache.shape[1]`` NHD, ``shape[2]`` HND) and checks only the dtypes against the plan
  (flashinfer/utils.py ``_check_cached_qkv_data_type``).
- ``BatchPrefillWithPagedKVCacheWrapper.plan(qo_indptr [N + 1], paged_kv_indptr, paged_kv_indices,
  paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal, sm_scale,
  window_left, logits_soft_cap, q_data_type, kv_data_type, ...)`` (flashinfer/prefill.py); ``run(q
  [qo_indptr[-1], H, D], paged_kv_cache, ...)``. Causal masks align the queries to the end of the kv
  sequence, so ``qo_len <= kv_len`` is required (FlashInfer's tests skip "qo_len > kv_len and causal": not
  supported).
- ``append_paged_kv_cache(append_key [nnz, Hkv, D], append_value, batch_indices [nnz], positions [nnz],
  paged_kv_cache, kv_indices, kv_indptr [N + 1], kv_last_page_len [N], kv_layout)`` (flashinfer/page.py;
  csrc/page.cu ``append_paged_kv_cache``): every index tensor is read through ``static_cast<int32_t*>`` (int32
  only: the C++ side checks shapes, not dtypes), ``append_key`` through the cache's element type (it must have
  the cache's dtype), row ``r`` goes to position ``positions[r]`` of sequence ``batch_indices[r]``, which must
  be inside the page lists (FlashInfer's note: the lists "incorporated appended k/v").

What every call checks: ``indptr`` 1-D with ``N + 1`` entries, never decreasing, ``indptr[-1] <=
len(indices)`` (:data:`Check.KV_INDPTR`); ``last_page_len[i]`` in ``1 .. page_size`` for a sequence with pages
and 0 for one without (:data:`Check.LAST_PAGE_LEN`; an empty sequence is allowed by ``get_seq_lens``, but a
decode of it or a prefill with ``qo_len > 0`` attends to nothing: :data:`Check.SEQ_LEN_GE_QUERY_LEN`); every
page id read is a page of the cache (:data:`Check.KV_INDICES_RANGE`, checked at run, where the cache is known).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ..caches.flashinfer_layouts import FlashInferLayout, unpack_paged_kv_cache
from ..checks.violations import Check, Violation, capped, violation

#: Index dtypes FlashInfer's attention modules are compiled for (the ``idtype`` of their JIT specs).
FLASHINFER_INDEX_DTYPES = (torch.int32, torch.int64)
_FIX_RANGE = ("make every page id between kv_indptr[0] and kv_indptr[-1] a page of the cache: 0 <= id < "
              "paged_kv_cache.shape[0] (page ids, not token slots), and keep kv_indptr[-1] <= len(kv_indices)")
_FIX_CURRENT = ("append the new tokens to the pages before attention (flashinfer.append_paged_kv_cache with "
                "batch_indices/positions from get_batch_indices_positions, as vLLM's and SGLang's FlashInfer "
                "backends do): the kernel reads all kv_len = (pages - 1) * page_size + last_page_len tokens of "
                "every sequence from the pages, its current tokens in the last slots")


def _t(x: Any) -> torch.Tensor | None:
    return x.detach().to("cpu") if isinstance(x, torch.Tensor) else None


@attrs.frozen(eq=False)
class PagePlan:
    """What a wrapper's ``plan()`` was told (CPU copies of the index tensors, original dtypes kept).

    kind: "decode" or "prefill" (or "append" for append_paged_kv_cache's lists). indptr: ``[N + 1]``;
    indices: page ids; last_page_len: ``[N]``; qo_indptr: ``[N + 1]`` (prefill) or None (decode: one query
    row per sequence). num_qo_heads, num_kv_heads, head_dim, page_size: as given. q_dtype, kv_dtype: the
    planned dtypes (None: not known). kv_layout: the wrapper's ("NHD"/"HND"). window_left: -1 none.
    """

    kind: str
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    qo_indptr: torch.Tensor | None = None
    q_dtype: torch.dtype | None = None
    kv_dtype: torch.dtype | None = None
    kv_layout: str = "NHD"
    window_left: int = -1
    causal: bool = True

    @property
    def kernel(self) -> str:
        return {"decode": "flashinfer.BatchDecodeWithPagedKVCacheWrapper",
                "prefill": "flashinfer.BatchPrefillWithPagedKVCacheWrapper"}.get(self.kind,
                                                                                 "flashinfer.append_paged_kv_cache")

    @property
    def batch_size(self) -> int:
        return int(self.last_page_len.numel())

    def pages(self) -> torch.Tensor:
        """int64 ``[N]``: pages per sequence (``indptr`` differences, clamped at 0)."""
        p = self.indptr.to(torch.int64)
        return (p[1:] - p[:-1]).clamp(min=0)

    def kv_lens(self) -> torch.Tensor:
        """int64 ``[N]``: flashinfer/page.py ``get_seq_lens``."""
        return (self.pages() - 1).clamp(min=0) * self.page_size + self.last_page_len.to(torch.int64)

    def qo_lens(self) -> torch.Tensor:
        if self.qo_indptr is None:
            return torch.ones(self.batch_size, dtype=torch.int64)
        q = self.qo_indptr.to(torch.int64)
        return q[1:] - q[:-1]

    def num_rows(self) -> int:
        return self.batch_size if self.qo_indptr is None else int(self.qo_indptr[-1])


def make_plan(kind: str, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
              qo_indptr=None, q_data_type=None, kv_data_type=None, kv_layout: str = "NHD", window_left: int = -1,
              causal: bool = True) -> PagePlan:
    """A :class:`PagePlan` from plan()'s arguments (tensors copied to the CPU; dtype names such as "float16"
    resolved; ``kv_data_type`` None means ``q_data_type``, as flashinfer/decode.py does)."""
    def dt(x):
        if x is None or isinstance(x, torch.dtype):
            return x
        return getattr(torch, str(x).replace("torch.", ""), None)

    q_dt = dt(q_data_type)
    return PagePlan(kind, _t(indptr), _t(indices), _t(last_page_len), int(num_qo_heads), int(num_kv_heads),
                    int(head_dim), int(page_size), _t(qo_indptr), q_dt, dt(kv_data_type) or q_dt, kv_layout,
                    int(window_left if window_left is not None else -1), bool(causal))


# ---- plan ---------------------------------------------------------------------------------------------
def check_index_dtypes(plan: PagePlan, *, int32_only: bool = False) -> list[Violation]:
    """The index tensors are integer tensors of one dtype, the one the module is compiled for (decode/prefill:
    ``indptr.dtype``, int32 or int64); for append_paged_kv_cache int32 only (csrc/page.cu casts to int32_t*)."""
    k, out = plan.kernel, []
    tensors = {"kv_indptr": plan.indptr, "kv_indices": plan.indices, "kv_last_page_len": plan.last_page_len}
    if plan.qo_indptr is not None:
        tensors["qo_indptr"] = plan.qo_indptr
    for name, t in tensors.items():
        if t is None:
            out.append(violation(Check.SHAPES, f"{name} is not a tensor", kernel=k, expected="a torch.Tensor",
                                 found="not a tensor"))
    if out:
        return out
    want = (torch.int32,) if int32_only else FLASHINFER_INDEX_DTYPES
    ref = torch.int32 if int32_only else plan.indptr.dtype
    for name, t in tensors.items():
        if t.dtype not in want or t.dtype != ref:
            out.append(violation(
                Check.INDEX_DTYPE, f"{name} is {t.dtype}; the kernel reads every index tensor as "
                + ("int32 (csrc/page.cu: static_cast<int32_t*>)" if int32_only else
                   f"kv_indptr's dtype {ref} (the module is compiled for indptr.dtype)"),
                kernel=k, expected=str(ref), found=str(t.dtype),
                fix="create kv_indptr, kv_indices, kv_last_page_len (and qo_indptr) as torch.int32"))
    return out


def check_page_lists(plan: PagePlan) -> list[Violation]:
    """``indptr`` 1-D with ``N + 1`` entries (``N = len(last_page_len)``), never decreasing, within
    ``indices``; ``last_page_len`` in ``1 .. page_size`` where a sequence has pages, 0 where it has none; GQA
    heads divide. A violation of the shapes stops the rest."""
    k, out = plan.kernel, []
    ptr, last = plan.indptr, plan.last_page_len
    if ptr.dim() != 1 or last.dim() != 1 or plan.indices.dim() != 1:
        return [violation(Check.SHAPES, "kv_indptr, kv_indices and kv_last_page_len must be 1-D", kernel=k,
                          expected="1-D each", found=f"{tuple(ptr.shape)}, {tuple(plan.indices.shape)}, "
                                                     f"{tuple(last.shape)}")]
    n = plan.batch_size
    if ptr.numel() != n + 1:
        return [violation(Check.KV_INDPTR, f"kv_indptr must have batch_size + 1 entries (batch_size = "
                                           f"len(kv_last_page_len) = {n})", kernel=k, expected=n + 1,
                          found=ptr.numel(), fix="build kv_indptr as [0, cumsum(pages per sequence)] and "
                                                 "kv_last_page_len with one entry per sequence")]
    if plan.qo_indptr is not None and (plan.qo_indptr.dim() != 1 or plan.qo_indptr.numel() != n + 1):
        out.append(violation(Check.QUERY_START_LOC, "qo_indptr must have batch_size + 1 entries", kernel=k,
                             expected=n + 1, found=tuple(plan.qo_indptr.shape)))
    if plan.num_kv_heads < 1 or plan.num_qo_heads % plan.num_kv_heads:
        out.append(violation(Check.SHAPES, "num_qo_heads must be a multiple of num_kv_heads", kernel=k,
                             expected=f"a multiple of {plan.num_kv_heads}", found=plan.num_qo_heads))
    if plan.page_size < 1:
        out.append(violation(Check.SHAPES, "page_size must be >= 1", kernel=k, expected=">= 1",
                             found=plan.page_size))
        return out
    p = ptr.to(torch.int64)
    steps = p[1:] - p[:-1]
    bad = torch.nonzero(steps < 0).flatten().tolist()
    recs = [violation(Check.KV_INDPTR, "kv_indptr decreases", kernel=k, seq=i, expected=f">= {int(p[i])}",
                      found=int(p[i + 1]), fix="build kv_indptr as [0, cumsum(pages per sequence)]")
            for i in bad[:8]]
    out += capped(recs, len(bad))
    if int(p[0]) < 0 or int(p[-1]) > plan.indices.numel():
        out.append(violation(Check.KV_INDPTR, "kv_indptr must stay inside kv_indices (0 <= kv_indptr[0], "
                                              "kv_indptr[-1] <= len(kv_indices))", kernel=k,
                             expected=f"0 .. {plan.indices.numel()}", found=f"{int(p[0])} .. {int(p[-1])}",
                             fix=_FIX_RANGE))
    pages, last64 = steps.clamp(min=0), last.to(torch.int64)
    wrong = ((pages > 0) & ((last64 < 1) | (last64 > plan.page_size))) | ((pages == 0) & (last64 != 0))
    bad = torch.nonzero(wrong).flatten().tolist()
    recs = []
    for i in bad[:8]:
        if int(pages[i]) == 0:
            what = "a sequence without pages must have kv_last_page_len 0 (get_seq_lens would give it " \
                   f"kv_len {int(last64[i])} with no page to read it from)"
            exp = 0
        else:
            what = f"kv_last_page_len must be in 1..page_size={plan.page_size} (a full last page is page_size)"
            exp = f"1..{plan.page_size}"
        recs.append(violation(Check.LAST_PAGE_LEN, what, kernel=k, seq=i, expected=exp, found=int(last64[i])))
    out += capped(recs, len(bad))
    return out


def check_lengths(plan: PagePlan) -> list[Violation]:
    """Every sequence's kv_len covers its query rows: a decode needs ``kv_len >= 1`` (its current token),
    a causal prefill ``kv_len >= qo_len`` (FlashInfer aligns the queries to the end of the kv sequence and
    does not support ``qo_len > kv_len``); ``qo_indptr`` never decreases."""
    if plan.indptr.numel() != plan.batch_size + 1 or (plan.qo_indptr is not None
                                                      and plan.qo_indptr.numel() != plan.batch_size + 1):
        return []
    k, out = plan.kernel, []
    qo, kv = plan.qo_lens(), plan.kv_lens()
    neg = torch.nonzero(qo < 0).flatten().tolist()
    out += capped([violation(Check.QUERY_START_LOC, "qo_indptr decreases", kernel=k, seq=i,
                             expected=">= 0 rows", found=int(qo[i])) for i in neg[:8]], len(neg))
    short = torch.nonzero((qo > 0) & (kv < qo) if plan.causal or plan.kind == "decode" else (qo > 0) & (kv < 1))
    short = short.flatten().tolist()
    recs = [violation(Check.SEQ_LEN_GE_QUERY_LEN,
                      ("a decode sequence with no kv token (its current token must be in the pages)"
                       if plan.kind == "decode" else
                       "a causal prefill sequence with more query rows than kv tokens (the kv_len must count the "
                       "cached prefix and the appended new tokens)"),
                      kernel=k, seq=i, expected=f"kv_len >= {int(qo[i])}", found=f"kv_len {int(kv[i])}",
                      fix=_FIX_CURRENT) for i in short[:8]]
    return out + capped(recs, len(short))


def check_plan(plan: PagePlan) -> list[Violation]:
    """Everything :func:`check_index_dtypes`, :func:`check_page_lists` and :func:`check_lengths` find
    (page-id ranges need the cache: :func:`check_run`)."""
    out = check_index_dtypes(plan)
    if any(v.check is Check.SHAPES for v in out):
        return out
    pl = check_page_lists(plan)
    if any(v.check in (Check.SHAPES, Check.KV_INDPTR) and "batch_size + 1" in v.message for v in pl):
        return out + pl
    return out + pl + check_lengths(plan)


# ---- run ----------------------------------------------------------------------------------------------
def check_page_ids(plan: PagePlan, num_pages: int) -> list[Violation]:
    """Every page id a sequence lists (``indices[indptr[i] : indptr[i + 1]]``) is a page of the cache."""
    k = plan.kernel
    p = plan.indptr.to(torch.int64)
    if p.numel() != plan.batch_size + 1 or plan.batch_size == 0:
        return []
    lo, hi = max(int(p[0]), 0), min(int(p[-1]), plan.indices.numel())
    ids = plan.indices[lo:hi].to(torch.int64)
    bad = torch.nonzero((ids < 0) | (ids >= num_pages)).flatten() + lo
    recs = []
    for e in bad[:8].tolist():
        seq = int(torch.searchsorted(p[1:], torch.tensor(e), right=True))
        recs.append(violation(Check.KV_INDICES_RANGE, f"kv_indices[{e}] is not a page of the cache", kernel=k,
                              seq=seq, block=int(plan.indices[e]), expected=f"0 .. {num_pages - 1}",
                              found=int(plan.indices[e]), fix=_FIX_RANGE))
    return capped(recs, len(bad))


def check_run(plan: PagePlan | None, q: Any, paged_kv_cache: Any, kernel: str = "") -> list[Violation]:
    """run()'s ``q`` and ``paged_kv_cache`` against what plan() was told: a run without a plan; q
    ``[rows, num_qo_heads, head_dim]`` of the planned dtype (rows = batch_size for decode, ``qo_indptr[-1]``
    for prefill); the cache's page_size, kv heads, head_dim and dtype as planned (run() reads page_size from
    the cache, so a mismatch silently changes every kv_len); page ids in range."""
    if plan is None:
        return [violation(Check.PLAN_RUN, "run() was called on a wrapper that was never planned", kernel=kernel,
                          expected="plan() before run()", found="no plan")]
    k, out = plan.kernel, []

    def bad(what, expected, found):
        out.append(violation(Check.PLAN_RUN, what, kernel=k, expected=expected, found=found))

    try:
        kc, vc = unpack_paged_kv_cache(paged_kv_cache, plan.kv_layout)
    except ValueError as e:
        return [violation(Check.SHAPES, str(e), kernel=k, expected="a 5-D tensor or a (k, v) tuple",
                          found=type(paged_kv_cache).__name__)]
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        bad("q must be [rows, num_qo_heads, head_dim]", "3 dims",
            tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__)
        return out
    if kc.dim() != 4 or vc.dim() != 4 or kc.shape != vc.shape:
        bad("the key and value caches must be 4-D of one shape", "[pages, ...] 4-D each",
            f"{tuple(kc.shape)} and {tuple(vc.shape)}")
        return out
    pages, page_size, hkv, d = FlashInferLayout(plan.kv_layout).dims(kc)
    rows = plan.num_rows()
    if tuple(q.shape) != (rows, plan.num_qo_heads, plan.head_dim):
        bad("q does not have the planned shape", (rows, plan.num_qo_heads, plan.head_dim), tuple(q.shape))
    if page_size != plan.page_size:
        bad(f"the cache's page size ({plan.kv_layout}: dimension {1 if plan.kv_layout == 'NHD' else 2} of a "
            f"4-D cache) is not the planned page_size; run() takes it from the cache", plan.page_size, page_size)
    if hkv != plan.num_kv_heads:
        bad("the cache's kv heads are not the planned num_kv_heads", plan.num_kv_heads, hkv)
    if d != plan.head_dim:
        bad("the cache's head_dim is not the planned head_dim", plan.head_dim, d)
    if plan.q_dtype is not None and q.dtype != plan.q_dtype:
        bad("q's dtype is not the planned q_data_type", str(plan.q_dtype), str(q.dtype))
    if plan.kv_dtype is not None and kc.dtype != plan.kv_dtype:
        bad("the cache's dtype is not the planned kv_data_type", str(plan.kv_dtype), str(kc.dtype))
    if kc.stride(-1) != 1 or vc.stride(-1) != 1:
        out.append(violation(Check.SHAPES, "the caches' last dimension must be contiguous", kernel=k,
                             expected="stride 1", found=f"{kc.stride(-1)}, {vc.stride(-1)}"))
    return out + check_page_ids(plan, pages)


def token_slots(plan: PagePlan, page_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each query row's own token is: ``(row_seq, page, offset)`` int64, one entry per query row
    (``qo_indptr`` order), row ``j`` of sequence ``i`` being position ``kv_len - qo_len + j`` (its page
    ``indices[indptr[i] + pos // page_size]``, offset ``pos % page_size``); rows of sequences whose lists are
    malformed get page -1."""
    ps = page_size or plan.page_size
    qo, kv = plan.qo_lens().clamp(min=0), plan.kv_lens()
    seq = torch.repeat_interleave(torch.arange(plan.batch_size), qo)
    starts = torch.cumsum(qo, 0) - qo
    j = torch.arange(int(qo.sum())) - starts[seq]
    pos = kv[seq] - qo[seq] + j
    ptr = plan.indptr.to(torch.int64)
    e = ptr[seq] + pos // ps
    ok = (pos >= 0) & (e >= ptr[seq]) & (e < ptr[seq + 1]) & (e >= 0) & (e < plan.indices.numel())
    page = torch.full_like(e, -1)
    page[ok] = plan.indices.to(torch.int64)[e[ok]]
    return seq, page, pos % ps


def check_current_tokens(plan: PagePlan, paged_kv_cache: Any, key: torch.Tensor, value: torch.Tensor,
                         k_scale: float | None = None, v_scale: float | None = None) -> list[Violation]:
    """With the call's new tokens handed over (``key``/``value`` ``[rows, Hkv, D]`` in qo_indptr order, as
    ``Guard.new_kv`` does for unified kernels): each row's token is in the pages where the lists put it,
    the last ``qo_len`` positions of its sequence (a decode's current token at slot ``last_page_len - 1`` of
    its last page). Compared bitwise with the token cast to the cache dtype (fp8 caches: ``(k / k_scale)``
    cast to it). Only rows whose page is in range are compared (the range check reports the others)."""
    k = plan.kernel
    kc, vc = unpack_paged_kv_cache(paged_kv_cache, plan.kv_layout)
    lay = FlashInferLayout(plan.kv_layout)
    pages, page_size, _, _ = lay.dims(kc)
    seq, page, off = token_slots(plan, page_size)
    key, value = _t(key), _t(value)
    if key is None or value is None or key.shape[0] != len(seq) or key.dim() != 3:
        found = None if key is None else tuple(key.shape)
        return [violation(Check.PREFILL_ROWS, "the new tokens handed to the guard must be [rows, Hkv, D], one row "
                                              "per query row", kernel=k, expected=f"{len(seq)} rows", found=found,
                          fix="hand kvfuzz_guard.new_kv(k, v) the k/v rows of this call's query tokens")]
    rows = torch.nonzero((page >= 0) & (page < pages)).flatten()
    if not len(rows):
        return []
    slots = page[rows] * page_size + off[rows]
    got_k, got_v = lay.gather(kc.detach(), vc.detach(), slots.to(kc.device))
    got_k, got_v = got_k.cpu(), got_v.cpu()

    def expect(x, scale):
        x = x[rows]
        if kc.element_size() == 1 and scale not in (None, 1.0):
            x = x.float() / float(scale)
        return x.to(kc.dtype)

    def ne(a, b):
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        else:
            a, b = a.view(torch.int16 if a.element_size() == 2 else torch.int32), \
                b.view(torch.int16 if b.element_size() == 2 else torch.int32)
        return (a != b).flatten(1).any(1)

    wrong = ne(got_k, expect(key, k_scale)) | ne(got_v, expect(value, v_scale))
    bad = rows[wrong].tolist()
    recs = []
    qo, kv = plan.qo_lens().clamp(min=0), plan.kv_lens()
    starts = (torch.cumsum(qo, 0) - qo).tolist()
    for r in bad[:8]:
        i = int(seq[r])
        pos = int(kv[i] - qo[i]) + r - starts[i]
        recs.append(violation(
            Check.UNIFIED, f"the pages do not hold query row {r}'s own key/value at the slot the page lists give "
                           f"it (page {int(page[r])}, offset {int(off[r])}; last_page_len "
                           f"{int(plan.last_page_len[i])})", kernel=k, seq=i, position=pos, block=int(page[r]),
            slot=int(page[r]) * page_size + int(off[r]), expected="the new token's k/v (kvfuzz_guard.new_kv)",
            found="other values", fix=_FIX_CURRENT, source="cache"))
    return capped(recs, len(bad))


# ---- append_paged_kv_cache -----------------------------------------------------------------------------
def check_append(append_key: Any, append_value: Any, batch_indices: Any, positions: Any, paged_kv_cache: Any,
                 kv_indices: Any, kv_indptr: Any, kv_last_page_len: Any, kv_layout: str = "NHD") -> list[Violation]:
    """``append_paged_kv_cache``'s arguments (flashinfer/page.py; csrc/page.cu): int32 index tensors; page
    lists as for attention (:func:`check_page_lists`) with page ids in range; ``append_key``/``append_value``
    ``[nnz, Hkv, D]`` of the cache's heads, head_dim and dtype; ``batch_indices``/``positions`` ``[nnz]``,
    each row's sequence in ``0 .. N-1`` and position in ``0 .. kv_len - 1`` (kv_len from the lists, which
    must already include the appended tokens)."""
    k = "flashinfer.append_paged_kv_cache"
    try:
        kc, vc = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    except ValueError as e:
        return [violation(Check.SHAPES, str(e), kernel=k)]
    lay = FlashInferLayout(kv_layout)
    if kc.dim() != 4:
        return [violation(Check.SHAPES, "the key/value caches must be 4-D", kernel=k, found=tuple(kc.shape))]
    pages, page_size, hkv, d = lay.dims(kc)
    plan = make_plan("append", kv_indptr, kv_indices, kv_last_page_len, hkv, hkv, d, page_size,
                     kv_layout=kv_layout)
    out = check_index_dtypes(plan, int32_only=True)
    if any(v.check is Check.SHAPES for v in out):
        return out
    bi, pos = _t(batch_indices), _t(positions)
    for name, t in (("batch_indices", bi), ("positions", pos)):
        if t is None:
            out.append(violation(Check.SHAPES, f"{name} is not a tensor", kernel=k))
        elif t.dtype != torch.int32:
            out.append(violation(Check.INDEX_DTYPE, f"{name} is {t.dtype}; csrc/page.cu reads it as int32",
                                 kernel=k, expected="torch.int32", found=str(t.dtype),
                                 fix="create batch_indices and positions as torch.int32 "
                                     "(flashinfer.get_batch_indices_positions does)"))
    if bi is None or pos is None:
        return out
    ak, av = append_key, append_value
    if not isinstance(ak, torch.Tensor) or not isinstance(av, torch.Tensor):
        return out + [violation(Check.SHAPES, "append_key and append_value must be tensors", kernel=k)]
    nnz = int(ak.shape[0]) if ak.dim() else 0
    if ak.dim() != 3 or tuple(ak.shape[1:]) != (hkv, d) or tuple(av.shape) != tuple(ak.shape):
        out.append(violation(Check.SHAPES, "append_key and append_value must be [nnz, num_kv_heads, head_dim] of "
                                           "the cache", kernel=k, expected=f"[nnz, {hkv}, {d}] each",
                             found=f"{tuple(ak.shape)} and {tuple(av.shape)}"))
    if ak.dtype != kc.dtype or av.dtype != vc.dtype:
        out.append(violation(Check.KV_CACHE_DTYPE, "append_key/append_value must have the cache's dtype (the kernel "
                                                   "reads them through the cache's element type)", kernel=k,
                             expected=str(kc.dtype), found=f"{ak.dtype}, {av.dtype}",
                             fix="cast the new k/v to the cache dtype first (for an fp8 cache: (k / k_scale)"
                                 ".to(cache.dtype))"))
    if bi.dim() != 1 or pos.dim() != 1 or bi.numel() != nnz or pos.numel() != nnz:
        out.append(violation(Check.SHAPES, "batch_indices and positions must be [nnz]", kernel=k, expected=nnz,
                             found=f"{tuple(bi.shape)}, {tuple(pos.shape)}"))
        return out
    pl = check_page_lists(plan)
    out += pl
    if any("batch_size + 1" in v.message or v.check is Check.SHAPES for v in pl):
        return out
    out += check_page_ids(plan, pages)
    n, kv = plan.batch_size, plan.kv_lens()
    b64, p64 = bi.to(torch.int64), pos.to(torch.int64)
    in_batch = (b64 >= 0) & (b64 < n)
    lim = torch.zeros_like(p64)
    lim[in_batch] = kv[b64[in_batch]]
    wrong = ~in_batch | (p64 < 0) | (p64 >= lim)
    bad = torch.nonzero(wrong).flatten().tolist()
    recs = [violation(Check.APPEND_POSITIONS,
                      f"row {r} appends to " + (f"sequence {int(b64[r])}, outside the batch of {n}" if not in_batch[r]
                                                else f"position {int(p64[r])} of sequence {int(b64[r])}, whose page "
                                                     f"lists hold kv_len {int(lim[r])} tokens"),
                      kernel=k, seq=int(b64[r]) if in_batch[r] else None, position=int(p64[r]),
                      expected="0 <= batch index < N and 0 <= position < kv_len",
                      found=f"({int(b64[r])}, {int(p64[r])})") for r in bad[:8]]
    return out + capped(recs, len(bad))


__all__ = ["FLASHINFER_INDEX_DTYPES", "PagePlan", "check_append", "check_current_tokens", "check_index_dtypes",
           "check_lengths", "check_page_ids", "check_page_lists", "check_plan", "check_run", "make_plan",
           "token_slots"]
