"""What FlashInfer's pages must hold when a call reads them, and what ``append_paged_kv_cache`` writes: the
current tokens at the slots the page lists give them (the unified invariant in FlashInfer's form: a decode's
current token at slot ``last_page_len - 1`` of its last page), and an append call's arguments against its page
lists. Pure functions, as :mod:`kvfuzz.contracts.calls.page_lists` (the plan and run checks; its module docstring
gives the FlashInfer sources: flashinfer/page.py ``append_paged_kv_cache``, ``get_seq_lens``; csrc/page.cu).
"""

from __future__ import annotations

from typing import Any

import torch

from ..caches.flashinfer_layouts import FlashInferLayout, unpack_paged_kv_cache
from ..checks.violations import Check, Violation, capped, violation
from .page_lists import (
    FIX_CURRENT,
    PagePlan,
    check_index_dtypes,
    check_page_ids,
    check_page_lists,
    host_tensor,
    make_plan,
)


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
    key, value = host_tensor(key), host_tensor(value)
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
            found="other values", fix=FIX_CURRENT, source="cache"))
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
    bi, pos = host_tensor(batch_indices), host_tensor(positions)
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


__all__ = ["check_append", "check_current_tokens", "token_slots"]
