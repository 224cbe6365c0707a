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


__all__ = ["check_block_table"]
