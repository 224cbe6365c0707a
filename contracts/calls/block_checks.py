"""The block table against what the kernel reads (a check of one real call's arguments; see
:mod:`kvfuzz.contracts.calls.call_checks`): every column read exists and names a block of the cache, and no two
sequences write one block (an error for a kernel that writes the cache, a realism warning for one that only
reads it: the declaration's ``writes_cache``).

Source: the block-table addressing of vLLM 0.33.0's kernels (``block_table[i, p // block_size]``;
vllm/v1/attention/ops/chunked_prefill_paged_decode.py, prefix_prefill.py, triton_unified_attention.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks.violations import MAX_RECORDS_PER_CHECK, Category, Check, Severity, Violation, capped, violation
from .paged_call import Lens, PagedCall, index_values


def check_block_table(call: PagedCall, lens: Lens) -> tuple[list[Violation], torch.Tensor]:
    """Every block the kernel reads (columns ``< ceil(seq_len / block_size)``) exists in the table and lies in
    ``[0, num_blocks)``; no two sequences write their new tokens (positions ``ctx_len .. seq_len-1``) into one
    block. Returns the violations and a bool ``[N]`` mask of sequences whose blocks are all readable (the cache
    checks use only those). The index arithmetic runs in numpy on the host copy of the table (a few small arrays:
    a torch operator costs microseconds of dispatch, each example of a campaign pays it).

    Source: every kernel reads ``block_table[seq, pos // block_size]`` for ``pos < seq_len`` (docs/contracts.md §1)
    with no bounds check; vllm/v1/core/kv_cache_manager.py never hands one block to two writers.
    """
    k, out = call.kernel, []
    n = len(lens.seq_lens)
    if call.skip_blocks:
        return out, torch.ones(n, dtype=torch.bool)
    bt_t = index_values(call.block_table)
    if bt_t is None or bt_t.dim() != 2:
        return out, torch.zeros(n, dtype=torch.bool)
    bt = bt_t[:n].numpy()
    seq_lens, ctx_lens, query_lens = (x.numpy() for x in (lens.seq_lens, lens.ctx_lens, lens.query_lens))
    bs, nb = call.block_size, call.num_blocks
    need = (np.maximum(seq_lens, 0) + bs - 1) // bs
    m = bt.shape[1]
    narrow = np.flatnonzero(need > m)
    for i in narrow[:MAX_RECORDS_PER_CHECK].tolist():
        out.append(violation(Check.BLOCK_TABLE_WIDTH,
            f"{call.name('block_table')} has {m} columns but sequence {i} (seq_len {int(seq_lens[i])}, "
            f"block_size {bs}) needs {int(need[i])}: the kernel reads past the row", kernel=k, seq=i,
            position=int(seq_lens[i]) - 1, expected=f">= {int(need[i])} columns", found=f"{m} columns"))
    out = capped(out, len(narrow))
    cols = np.arange(m)
    read = cols[None, :] < need[:, None]  # [N, M]
    oob = read & ((bt < 0) | (bt >= nb))
    oob_seq = oob.any(axis=1)
    bad_seqs = np.flatnonzero(oob_seq)
    recs = []
    for i in bad_seqs[:MAX_RECORDS_PER_CHECK].tolist():
        c = int(np.flatnonzero(oob[i])[0])
        blk = int(bt[i, c])
        recs.append(violation(Check.BLOCK_RANGE,
            f"{call.name('block_table')}[{i}, {c}] = {blk} is outside the cache's {nb} blocks; the kernel reads "
            f"it for positions {c * bs}..{min((c + 1) * bs, int(seq_lens[i])) - 1}", kernel=k, seq=i, position=c * bs,
            block=blk, expected=f"0 <= id < {nb}", found=blk, count=int(oob[i].sum())))
    out += capped(recs, len(bad_seqs))
    ok = torch.from_numpy((need <= m) & ~oob_seq)
    # write-write sharing: columns holding new tokens
    first_new = np.maximum(ctx_lens, 0) // bs
    write = read & (cols[None, :] >= first_new[:, None]) & (query_lens > 0)[:, None]
    w_seq, w_blk = np.nonzero(write)[0], bt[write]  # row-major: the same order as the table's cells
    if len(w_blk):
        pairs = np.unique(w_blk * n + w_seq)  # distinct (block, seq), sorted by block
        pblk, pseq = pairs // n, pairs % n
        blocks, counts = np.unique(pblk, return_counts=True)
        shared = blocks[counts > 1]
        recs = []
        writes = call.declaration.writes_cache
        for blk in shared[:MAX_RECORDS_PER_CHECK].tolist():
            seqs = pseq[pblk == blk].tolist()
            if writes:
                story = f"block {blk} receives new tokens of sequences {seqs}: each write clobbers the others' tokens"
            else:
                story = (f"block {blk} holds new-token positions of sequences {seqs}, a state a serving engine never "
                         f"creates (vLLM shares only full prefix blocks, which nobody writes); {k} writes nothing, "
                         f"so it reads what the cache holds, as a reference reading through the same table does")
            recs.append(violation(Check.BLOCK_SHARING, story, kernel=k, seq=seqs[1], block=blk,
                                  expected="one writing sequence per block", found=f"{len(seqs)} sequences",
                                  count=len(seqs), severity=Severity.ERROR if writes else Severity.WARNING,
                                  category=None if writes else Category.REALISM))
        out += capped(recs, len(shared))
    return out, ok


def check_null_block(call: PagedCall, lens: Lens) -> list[Violation]:
    """With a sliding window and a known null block (``call.null_block``, ``call.sliding_window`` W): no column a
    query of the call can see points at the null block. Sequence ``i``'s first query sits at ``ctx_len`` and sees
    keys from ``max(0, ctx_len - W + 1)`` on, so columns from ``max(0, ctx_len - W + 1) // block_size`` to
    ``ceil(seq_len / block_size) - 1`` must hold live blocks; the columns before may point at the null block
    (they are what vLLM frees). One error per offending sequence, at its first such column; [] when the null
    block or the window is not known.

    Source: vllm/v1/core/single_type_kv_cache_manager.py, ``SlidingWindowManager.get_num_skipped_tokens``
    (``num_computed_tokens - sliding_window + 1``) and ``SingleTypeKVCacheManager.remove_skipped_blocks`` (the
    ``num_skipped_tokens // block_size`` leading blocks become ``null_block``); vllm/v1/core/block_pool.py (the null
    block is block 0, never allocated: whatever it holds is garbage to a reader).
    """
    if call.null_block is None or call.sliding_window <= 0 or call.skip_blocks:
        return []
    bt_t = index_values(call.block_table)
    if bt_t is None or bt_t.dim() != 2:
        return []
    n = len(lens.seq_lens)
    bt = bt_t[:n].numpy()
    seq_lens, ctx_lens = lens.seq_lens.numpy(), lens.ctx_lens.numpy()
    bs, w, m = call.block_size, call.sliding_window, bt.shape[1]
    need = np.minimum((np.maximum(seq_lens, 0) + bs - 1) // bs, m)
    first = np.maximum(ctx_lens - w + 1, 0) // bs
    cols = np.arange(m)
    bad = (cols[None, :] >= first[:, None]) & (cols[None, :] < need[:, None]) & (bt == call.null_block)
    bad_seqs = np.flatnonzero(bad.any(axis=1))
    recs = []
    for i in bad_seqs[:MAX_RECORDS_PER_CHECK].tolist():
        c = int(np.flatnonzero(bad[i])[0])
        recs.append(violation(Check.NULL_BLOCK,
            f"{call.name('block_table')}[{i}, {c}] = {call.null_block} is the null block (what freed window columns "
            f"point at), but sequence {i}'s queries see positions {c * bs}..{(c + 1) * bs - 1} of it (window {w}, "
            f"first visible key {max(int(ctx_lens[i]) - w + 1, 0)}): the kernel reads garbage there",
            kernel=call.kernel, seq=i, position=c * bs, block=call.null_block, expected="a live block",
            found=f"null block {call.null_block}", count=int(bad[i].sum())))
    return capped(recs, len(bad_seqs))


__all__ = ["check_block_table", "check_null_block"]
