"""The "freed window blocks" production state: a sliding-window KV manager gives back the blocks wholly before each
sequence's window and points their block-table columns at the **null block** (:data:`NULL_BLOCK`, block 0), as
vLLM's ``SlidingWindowManager`` does (vllm/v1/core/single_type_kv_cache_manager.py: ``get_num_skipped_tokens
(num_computed_tokens) = num_computed_tokens - sliding_window + 1``, ``remove_skipped_blocks`` frees the
``num_skipped_tokens // block_size`` leading blocks and puts ``null_block`` in their place; vLLM's ``BlockPool``
pops block 0 as ``null_block`` and never hands it to a request, vllm/v1/core/block_pool.py).

The state's home: the model of one batch in it (:func:`freed_blocks`, :func:`held_mask`, :func:`check_column`,
which :class:`~kvfuzz.contracts.model.batch.Batch` calls when ``Batch.freed_window_blocks`` is set) and its
declaration (:data:`STATE`, ``Capabilities.freed_window_blocks``, registered in
:data:`kvfuzz.contracts.model.states.PRODUCTION_STATES`). Its draw is
:func:`kvfuzz.strategies.states.freed_window_table`; the freed positions are not in the cache (the materializer
writes poison there), and the caller check that they point at the null block is
:func:`kvfuzz.contracts.calls.block_checks.check_null_block`. Nothing here imports ``Batch`` (it imports this).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .state import State

#: The block a freed column points at: vLLM's ``BlockPool.null_block``, the first block of the free queue (id 0),
#: popped at start-up and never allocated (vllm/v1/core/block_pool.py, BlockPool.__init__).
NULL_BLOCK = 0


def freed_blocks(batch: Any, seq: int) -> int:
    """How many leading columns of sequence ``seq`` are freed to the null block: ``max(0, ctx_len - W + 1) //
    block_size`` with ``batch.freed_window_blocks``, else 0 (vLLM's ``SlidingWindowManager.remove_skipped_blocks``
    with ``num_computed_tokens = ctx_len``: ``get_num_skipped_tokens(ctx_len) = ctx_len - W + 1`` tokens no query
    of this step sees, the blocks wholly among them freed)."""
    if not batch.freed_window_blocks:
        return 0
    return max(0, batch.ctx_lens[seq] - batch.sliding_window + 1) // batch.block_size


def held_mask(batch: Any, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """bool, the shape of ``seq``/``pos`` (int64 sequence and position of each entry): whether the cache holds
    the position, i.e. it is not in a freed column (all True without the state)."""
    if not batch.freed_window_blocks:
        return torch.ones_like(pos, dtype=torch.bool)
    first = torch.tensor([freed_blocks(batch, i) * batch.block_size for i in range(batch.num_seqs)],
                         dtype=torch.int64).to(seq.device)
    return pos >= first[seq]


def check_column(batch: Any, seq: int, col: int, blk: int, freed: int) -> None:
    """Column ``col`` of ``seq`` is :data:`NULL_BLOCK` iff it is one of the ``freed`` leading columns wholly before
    the window; raises ValueError naming the column and the fix otherwise."""
    if col < freed and blk != NULL_BLOCK:
        raise ValueError(
            f"block_table[{seq}][{col}] = {blk}, but with freed_window_blocks every column wholly before the "
            f"window (the first {freed} of sequence {seq}: positions < {freed * batch.block_size}) points at the "
            f"null block {NULL_BLOCK}")
    if col >= freed and blk == NULL_BLOCK:
        first = max(0, batch.ctx_lens[seq] - batch.sliding_window + 1)
        raise ValueError(
            f"block_table[{seq}][{col}] = {NULL_BLOCK} is the null block, but column {col} holds positions "
            f"{col * batch.block_size}..{(col + 1) * batch.block_size - 1} that sequence {seq}'s queries can see "
            f"(first visible key {first}): only columns wholly before the window may point at the null block; "
            "give it a block of its own")


def without_window(batch: Any) -> Any:
    """``batch`` with no sliding window (``sliding_window`` None): the findings baseline's ``"sliding_window"``
    re-run (:data:`kvfuzz.fuzz.campaign.store.baseline.FEATURES_OFF`). Without a window every position is visible,
    so a batch with freed window blocks leaves that state too: each freed column gets a block of its own, appended
    after ``num_blocks`` (the null block stays unused), or, where the sequence shares a kept block with others (a
    shared prefix), the block a sharer keeps at that column, else one fresh block for all of them. Those positions
    were outside every window, so no output of the windowed batch depended on them. Raises ValueError (Batch's)
    where the result is not a valid batch."""
    if not batch.freed_window_blocks:
        return attrs.evolve(batch, sliding_window=None)
    n, need = batch.num_seqs, [batch.blocks_needed(i) for i in range(batch.num_seqs)]
    freed = [min(freed_blocks(batch, i), need[i]) for i in range(n)]
    group = list(range(n))  # sequences sharing a kept block at the same column: one prefix

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    first: dict[tuple[int, int], int] = {}
    for i, row in enumerate(batch.block_table):
        for col in range(freed[i], need[i]):
            j = first.setdefault((col, row[col]), i)
            group[root(i)] = root(j)
    rows, fresh = [list(r) for r in batch.block_table], {}
    for i, row in enumerate(rows):
        for col in range(freed[i]):
            kept = next((r[col] for j, r in enumerate(batch.block_table)
                         if root(j) == root(i) and freed[j] <= col < need[j]), None)
            row[col] = kept if kept is not None else fresh.setdefault(
                (root(i), col), batch.num_blocks + len(fresh))
    return attrs.evolve(batch, sliding_window=None, freed_window_blocks=False,
                        num_blocks=batch.num_blocks + len(fresh), block_table=rows)


def _validate(capabilities: Any) -> None:
    if capabilities.freed_window_blocks and "sliding_window" not in capabilities.features:
        raise ValueError("Capabilities.freed_window_blocks needs the feature 'sliding_window' (blocks are freed "
                         "only behind a window)")


#: The state's declaration: ``Capabilities.freed_window_blocks`` (bool).
STATE = State("freed_window_blocks", "freed window blocks", False, "freed window blocks", "freed-window", __name__,
              lambda b: b.freed_window_blocks, _validate)


__all__ = ["NULL_BLOCK", "STATE", "check_column", "freed_blocks", "held_mask", "without_window"]
