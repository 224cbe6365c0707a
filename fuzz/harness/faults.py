"""Caller faults: deliberate breaks of a kernel's contract in kvfuzz's own harness, each modeled on a real
caller bug (docs/contracts.md: the seeds' story and the bug classes).

A fault changes what the harness writes into the cache (``cached_lens``) or the call's arguments after they
are built (``mutate_call``; for FlashInfer's page lists, whose ``kv_indptr`` counts pages and which carry
``kv_last_page_len``, ``pages``). kvfuzz must then report a caller contract violation, never a kernel bug, and
still show what the kernel computed from the broken call. A fault that cannot apply to an example (a
two-sequence fault on a one-sequence batch, a max_seq_len fault on a kernel without that argument) leaves it
alone; ``applies`` says which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs

if TYPE_CHECKING:  # torch is imported where a fault mutates a call: the CLI lists fault names without it
    from kvfuzz.contracts.model.batch import Batch


def _required(batch: Batch, required: tuple[int, ...]) -> tuple[int, ...]:
    return required


def _decode_ctx_only(batch: Batch, required: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(batch.ctx_lens[i] if batch.is_decode(i) else n for i, n in enumerate(required))


def _no_mutation(batch, data, cache, call) -> None:
    return None


def _page_lists_only(batch, data, cache, call) -> None:
    """The ``mutate_call`` of a fault that only page-list calls have (:attr:`CallerFault.pages` does it)."""
    return None


def _int64_index(batch, data, cache, call) -> None:
    """The seeds' first bug: index tensors built with dtype=torch.long (vllm-project test_prefix_prefill)."""
    import torch

    for name in ("block_table", "seq_lens", "query_start_loc", "b_loc", "b_seq_len", "b_start_loc"):
        t = call.kwargs.get(name)
        if isinstance(t, torch.Tensor):
            call.kwargs[name] = t.to(torch.int64)


def _max_seq_len_too_small(batch, data, cache, call) -> None:
    """The seeds' test passed MAX_CTX_LEN as max_seq_len although its decode sequence reached one more."""
    call.kwargs["max_seq_len"] = max(batch.ctx_lens)


def _csr_lens(kwargs: dict | None) -> list[int] | None:
    """Per sequence, how many kv_indices entries a CSR call lists (None: not a CSR call, or unknown)."""
    ptr = None if kwargs is None else kwargs.get("kv_indptr")
    if ptr is None:
        return None
    p = ptr.tolist()
    return [b - a for a, b in zip(p[:-1], p[1:])]


def _block_out_of_range(batch, data, cache, call) -> None:
    """A block table entry one past the cache (an off-by-one in a block allocator): the last block the
    longest sequence reads. CSR calls: the last kv_indices entry of the sequence listing the most, set to the
    pool's size (``k_buffer.shape[0]``)."""
    lens = _csr_lens(call.kwargs)
    if lens is not None:
        seq = max(range(len(lens)), key=lambda i: lens[i])
        call.kwargs["kv_indices"][int(call.kwargs["kv_indptr"][seq + 1]) - 1] = call.kwargs["k_buffer"].shape[0]
        return
    seq = max(range(batch.num_seqs), key=lambda i: batch.seq_lens[i])
    table = call.kwargs["block_table"]
    table[seq, batch.blocks_needed(seq) - 1] = batch.num_blocks


def _kv_indptr_off_by_one(batch, data, cache, call) -> None:
    """One interior kv_indptr entry moved by one (lengths summed from the wrong list, e.g. a prefix length
    counted without the current token): at the first boundary ``i`` whose sequence ``i-1`` lists a slot,
    ``kv_indptr[i] -= 1`` (sequence ``i-1`` loses its last entry, sequence ``i`` reads it as its first); where
    none does, ``kv_indptr[i] += 1`` at the first boundary whose sequence ``i`` lists one."""
    lens = _csr_lens(call.kwargs)
    ptr = call.kwargs["kv_indptr"]
    i = next((i for i in range(1, len(lens)) if lens[i - 1] > 0), None)
    if i is not None:
        ptr[i] -= 1
        return
    i = next(i for i in range(1, len(lens)) if lens[i] > 0)
    ptr[i] += 1


def _shared_block(batch, data, cache, call) -> None:
    """Two sequences' tables name one physical block for positions they both write (a double-allocated
    block): the second sequence's tokens overwrite the first's, as reshape_and_cache would with that table.
    CSR decode calls: sequence 1's current token gets sequence 0's current slot, and is written there."""
    import torch

    a, b = 0, 1
    if _csr_lens(call.kwargs) is not None:
        ptr, idx = call.kwargs["kv_indptr"], call.kwargs["kv_indices"]
        slot = idx[int(ptr[a + 1]) - 1].clone()
        idx[int(ptr[b + 1]) - 1] = slot
        rows = data.token_rows(batch, torch.tensor([b]), torch.tensor([batch.seq_lens[b] - 1]))
        dev = cache.key_cache.device
        cache.layout.write(cache.key_cache, cache.value_cache, slot.reshape(1).to(dev),
                           data.cache_keys[rows].to(dev), data.cache_values[rows].to(dev))
        return
    table = call.kwargs["block_table"]
    blk_a = batch.block_table[a][batch.blocks_needed(a) - 1]
    col_b = batch.blocks_needed(b) - 1
    table[b, col_b] = blk_a
    # re-write b's positions in that block through the faulty table
    bs = batch.block_size
    start = col_b * bs
    pos = torch.arange(start, min(batch.seq_lens[b], start + bs))
    if len(pos):
        seq = torch.full_like(pos, b)
        rows = data.token_rows(batch, seq, pos)
        slots = blk_a * bs + pos % bs
        dev = cache.key_cache.device
        cache.layout.write(cache.key_cache, cache.value_cache, slots.to(dev), data.cache_keys[rows].to(dev),
                           data.cache_values[rows].to(dev))


def _query_start_loc_mismatch(batch, data, cache, call) -> None:
    """query_start_loc that does not match the query tokens: one sequence's start moved by one (a cumsum
    built from the wrong lengths), so two sequences exchange a token."""
    import torch

    for name in ("query_start_loc", "b_start_loc", "qo_indptr"):
        t = call.kwargs.get(name)
        if isinstance(t, torch.Tensor):
            t[1] += 1


#: FlashInfer's page-list arguments, ``(kv_indptr, kv_indices, kv_last_page_len)`` as each call names them:
#: BatchDecodeWithPagedKVCacheWrapper.plan (flashinfer/decode.py), BatchPrefillWithPagedKVCacheWrapper.plan
#: (flashinfer/prefill.py), append_paged_kv_cache (flashinfer/page.py). A call holding one of the last-page
#: arguments is a page-list call: its lists count pages (page ids, not token slots) and the faults break them
#: through :attr:`CallerFault.pages`.
PAGE_LIST_NAMES = (("indptr", "indices", "last_page_len"),
                   ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
                   ("kv_indptr", "kv_indices", "kv_last_page_len"))


def page_list_names(kwargs: dict | None) -> tuple[str, str, str] | None:
    """The names of a page-list call's ``(kv_indptr, kv_indices, kv_last_page_len)`` arguments (see
    :data:`PAGE_LIST_NAMES`), None for any other call."""
    if kwargs is None:
        return None
    return next((names for names in PAGE_LIST_NAMES if names[2] in kwargs), None)


def _pages(kwargs: dict) -> list[int]:
    """Pages per sequence of a page-list call (its kv_indptr's differences)."""
    p = kwargs[page_list_names(kwargs)[0]].tolist()
    return [b - a for a, b in zip(p[:-1], p[1:])]


def _pages_int64(batch, data, cache, call) -> None:
    """int64-index on a page-list call: every index tensor as torch.long (FlashInfer's wrappers compile a module
    for ``indptr.dtype``, so all-int64 lists are legal there; append_paged_kv_cache reads int32 only)."""
    import torch

    for name in (*page_list_names(call.kwargs), "qo_indptr", "batch_indices", "positions"):
        t = call.kwargs.get(name)
        if isinstance(t, torch.Tensor):
            call.kwargs[name] = t.to(torch.int64)


def _page_out_of_range(batch, data, cache, call) -> None:
    """block-out-of-range on a page-list call: the last page id of the sequence with the most pages set to the
    cache's page count (``paged_kv_cache.shape[0]``)."""
    ptr, idx, _ = page_list_names(call.kwargs)
    pages = _pages(call.kwargs)
    seq = max(range(len(pages)), key=lambda i: pages[i])
    call.kwargs[idx][int(call.kwargs[ptr][seq + 1]) - 1] = call.key_cache.shape[0]


def _page_indptr_off_by_one(batch, data, cache, call) -> None:
    """kv-indptr-off-by-one on a page-list call: one interior kv_indptr entry moved by one page (as
    :func:`_kv_indptr_off_by_one` moves a slot)."""
    ptr = call.kwargs[page_list_names(call.kwargs)[0]]
    pages = _pages(call.kwargs)
    i = next((i for i in range(1, len(pages)) if pages[i - 1] > 0), None)
    if i is not None:
        ptr[i] -= 1
        return
    ptr[next(i for i in range(1, len(pages)) if pages[i] > 0)] += 1


def _last_page_len_off_by_one(batch, data, cache, call) -> None:
    """kv_last_page_len one short for the first sequence with pages (its length counted without the token just
    appended): FlashInfer's get_seq_lens then leaves that token out; a last page of one token becomes 0, out of
    the 1..page_size range."""
    last = call.kwargs[page_list_names(call.kwargs)[2]]
    i = next(i for i, p in enumerate(_pages(call.kwargs)) if p > 0)
    last[i] -= 1


@attrs.frozen
class PageListFault:
    """How a fault breaks a page-list call: ``applies(pages per sequence, kwargs)`` whether it can, ``mutate``
    (as :attr:`CallerFault.mutate_call`) doing it."""

    applies: Callable[[list[int], dict], bool]
    mutate: Callable = _no_mutation


@attrs.frozen
class CallerFault:
    """name: the --caller-fault value. description: the real bug it models. cached_lens: what the faulty
    caller writes into the cache instead of what the contract requires. mutate_call: how it breaks the built
    call (in place). needs_seqs: fewest sequences it needs; needs_kwarg: an argument the kernel must take."""

    name: str
    description: str
    cached_lens: Callable[[Batch, tuple[int, ...]], tuple[int, ...]] = _required
    mutate_call: Callable = _no_mutation
    needs_seqs: int = 1
    needs_kwarg: str | None = None
    needs_decode: bool = False
    #: what the fault needs of a CSR call (``kv_indptr`` in kwargs): given the entries each sequence lists
    #: (and the kwargs), whether it can break it; None: the fault does not apply to CSR calls
    csr: Callable[[list[int], dict], bool] | None = None
    #: how it breaks a page-list call (FlashInfer: :func:`page_list_names`); None: it does not apply to one
    pages: PageListFault | None = None

    def applies(self, batch: Batch, kwargs: dict | None = None) -> bool:
        """Whether this fault breaks anything for ``batch`` (and a call with ``kwargs``)."""
        if batch.num_seqs < self.needs_seqs or (self.needs_decode and not batch.decode_seqs):
            return False
        if self.name == "query-start-loc-mismatch" and batch.query_lens[0] < 2:
            return False  # moving the boundary past a 1-token sequence would empty it
        if page_list_names(kwargs) is not None:
            return self.pages is not None and self.pages.applies(_pages(kwargs), kwargs)
        if self.mutate_call is _page_lists_only:
            return kwargs is None  # a fault of page lists alone: nothing to break in any other call
        lens = _csr_lens(kwargs)
        if lens is not None and self.csr is not None and not self.csr(lens, kwargs):
            return False
        return self.needs_kwarg is None or kwargs is None or self.needs_kwarg in kwargs

    def mutate(self, batch: Batch, data, cache, call) -> None:
        """Break ``call`` in place: through :attr:`pages` for a page-list call, :attr:`mutate_call` otherwise."""
        if page_list_names(call.kwargs) is not None:
            if self.pages is not None:
                self.pages.mutate(batch, data, cache, call)
            return
        self.mutate_call(batch, data, cache, call)


FAULTS: dict[str, CallerFault] = {
    f.name: f
    for f in [
        CallerFault(
            "decode-ctx-only",
            "fill decode sequences only up to ctx_len, leaving the current token out of the cache, as "
            "vLLM's tests/kernels/attention/test_prefix_prefill.py did (docs/contracts.md, the seeds)",
            cached_lens=_decode_ctx_only, needs_decode=True, pages=PageListFault(lambda pages, kw: True),
        ),
        CallerFault("int64-index", "block_table, seq_lens and query_start_loc as int64 (torch.long); the ROCm "
                    "kernel reads them as int32 (the seeds, FlashInfer issue 1654, vllm issue 28490)",
                    mutate_call=_int64_index, pages=PageListFault(lambda pages, kw: True, _pages_int64)),
        CallerFault("max-seq-len-too-small", "max_seq_len = the longest context, not the longest sequence "
                    "(the seeds: MAX_CTX_LEN passed while a decode reached ctx_len + 1)",
                    mutate_call=_max_seq_len_too_small, needs_kwarg="max_seq_len"),
        CallerFault("block-out-of-range", "a block id equal to num_blocks in a column the kernel reads (an "
                    "allocator off by one; docs/contracts.md bug classes 1, 2, 5); CSR: a kv_indices entry equal "
                    "to the pool's slot count; page lists: a page id equal to the cache's page count",
                    mutate_call=_block_out_of_range, csr=lambda lens, kw: any(lens),
                    pages=PageListFault(lambda pages, kw: any(pages), _page_out_of_range)),
        CallerFault("shared-block", "two sequences' tables name one physical block for positions both write "
                    "(a double-allocated block); CSR decode: two current tokens given one slot",
                    mutate_call=_shared_block, needs_seqs=2,
                    csr=lambda lens, kw: "attn_logits" in kw and lens[0] > 0 and lens[1] > 0),
        CallerFault("query-start-loc-mismatch", "query_start_loc (CSR: qo_indptr) shifted by one token at a "
                    "sequence boundary (built from the wrong lengths; cf. vllm PR 28905)",
                    mutate_call=_query_start_loc_mismatch, needs_seqs=2, csr=lambda lens, kw: "qo_indptr" in kw,
                    pages=PageListFault(lambda pages, kw: "qo_indptr" in kw, _query_start_loc_mismatch)),
        CallerFault("kv-indptr-off-by-one", "CSR: one interior kv_indptr entry moved by one, so two sequences "
                    "trade a slot (lengths summed from the wrong list)", mutate_call=_kv_indptr_off_by_one,
                    needs_seqs=2, needs_kwarg="kv_indptr",
                    csr=lambda lens, kw: any(lens[i - 1] or lens[i] for i in range(1, len(lens))),
                    pages=PageListFault(lambda p, kw: any(p[i - 1] or p[i] for i in range(1, len(p))),
                                        _page_indptr_off_by_one)),
        CallerFault("last-page-len-off-by-one", "FlashInfer page lists: one sequence's kv_last_page_len one short "
                    "(its length counted without the token just appended), so the kernel leaves that token out, "
                    "or gets 0 for a last page of one token", mutate_call=_page_lists_only,
                    pages=PageListFault(lambda pages, kw: any(pages), _last_page_len_off_by_one)),
    ]
}


#: The --caller-fault values.
FAULT_NAMES = tuple(FAULTS)


def get_fault(name: str) -> CallerFault:
    """Raises KeyError naming the known faults."""
    try:
        return FAULTS[name]
    except KeyError:
        raise KeyError(f"unknown caller fault {name!r}; known: {', '.join(FAULTS)}") from None


__all__ = ["FAULTS", "FAULT_NAMES", "PAGE_LIST_NAMES", "CallerFault", "PageListFault", "get_fault", "page_list_names"]
