"""CSR page lists: how SGLang and FlashInfer tell a kernel where each sequence's tokens are, derived from the
block-table model (:class:`~kvfuzz.contracts.model.batch.Batch`), and back.

vLLM hands a kernel a per-sequence block table plus ``seq_lens``; SGLang's Triton attention
(sglang/kernels/ops/attention/{extend,decode}_attention.py in sglang 0.5.23, called by
sglang/srt/layers/attention/triton_backend.py) and FlashInfer take compressed sparse rows instead:

- ``kv_indptr`` ``[N + 1]``: sequence ``i``'s entries are ``kv_indices[kv_indptr[i] : kv_indptr[i + 1]]``, one
  per position read, in position order (the length is implied: ``kv_indptr[i + 1] - kv_indptr[i]``);
- ``kv_indices``: SGLang's are **token slots** of the pool ``k_buffer [slots, Hkv, D]`` at every ``page_size``
  (``page * page_size + offset``; its kernels split them back into page and offset: ``kv_loc // PAGE_SIZE``,
  ``kv_loc % PAGE_SIZE``); FlashInfer's paged lists hold **page ids** plus ``last_page_len [N]``
  (:func:`page_lists`);
- ``qo_indptr`` ``[N + 1]`` (extend): the new tokens' rows of ``q_extend``/``k_extend``/``v_extend`` =
  vLLM's ``query_start_loc``.

Which positions are listed is the contract: ``extend_attention_fwd`` lists the cached prefix (``ctx_len``
per sequence; triton_backend.py ``init_forward_metadata`` over ``extend_prefix_lens``), ``decode_attention_fwd``
all ``seq_len`` positions, the current token included (``_fill_kv_indptr_and_indices`` over ``seq_lens``).
A buffer may be longer than ``kv_indptr[-1]`` (SGLang's CUDA-graph buffers are allocated for the largest
batch): ``Batch.csr_tail`` holds such entries, which no kernel may read.

Everything here is pure (torch and attrs only).
"""

from __future__ import annotations

import attrs
import torch

from .batch import Batch, positions


@attrs.frozen(eq=False)
class CsrLists:
    """A batch's token-slot page lists, as SGLang's Triton kernels take them.

    kv_indptr: int64 ``[N + 1]``, ``kv_indptr[0] = 0``. kv_indices: int64 ``[kv_indptr[-1] + len(tail)]``,
    token slots (``block_table[i, p // BS] * BS + p % BS``) followed by the batch's ``csr_tail``.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor

    def tensors(self, device: str | torch.device = "cpu", indptr_dtype: torch.dtype = torch.int32,
                indices_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_indptr, kv_indices)`` on ``device``; default dtypes as SGLang's backend allocates them
        (triton_backend.py: ``kv_indptr`` int32, ``kv_indices`` int64)."""
        return self.kv_indptr.to(device=device, dtype=indptr_dtype), \
            self.kv_indices.to(device=device, dtype=indices_dtype)


def indptr(lens: tuple[int, ...] | list[int]) -> torch.Tensor:
    """int64 ``[N + 1]`` prefix sums of ``lens``, starting at 0 (``kv_indptr[1:] = cumsum(lens)``)."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.tensor(list(lens), dtype=torch.int64), 0)
    return out


def token_slot_lists(batch: Batch, lens: tuple[int, ...], tail: bool = True) -> CsrLists:
    """The CSR lists of positions ``0 .. lens[i]-1`` of every sequence ``i``, as SGLang's Triton kernels take
    them at every page_size: ``kv_indices`` = token slots, ``block_table[i, p // block_size] * block_size +
    p % block_size`` (sglang/srt/layers/attention/triton_backend.py ``_fill_kv_indptr_and_indices``; the
    paged allocator's slots are ``page * page_size + offset``), in sequence then position order, followed by
    ``batch.csr_tail`` when ``tail``. ``lens``: usually ``ctx_lens`` (extend, prefix contract) or ``seq_lens``
    (decode, unified contract). Raises ValueError if a length is outside ``0 .. seq_len``."""
    if len(lens) != batch.num_seqs:
        raise ValueError(f"lens has {len(lens)} entries for {batch.num_seqs} sequences")
    for i, (n, s) in enumerate(zip(lens, batch.seq_lens)):
        if not 0 <= n <= s:
            raise ValueError(f"lens[{i}] = {n} is outside 0..seq_len={s}")
    seq, pos = positions(lens)
    slots = batch.slots(seq, pos) if len(seq) else torch.zeros(0, dtype=torch.int64)
    if tail and batch.csr_tail:
        slots = torch.cat([slots, torch.tensor(batch.csr_tail, dtype=torch.int64)])
    return CsrLists(indptr(lens), slots)


@attrs.frozen(eq=False)
class PageLists:
    """FlashInfer-style page-level lists (flashinfer ``BatchDecodeWithPagedKVCacheWrapper.plan`` /
    ``BatchPrefillWithPagedKVCacheWrapper.plan``: ``paged_kv_indptr``, ``paged_kv_indices``,
    ``paged_kv_last_page_len``).

    page_indptr: int64 ``[N + 1]``, pages per sequence ``ceil(len / page_size)`` summed. page_indices: int64,
    the block ids of those pages in order. last_page_len: int64 ``[N]``, tokens in each sequence's last page
    (``1 .. page_size``; 0 for a sequence with no tokens).
    """

    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_len: torch.Tensor


def page_lists(batch: Batch, lens: tuple[int, ...]) -> PageLists:
    """The page-level CSR lists of positions ``0 .. lens[i]-1`` of every sequence (page size =
    ``batch.block_size``, page ids = the block table's): the first ``ceil(lens[i] / page_size)`` block ids of
    each row, and the last page's length ``lens[i] - (pages - 1) * page_size``. Token ``p`` of sequence ``i``
    is then at page ``page_indices[page_indptr[i] + p // page_size]``, offset ``p % page_size``: the same
    slot as :func:`token_slot_lists` (tests/contracts/test_csr.py checks it)."""
    bs = batch.block_size
    pages = [-(-n // bs) for n in lens]
    ids = [b for i, n in enumerate(pages) for b in batch.block_table[i][:n]]
    last = [n - (p - 1) * bs if p else 0 for n, p in zip(lens, pages)]
    return PageLists(indptr(pages), torch.tensor(ids, dtype=torch.int64),
                     torch.tensor(last, dtype=torch.int64))


@attrs.frozen(eq=False)
class TokenTable:
    """CSR lists read back as a token-level table (what the runtime guard checks against).

    table: int64 ``[N, max(lens)]``, row ``i`` = sequence ``i``'s entries (0 past its length). lens: int64
    ``[N]``, ``kv_indptr[i + 1] - kv_indptr[i]`` clamped to 0. starts: int64 ``[N]``, ``kv_indptr[:-1]``.
    within: bool ``[N]``, whether sequence ``i``'s range ``kv_indptr[i] .. kv_indptr[i + 1]`` is inside
    ``kv_indices`` and does not run backwards (only such rows are filled).
    """

    table: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    within: torch.Tensor


def token_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> TokenTable:
    """Sequence ``i``'s entries ``kv_indices[kv_indptr[i] : kv_indptr[i + 1]]`` as row ``i`` of a table
    (int64 CPU inputs, 1-D). Never raises on a malformed ``kv_indptr``: rows whose range is outside
    ``kv_indices`` or decreasing are left empty and marked in ``within``."""
    ptr = kv_indptr.to(torch.int64)
    starts, ends = ptr[:-1], ptr[1:]
    lens = (ends - starts).clamp(min=0)
    within = (starts >= 0) & (ends >= starts) & (ends <= len(kv_indices))
    width = int(torch.where(within, lens, torch.zeros_like(lens)).max()) if len(lens) else 0
    table = torch.zeros((len(lens), width), dtype=torch.int64)
    if width:
        cols = torch.arange(width)
        take = within[:, None] & (cols[None, :] < lens[:, None])
        idx = (starts[:, None] + cols[None, :]).clamp(0, max(len(kv_indices) - 1, 0))
        if len(kv_indices):
            table = torch.where(take, kv_indices.to(torch.int64)[idx], table)
    return TokenTable(table, lens, starts, within)


__all__ = ["CsrLists", "PageLists", "TokenTable", "indptr", "page_lists", "token_slot_lists", "token_table"]
