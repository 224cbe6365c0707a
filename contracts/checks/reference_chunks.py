"""How the fp64 reference (:mod:`kvfuzz.contracts.checks.reference`) lays a batch out to compute every sequence
in a few batched ops instead of a loop over sequences.

Each sequence's query rows are cut into **blocks** of consecutive rows; a block's keys are the one contiguous
span of positions its rows can see: up to its last row's position (causal), and from its first row's window
start with a sliding window (the keys before it are masked for every row, so they are not read). Blocks are
grouped into **chunks**; a chunk pads its blocks to its most rows ``Qm`` and most keys ``Km``, so the reference
computes it as batched matmuls ``[B * Hkv, g * Qm, D] x [B * Hkv, D, Km]`` over ``B`` blocks.

Padding reads nothing of another sequence: a padded query row repeats its block's last row (the reference drops
it), and a padded key its block's last key, at a position past every row of the block, so the causal mask
hides it (``-inf`` logit, probability 0, not counted among the visible keys).

Chunk sizes (:class:`Budget`, in fp64 elements of a chunk's logits, keys, values, queries and output): on a GPU,
where the fixed cost of a chunk's kernel launches (60 to 110) dominates, chunks as large as fit in 64 MiB
(:data:`GPU`); on the CPU, small chunks padded a little (:data:`CPU`).

The indices of every chunk are computed here once per call, on the host from the batch's Python lists, and
travel to the data's device in one transfer (from pinned memory, without blocking the host, on CUDA); the
reference derives the per-row and per-key indices from them there, and never reads a device tensor back.
"""

from __future__ import annotations

import attrs
import torch

from ..model.batch import Batch


@attrs.frozen
class Budget:
    """How large a chunk may grow on one kind of device, in fp64 elements of its tensors (:func:`size`):
    ``elements`` at most (a block of one query row may exceed it), and at most ``padding`` more than its blocks
    would have on their own when a block joins it."""

    elements: int
    padding: int


#: On a GPU, where a chunk's fixed cost (its kernel launches) dominates: chunks up to 2**23 elements (64 MiB; the
#: envelope holds a few tensors of the logits' size at once), padded as much as fits.
GPU = Budget(elements=2**23, padding=2**23)
#: On the CPU, where padded work and large allocations cost time (glibc hands freed blocks of more than ~128 KiB
#: back to the system, and the next call faults their pages in again): chunks up to 2**18 elements (2 MiB),
#: padded by at most 2**14 elements per block, about the fixed cost of a chunk of its own. Measured on the
#: shapes of benchmarks/reference_speed.py (one core): 2**16 to 2**19 elements within 5% of each other but on
#: one small batch (2**16: 30% slower); padding 2**12 30% slower on one small batch (fewer merges), 2**16 to
#: 2**18 15-35% slower on another (more padding).
CPU = Budget(elements=2**18, padding=2**14)


@attrs.frozen
class Block:
    """Query rows ``row0 .. row0 + rows - 1`` (indices into the batch's queries) of one sequence, at positions
    ``pos0 .. pos0 + rows - 1``, and the keys they can see: positions ``key0 .. pos0 + rows - 1``, rows
    ``key_row0 ..`` of the batch's flat keys and values."""

    row0: int
    rows: int
    pos0: int
    key0: int
    key_row0: int

    @property
    def keys(self) -> int:
        return self.pos0 + self.rows - self.key0


def size(batch: Batch, n: int, rows: int, keys: int) -> int:
    """fp64 elements of a chunk of ``n`` blocks of ``batch`` padded to ``rows`` query rows and ``keys`` keys:
    its logits ``[n, H, rows, keys]``, keys and values ``[n, Hkv, keys, D]``, queries and output
    ``[n, H, rows, D]``."""
    H, D = batch.num_heads, batch.head_size
    return n * (H * rows * keys + 2 * batch.num_kv_heads * keys * D + 2 * H * rows * D)


def blocks(batch: Batch, budget: int) -> list[Block]:
    """Every query row of ``batch``, in query order, in blocks of at most ``budget`` elements (:func:`size`), or
    where a sequence's keys and values alone exceed it, whose rows' part is at most theirs (a block of one row
    may exceed both)."""
    out = []
    w = batch.sliding_window
    for i, (ctx, n) in enumerate(zip(batch.ctx_lens, batch.query_lens)):
        span = ctx + n if w is None else min(ctx + n, n + w - 1)  # keys of any block of this sequence, at most
        kv = size(batch, 1, 0, span)  # every block copies its keys and values: with more, no fewer rows
        step = max(1, max(budget - kv, kv) // (size(batch, 1, 1, span) - kv))
        for t0 in range(0, n, step):
            pos0 = ctx + t0
            key0 = 0 if w is None else max(0, pos0 - w + 1)
            out.append(Block(row0=batch.query_start_loc[i] + t0, rows=min(step, n - t0), pos0=pos0, key0=key0,
                             key_row0=batch.seq_start_loc[i] + key0))
    return out


def chunks(batch: Batch, blocks: list[Block], budget: Budget) -> list[list[Block]]:
    """``blocks`` grouped first fit, most keys first: a block joins the first chunk that stays within
    ``budget``; each chunk's blocks in query order."""
    groups: list[list[Block]] = []
    rows: list[int] = []  # each group's most rows (its first block has the most keys: sorted)
    for b in sorted(blocks, key=lambda b: (-b.keys, -b.rows)):
        for j, g in enumerate(groups):
            grown = size(batch, len(g) + 1, max(rows[j], b.rows), g[0].keys)
            padded = grown - size(batch, len(g), rows[j], g[0].keys) - size(batch, 1, b.rows, b.keys)
            if grown <= budget.elements and padded <= budget.padding:
                g.append(b)
                rows[j] = max(rows[j], b.rows)
                break
        else:
            groups.append([b])
            rows.append(b.rows)
    return [sorted(g, key=lambda b: b.row0) for g in groups]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``; to CUDA from pinned memory without blocking the host."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


#: A chunk's index tensors: per block, and per real query row.
PER_BLOCK = ("first_row", "last_row", "pos0", "key0", "key_row0", "last_key")
PER_ROW = ("block", "row", "token")


@attrs.frozen(eq=False)
class Chunk:
    """One chunk: its ``blocks`` (in query order) padded to ``rows`` query rows and ``keys`` keys; ``whole``: it
    is every query row of the batch. With more than one block, int64 index tensors on the data's device (None
    with one: it is sliced, not gathered): per block (``[B]``, :data:`PER_BLOCK`) its first query row, its rows
    - 1, its first row's position, its first key's position, that key's row in the flat keys/values and its
    keys - 1; per real query row (``[n]``, :data:`PER_ROW`) where it sits in the padded ``[B, rows]`` layout
    (``block``, ``row``) and its index in the batch's queries (``token``)."""

    blocks: tuple[Block, ...]
    rows: int
    keys: int
    whole: bool
    first_row: torch.Tensor | None = None
    last_row: torch.Tensor | None = None
    pos0: torch.Tensor | None = None
    key0: torch.Tensor | None = None
    key_row0: torch.Tensor | None = None
    last_key: torch.Tensor | None = None
    block: torch.Tensor | None = None
    row: torch.Tensor | None = None
    token: torch.Tensor | None = None


def _indices(g: list[Block]) -> list[int]:
    """The chunk ``g``'s :data:`PER_BLOCK` then :data:`PER_ROW` indices, flat."""
    flat = [b.row0 for b in g] + [b.rows - 1 for b in g] + [b.pos0 for b in g] + [b.key0 for b in g]
    flat += [b.key_row0 for b in g] + [b.keys - 1 for b in g]
    block: list[int] = []
    row: list[int] = []
    token: list[int] = []
    for i, b in enumerate(g):
        block += [i] * b.rows
        row += range(b.rows)
        token += range(b.row0, b.row0 + b.rows)
    return flat + block + row + token


def layout(batch: Batch, device: torch.device) -> list[Chunk]:
    """``batch``'s chunks within the :data:`GPU` budget on a CUDA device, else :data:`CPU`'s, their indices on
    ``device`` (one host-to-device copy, none when every chunk is one block)."""
    budget = GPU if device.type == "cuda" else CPU
    groups = chunks(batch, blocks(batch, budget.elements), budget)
    flat = [i for g in groups if len(g) > 1 for i in _indices(g)]
    index = to_device(flat, torch.int64, device) if flat else None
    out, at = [], 0
    for g in groups:
        fields = {}
        if len(g) > 1:
            B, n = len(g), sum(b.rows for b in g)
            fields = dict(zip(PER_BLOCK, index[at : at + 6 * B].view(6, B)))
            fields |= dict(zip(PER_ROW, index[at + 6 * B : at + 6 * B + 3 * n].view(3, n)))
            at += 6 * B + 3 * n
        out.append(Chunk(tuple(g), max(b.rows for b in g), max(b.keys for b in g), len(groups) == 1, **fields))
    return out


__all__ = ["CPU", "GPU", "PER_BLOCK", "PER_ROW", "Block", "Budget", "Chunk", "blocks", "chunks", "layout", "size",
           "to_device"]
