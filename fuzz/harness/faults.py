"""Caller faults: deliberate breaks of a kernel's contract in kvfuzz's own harness, each modeled on a real
caller bug (docs/contracts.md: the seeds' story and the bug classes).

A fault changes what the harness writes into the cache (``cached_lens``) or the call's arguments after they
are built (``mutate_call``). kvfuzz must then report a caller contract violation, never a kernel bug, and
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

    def applies(self, batch: Batch, kwargs: dict | None = None) -> bool:
        """Whether this fault breaks anything for ``batch`` (and a call with ``kwargs``)."""
        if batch.num_seqs < self.needs_seqs or (self.needs_decode and not batch.decode_seqs):
            return False
        if self.name == "query-start-loc-mismatch" and batch.query_lens[0] < 2:
            return False  # moving the boundary past a 1-token sequence would empty it
        lens = _csr_lens(kwargs)
        if lens is not None and self.csr is not None and not self.csr(lens, kwargs):
            return False
        return self.needs_kwarg is None or kwargs is None or self.needs_kwarg in kwargs

    def supports(self, kwargs: dict) -> bool:
        return self.needs_kwarg is None or self.needs_kwarg in kwargs


FAULTS: dict[str, CallerFault] = {
    f.name: f
    for f in [
        CallerFault(
            "decode-ctx-only",
            "fill decode sequences only up to ctx_len, leaving the current token out of the cache, as "
            "vLLM's tests/kernels/attention/test_prefix_prefill.py did (docs/contracts.md, the seeds)",
            cached_lens=_decode_ctx_only, needs_decode=True,
        ),
        CallerFault("int64-index", "block_table, seq_lens and query_start_loc as int64 (torch.long); the ROCm "
                    "kernel reads them as int32 (the seeds, FlashInfer issue 1654, vllm issue 28490)",
                    mutate_call=_int64_index),
        CallerFault("max-seq-len-too-small", "max_seq_len = the longest context, not the longest sequence "
                    "(the seeds: MAX_CTX_LEN passed while a decode reached ctx_len + 1)",
                    mutate_call=_max_seq_len_too_small, needs_kwarg="max_seq_len"),
        CallerFault("block-out-of-range", "a block id equal to num_blocks in a column the kernel reads (an "
                    "allocator off by one; docs/contracts.md bug classes 1, 2, 5); CSR: a kv_indices entry equal "
                    "to the pool's slot count", mutate_call=_block_out_of_range,
                    csr=lambda lens, kw: any(lens)),
        CallerFault("shared-block", "two sequences' tables name one physical block for positions both write "
                    "(a double-allocated block); CSR decode: two current tokens given one slot",
                    mutate_call=_shared_block, needs_seqs=2,
                    csr=lambda lens, kw: "attn_logits" in kw and lens[0] > 0 and lens[1] > 0),
        CallerFault("query-start-loc-mismatch", "query_start_loc (CSR: qo_indptr) shifted by one token at a "
                    "sequence boundary (built from the wrong lengths; cf. vllm PR 28905)",
                    mutate_call=_query_start_loc_mismatch, needs_seqs=2, csr=lambda lens, kw: "qo_indptr" in kw),
        CallerFault("kv-indptr-off-by-one", "CSR: one interior kv_indptr entry moved by one, so two sequences "
                    "trade a slot (lengths summed from the wrong list)", mutate_call=_kv_indptr_off_by_one,
                    needs_seqs=2, needs_kwarg="kv_indptr",
                    csr=lambda lens, kw: any(lens[i - 1] or lens[i] for i in range(1, len(lens)))),
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
