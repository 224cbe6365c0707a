"""Smaller batches that keep what a defect may hang on: the moves of kvfuzz's structural shrink
(:mod:`kvfuzz.fuzz.campaign.reduce`), which runs after Hypothesis's shrinker on every new distinct failure.

Hypothesis shrinks the choices a strategy made, one or two at a time, toward each choice's simplest value. A
defect that depends on a product or a relation of several fields can stop that: no single step keeps it.

- An int32 offset overflow needs ``block_id * block_size * num_kv_heads * head_size`` past a word: lowering
  the head size (or the kv heads) alone ends it, and nothing raises the block id in the same step.
- A defect that needs a sequence over two or more blocks keeps a large block size: shortening the sequence at
  that block size ends it, and the block size is a later choice that shrinks toward the largest.

Each move here changes several fields at once and keeps what such defects depend on:

- fewer sequences (the other rows and block ids unchanged);
- a shorter sequence (fewer query or context tokens, a prefill turned into the decode of its last token), at
  the batch's block size or at a smaller declared one, either re-expressed (when it divides the block size:
  block ``b`` becomes blocks ``b*k .. b*k + k - 1``, ``k`` the ratio, so every token keeps its slot and element
  offset) or with the block table's ids kept (each row's leading blocks, now holding fewer tokens each: what a
  defect in the use of the ids needs, e.g. a non-consecutive pair);
- a sequence without its first context block or all its full ones (a defect at a block deep in its table keeps
  it);
- fewer heads, fewer kv heads or a smaller head size, with the block ids kept, or scaled so that no block's
  element offset (``id * block_size * num_kv_heads * head_size``) decreases: ``id' = ceil(id * stride /
  stride')`` (an order-preserving, one-to-one map; ``sm_scale`` stays the same multiple of the default);
- fewer blocks: unused block ids removed (all of them, a run of them, half a run, one), the used ids above
  them moving down;
- fewer block-table columns (trailing padding).

Every candidate is strictly smaller by :func:`size_key`, inside the target's declaration
(``Capabilities.accepts``) and the strategies' bounds (heads drawn as :data:`GQA_RATIOS` x
:data:`NUM_KV_HEADS`; at most :func:`max_num_blocks` blocks), so a shrunk case stays in the space
kvfuzz draws from: its smallest trigger is a smallest one kvfuzz could have drawn.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Container, Iterable, Iterator

import attrs

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities

from .batches import HIGH_IDS
from .configs import GQA_RATIOS, NUM_KV_HEADS
from .limits import Limits

#: The fields of :func:`size_key`, in its order.
SIZE_FIELDS = ("seqs", "tokens", "kv_tokens", "heads", "head_size", "blocks", "columns")


def size_key(batch: Batch) -> tuple[int, ...]:
    """How big a case is, in the order a developer reads one (:data:`SIZE_FIELDS`): sequences, query tokens,
    KV tokens (``sum(seq_lens)``), query heads, head size, blocks (``num_blocks``), block-table columns.
    Smaller tuples are smaller cases."""
    return (batch.num_seqs, batch.num_tokens, sum(batch.seq_lens), batch.num_heads, batch.head_size,
            batch.num_blocks, len(batch.block_table[0]))


def max_num_blocks(batch: Batch, limits: Limits) -> int:
    """The most blocks the strategies give a batch with ``batch``'s sequences: its blocks, or a "high" block
    id up to :data:`HIGH_IDS`, plus ``limits.max_spare_blocks`` unused ones (``block_tables``)."""
    used = sum(batch.blocks_needed(i) for i in range(batch.num_seqs))
    return max(HIGH_IDS + 1, used) + limits.max_spare_blocks


def reductions(batch: Batch, capabilities: Capabilities, limits: Limits = Limits()) -> list[Batch]:
    """The candidates of one structural shrink step from ``batch`` (see the module docstring), smallest first
    by :func:`size_key`, each valid, strictly smaller than ``batch``, inside ``capabilities`` and at most
    :func:`max_num_blocks` blocks; no two equal."""
    key = size_key(batch)
    out: dict[Batch, tuple] = {}
    for move in _MOVES:
        for cand in _built(move(batch, capabilities), out):
            k = size_key(cand)
            if k < key and capabilities.accepts(cand) and cand.num_blocks <= max_num_blocks(cand, limits):
                out[cand] = k
    return sorted(out, key=out.__getitem__)


def _built(thunks: Iterable[Thunk], seen: Container[Batch]) -> Iterator[Batch]:
    """Each thunk's candidate, built as it is asked for, less those that are no batch (None, or ValueError: not a
    valid one) and those already in ``seen`` (which the caller may grow between candidates)."""
    for make in thunks:
        try:
            cand = make()
        except ValueError:  # e.g. a shortened sequence that shared a now partial prefix block
            continue
        if cand is not None and cand not in seen:
            yield cand


# ---- moves: each yields thunks building one candidate (ValueError: not a valid batch) --------------------------
Thunk = Callable[[], "Batch | None"]


def _used(batch: Batch) -> list[list[int]]:
    return [list(row[: batch.blocks_needed(i)]) for i, row in enumerate(batch.block_table)]


def _remap(batch: Batch, ids: Callable[[int], int | None], num_blocks: int, **changes) -> Batch | None:
    """``batch`` with ``changes``, every used block id ``b`` replaced by ``ids(b)`` (rows cut to the blocks the
    new lengths need), ``num_blocks`` blocks, and the CSR tail's pool slots moved with their blocks (dropped
    when their block or in-block offset is gone or past the new pool; the out-of-pool entry ``num_slots`` follows the
    pool's size). None when a used block has no new id; ValueError when the result is not a valid batch."""
    evolved = attrs.evolve(batch, **changes) if changes else batch
    table = []
    for i, row in enumerate(batch.block_table):
        need = evolved.blocks_needed(i)
        if need > len(row):
            raise ValueError(f"row {i} has {len(row)} columns, {need} needed")
        new = [ids(b) for b in row[:need]]
        if any(b is None for b in new):
            return None
        table.append(new + [0] * (len(row) - need))
    old_bs, new_bs = batch.block_size, evolved.block_size
    tail = []
    for v in batch.csr_tail:
        b, offset = divmod(v, old_bs)
        if v < 0:
            tail.append(v)
        elif v >= batch.num_blocks * old_bs:
            tail.append(num_blocks * new_bs)
        elif offset < new_bs and (b := ids(b)) is not None and b < num_blocks:
            tail.append(b * new_bs + offset)
    return attrs.evolve(evolved, block_table=table, num_blocks=num_blocks, csr_tail=tail)


def _drop_sequences(batch: Batch, capabilities: Capabilities) -> Iterator[Thunk]:
    if batch.num_seqs < 2:
        return
    for i in range(batch.num_seqs):
        def drop(i=i):
            keep = [j for j in range(batch.num_seqs) if j != i]
            return attrs.evolve(batch, query_lens=[batch.query_lens[j] for j in keep],
                                ctx_lens=[batch.ctx_lens[j] for j in keep],
                                block_table=[batch.block_table[j] for j in keep])
        yield drop


def _shorter(query_len: int, ctx_len: int) -> set[tuple[int, int]]:
    """Shorter ``(query_len, ctx_len)`` of one sequence: the decode of its last token, fewer query tokens,
    fewer context tokens (none, half, one less)."""
    out = {(query_len, c) for c in (0, ctx_len // 2, ctx_len - 1)}
    if query_len > 1:
        out |= {(1, ctx_len + query_len - 1), (1, ctx_len), (max(1, query_len // 2), ctx_len),
                (query_len - 1, ctx_len)}
    return {(q, c) for q, c in out if q >= 1 and c >= 0 and (q, c) != (query_len, ctx_len)}


def reexpress(batch: Batch, block_size: int) -> Batch:
    """``batch`` at ``block_size`` (a divisor of its block size): block ``b`` becomes blocks ``b*k .. b*k + k-1``
    (``k`` the ratio), so every token keeps its slot, and the cache its size. Raises ValueError if
    ``block_size`` does not divide ``batch.block_size``."""
    if batch.block_size % block_size:
        raise ValueError(f"block_size {block_size} does not divide {batch.block_size}")
    k = batch.block_size // block_size
    table = []
    for i, row in enumerate(batch.block_table):
        used = [b * k + j for b in row[: batch.blocks_needed(i)] for j in range(k)]
        table.append(used + [0] * (len(row) * k - len(used)))
    return attrs.evolve(batch, block_size=block_size, num_blocks=batch.num_blocks * k, block_table=table)


def _shorten(batch: Batch, capabilities: Capabilities) -> Iterator[Thunk]:
    """Shorter sequences at the batch's block size, and at each smaller declared one: re-expressed (every
    token keeps its slot; only divisors) or with the table's block ids kept (each row's leading blocks now
    hold fewer tokens: a defect in how ids are used, not where tokens sit, keeps its trigger)."""
    bases: list[tuple[int, Callable[[], Batch] | None]] = [(batch.block_size, None)]
    for bs in sorted((b for b in capabilities.block_sizes_for(batch.kv_cache_dtype) if b < batch.block_size),
                     reverse=True):
        if batch.block_size % bs == 0:
            bases.append((bs, lambda bs=bs: reexpress(batch, bs)))
        bases.append((bs, lambda bs=bs: batch))
    for bs, base_of in bases:
        for i in range(batch.num_seqs):
            for q, c in sorted(_shorter(batch.query_lens[i], batch.ctx_lens[i])):
                def shorten(i=i, q=q, c=c, bs=bs, base_of=base_of):
                    base = batch if base_of is None else base_of()
                    query_lens, ctx_lens = list(base.query_lens), list(base.ctx_lens)
                    query_lens[i], ctx_lens[i] = q, c
                    return _remap(base, lambda b: b, base.num_blocks, block_size=bs, query_lens=query_lens,
                                  ctx_lens=ctx_lens)
                yield shorten


def _scaled(batch: Batch, stride: int) -> tuple[Callable[[int], int], int]:
    """The id map keeping every block's element offset at least what it was at the new block ``stride``
    (elements per block), and the new block count (the unused blocks above the highest used one kept)."""
    old = batch.block_size * batch.num_kv_heads * batch.head_size

    def ids(b: int) -> int:
        return -(-b * old // stride)

    top = max((b for row in _used(batch) for b in row), default=0)
    return ids, ids(top) + (batch.num_blocks - top)


def _reshape(batch: Batch, **changes) -> Iterator[Thunk]:
    """``batch`` with ``changes`` to its heads or head size: block ids kept, and (when the block stride
    shrinks) scaled to keep the element offsets."""
    after = attrs.evolve(batch, **changes)
    if batch.sm_scale is not None and "head_size" in changes:  # the same multiple of 1/sqrt(head_size)
        changes["sm_scale"] = batch.sm_scale * math.sqrt(batch.head_size / after.head_size)
    yield lambda: attrs.evolve(batch, **changes)
    stride = after.block_size * after.num_kv_heads * after.head_size
    if stride < batch.block_size * batch.num_kv_heads * batch.head_size:
        def scaled():
            ids, num_blocks = _scaled(batch, stride)
            return _remap(batch, ids, num_blocks, **changes)
        yield scaled


def _heads(batch: Batch, capabilities: Capabilities) -> Iterator[Thunk]:
    for ratio in GQA_RATIOS:
        for kv in NUM_KV_HEADS:
            if ratio * kv < batch.num_heads and kv <= batch.num_kv_heads:
                yield from _reshape(batch, num_heads=ratio * kv, num_kv_heads=kv)


def _head_sizes(batch: Batch, capabilities: Capabilities) -> Iterator[Thunk]:
    for d in capabilities.head_sizes_for(batch.kv_cache_dtype):
        if d < batch.head_size:
            yield from _reshape(batch, head_size=d)


def _unused_runs(batch: Batch) -> list[range]:
    used = {b for row in _used(batch) for b in row}
    runs, start = [], None
    for b in range(batch.num_blocks + 1):
        free = b < batch.num_blocks and b not in used
        if free and start is None:
            start = b
        elif not free and start is not None:
            runs.append(range(start, b))
            start = None
    return runs


def _fewer_blocks(batch: Batch, capabilities: Capabilities) -> Iterator[Thunk]:
    runs = _unused_runs(batch)
    removals = [set().union(*runs)] if runs else []
    for run in runs:
        removals += [set(run), set(run[: len(run) // 2]), {run[0]}]
    for removed in removals:
        if not removed:
            continue

        def remove(removed=frozenset(removed)):
            below = sorted(removed)

            def ids(b: int) -> int | None:
                return None if b in removed else b - bisect.bisect_left(below, b)
            return _remap(batch, ids, batch.num_blocks - len(removed))
        yield remove


def _fewer_columns(batch: Batch, capabilities: Capabilities) -> Iterator[Thunk]:
    """The block table without trailing padding columns (all of them, or the last one)."""
    width = len(batch.block_table[0])
    need = max(batch.blocks_needed(i) for i in range(batch.num_seqs))
    for w in {need, width - 1}:
        if need <= w < width:
            yield lambda w=w: attrs.evolve(batch, block_table=[row[:w] for row in batch.block_table])


def _drop_leading_blocks(batch: Batch, capabilities: Capabilities) -> Iterator[Thunk]:
    """A sequence without its first context block, or without all its full context blocks: it starts later in
    the same blocks (a defect at a block deep in the table keeps it, with fewer tokens before it)."""
    bs = batch.block_size
    for i in range(batch.num_seqs):
        full = batch.ctx_lens[i] // bs
        for k in sorted({1, full}):
            if 1 <= k <= full:
                def drop(i=i, k=k):
                    ctx_lens = list(batch.ctx_lens)
                    ctx_lens[i] -= k * bs
                    table = [list(r) for r in batch.block_table]
                    table[i] = table[i][k:] + [0] * k
                    return attrs.evolve(batch, ctx_lens=ctx_lens, block_table=table)
                yield drop


_MOVES = (_drop_sequences, _shorten, _drop_leading_blocks, _heads, _head_sizes, _fewer_blocks, _fewer_columns)

#: Widths a length is snapped down to a multiple of, besides the block size: the tile widths kernels iterate in
#: (Triton's BLOCK_M/BLOCK_N, FlashAttention's kBlockM/kBlockN).
TILE_WIDTHS = (16, 32, 64, 128)


def coarse_reductions(batch: Batch, capabilities: Capabilities, limits: Limits = Limits()) -> Iterator[Batch]:
    """The structural-first moves (issue 52), run on a new failure as found, before Hypothesis's shrink: a
    serving-sized failure of tens of sequences at 60-140 ms an example had not shrunk within its grace. In order,
    each candidate valid, strictly smaller by :func:`size_key`, inside ``capabilities``, in the same kernel
    configuration (no recompile) and made lazily (a serving batch's table has thousands of blocks):

    - half of the sequences dropped (either half), then a quarter, an eighth, ..., then one at a time (delta
      debugging's complements: a failure that needs one sequence is down to it after about 2 log2(n) runs);
    - every context halved at once, then each sequence's; the queries the same;
    - every context snapped down to a multiple of the block size or of a tile width (:data:`TILE_WIDTHS`), the
      widest first, at once, then each sequence's, and the queries (the edges where masking and tiling
      change)."""
    key, seen = size_key(batch), {batch}
    for cand in _built(_coarse(batch), seen):
        seen.add(cand)
        if size_key(cand) < key and capabilities.accepts(cand):
            yield cand


def _coarse(batch: Batch) -> Iterator[Thunk]:
    n = batch.num_seqs
    parts = 2
    while n > 1 and parts <= 2 * n:
        k = min(parts, n)
        bounds = [n * j // k for j in range(k + 1)]
        for j in range(k):  # drop part j
            drop = set(range(bounds[j], bounds[j + 1]))
            if 0 < len(drop) < n:
                yield lambda drop=frozenset(drop): _keep(batch, [i for i in range(n) if i not in drop])
        if k == n:
            break
        parts *= 2
    widths = sorted({batch.block_size, *TILE_WIDTHS}, reverse=True)
    moves = [functools.partial(_halved, axis) for axis in (0, 1)]
    moves += [functools.partial(_snapped, w, axis) for w in widths for axis in (0, 1)]
    for lengths in moves:
        for i in (None, *range(n)):  # every sequence at once, then each
            yield lambda lengths=lengths, i=i: _relength(batch, lengths, i)


def _keep(batch: Batch, rows: list[int]) -> Batch:
    return attrs.evolve(batch, query_lens=[batch.query_lens[i] for i in rows],
                        ctx_lens=[batch.ctx_lens[i] for i in rows], block_table=[batch.block_table[i] for i in rows])


def _halved(axis: int, q: int, c: int) -> tuple[int, int]:
    """The context (``axis`` 0) or the query (1, at least 1) halved."""
    return (q, c // 2) if axis == 0 else (max(1, q // 2), c)


def _snapped(width: int, axis: int, q: int, c: int) -> tuple[int, int]:
    """The context (``axis`` 0) or the query (1, at least 1) snapped down to a multiple of ``width``."""
    return (q, c // width * width) if axis == 0 else (max(1, q // width * width), c)


def _relength(batch: Batch, lengths, i: int | None) -> Batch | None:
    """``batch`` with ``lengths`` applied to sequence ``i`` (None: to every sequence), its rows cut to the blocks
    the new lengths need (block ids kept)."""
    query_lens, ctx_lens = list(batch.query_lens), list(batch.ctx_lens)
    for j in range(batch.num_seqs) if i is None else (i,):
        query_lens[j], ctx_lens[j] = lengths(query_lens[j], ctx_lens[j])
    if query_lens == list(batch.query_lens) and ctx_lens == list(batch.ctx_lens):
        return None
    return _remap(batch, lambda b: b, batch.num_blocks, query_lens=query_lens, ctx_lens=ctx_lens)


__all__ = ["SIZE_FIELDS", "TILE_WIDTHS", "coarse_reductions", "max_num_blocks", "reductions", "reexpress",
           "size_key"]
