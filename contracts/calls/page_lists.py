"""The runtime guard's checks of FlashInfer's paged calls, whose caller contract is split between a wrapper's
``plan()`` (the page lists, heads, head_dim, page_size, dtypes) and its ``run()`` (q and the cache), plus
``append_paged_kv_cache`` (the cache writer). Pure functions over tensors (moved to the CPU), each returning
:class:`~kvfuzz.contracts.checks.violations.Violation` records; the flashinfer family
(``kvfuzz.fuzz.targets.flashinfer``) runs them on a call, and ``kvfuzz.fuzz.guard.flashinfer`` wires them to the
wrapper classes.

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

FIX_CURRENT = ("append the new tokens to the pages before attention (flashinfer.append_paged_kv_cache with "
                "batch_indices/positions from get_batch_indices_positions, as vLLM's and SGLang's FlashInfer "
                "backends do): the kernel reads all kv_len = (pages - 1) * page_size + last_page_len tokens of "
                "every sequence from the pages, its current tokens in the last slots")


def host_tensor(x: Any) -> torch.Tensor | None:
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
    return PagePlan(kind, host_tensor(indptr), host_tensor(indices), host_tensor(last_page_len),
                    int(num_qo_heads), int(num_kv_heads), int(head_dim), int(page_size), host_tensor(qo_indptr),
                    q_dt, dt(kv_data_type) or q_dt, kv_layout,
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
                      fix=FIX_CURRENT) for i in short[:8]]
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


__all__ = ["FIX_CURRENT", "FLASHINFER_INDEX_DTYPES", "PagePlan", "check_index_dtypes", "check_lengths",
           "check_page_ids", "check_page_lists", "check_plan", "check_run", "host_tensor", "make_plan"]
