"""Cache states: write exactly the positions a contract requires into a layout, poison everything else."""

from __future__ import annotations

import math
import random

import attrs
import torch

from ..model.batch import Batch
from ..model.data import BatchData
from ..model.poison import Poison
from ..model.space import host_to
from .layouts import CacheLayout

#: Magnitude of STALE poison (fits fp16 and bf16; dominates softmax of N(0, 1) keys).
STALE_MAGNITUDE = 100.0
#: STALE poison repeats every this many blocks (each block of a period differs).
STALE_PERIOD = 16
#: STALE values are read from one pool of this many N(0, 1) * STALE_MAGNITUDE values, drawn once per process
#: from :data:`STALE_POOL_SEED` (drawing a period's values for every cache took 3.5% of a CPU campaign).
STALE_POOL_SIZE = 1 << 20
STALE_POOL_SEED = 0x57A1E
#: (cache dtype, device) -> the pool in that dtype (saturated to an fp8 dtype's range), twice over, so that any
#: STALE_POOL_SIZE consecutive values from an offset below STALE_POOL_SIZE are one slice.
_STALE_POOLS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _stale_pool(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pool = _STALE_POOLS.get((dtype, device))
    if pool is None:
        gen = torch.Generator().manual_seed(STALE_POOL_SEED)
        values = torch.randn(STALE_POOL_SIZE, generator=gen) * STALE_MAGNITUDE
        if dtype.itemsize == 1:
            m = torch.finfo(dtype).max
            values = values.clamp(-m, m)
        values = values.to(dtype)
        pool = _STALE_POOLS[(dtype, device)] = torch.cat([values, values]).to(device)
    return pool


def stale_pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """STALE values of ``shape`` in ``dtype`` on ``device``: consecutive values of the pool
    (:data:`STALE_POOL_SIZE` values N(0, 1) * :data:`STALE_MAGNITUDE`, fp8 dtypes saturated to their range),
    from an offset drawn from ``seed`` on, wrapping around. Deterministic in ``seed``; a view of the pool when
    ``shape`` holds at most STALE_POOL_SIZE elements (do not write to it)."""
    pool = _stale_pool(dtype, torch.device(device))
    n = math.prod(shape)
    start = random.Random(seed).randrange(STALE_POOL_SIZE)
    if n <= STALE_POOL_SIZE:
        return pool[start:start + n].view(shape)
    reps = -(-(start + n) // STALE_POOL_SIZE)
    return pool[:STALE_POOL_SIZE].repeat(reps)[start:start + n].view(shape)


@attrs.frozen(eq=False)
class CacheState:
    """A materialized cache: the tensors, the layout that reads them, and what was written where.

    cached_lens: per sequence, how many leading positions were written (what the caller claims).
    written_slots: int64 ``[n]`` slots that hold a token (on the device of the batch's ground truth); every other
    slot holds ``poison``.
    """

    layout: CacheLayout
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cached_lens: tuple[int, ...]
    written_slots: torch.Tensor
    poison: Poison


#: fp8 bit patterns of NAN and INF poison. float8_e4m3fn has no infinity: its INF poison is its NaN pattern, so
#: the non-finite poisons stay non-finite in every cache dtype (a finite 448 there turned a bug's "non-finite
#: output" into a "kernel mismatch" as the cache dtype shrank, and stopped the shrink).
_FP8_POISON = {
    (torch.float8_e4m3fn, "nan"): 0x7F, (torch.float8_e4m3fn, "inf"): 0x7F,
    (torch.float8_e5m2, "nan"): 0x7F, (torch.float8_e5m2, "inf"): 0x7C,
}


def fill_poison(t: torch.Tensor, poison: Poison, seed: int) -> None:
    """Overwrite all of ``t`` (a cache, blocks along dim 0) with ``poison``. STALE: large finite values drawn
    from ``seed`` (:func:`stale_pattern`: N(0, 1) * STALE_MAGNITUDE, saturated to the range of an fp8 cache) for
    STALE_PERIOD blocks, repeated over the rest. NAN/INF in an fp8 cache: the bit patterns of
    :data:`_FP8_POISON`."""
    if t.dtype.is_floating_point and t.element_size() == 1 and poison in (Poison.NAN, Poison.INF):
        t.view(torch.uint8).fill_(_FP8_POISON[(t.dtype, poison.value)])
    elif poison is Poison.NAN:
        t.fill_(float("nan"))
    elif poison is Poison.INF:
        t.fill_(float("inf"))
    elif poison is Poison.ZEROS:
        t.zero_()
    else:
        # random blocks, repeated with a period of STALE_PERIOD blocks: drawing fresh values for a whole
        # cache ran at 0.27 GB/s (23 s for 65536 blocks); copying a pattern runs at memory speed
        # (two copies in all: the whole periods through a broadcast view of the pattern, then the remainder; a
        # copy per period was ~100 kernel launches for a 1M-element cache on a GPU)
        period = min(t.shape[0], STALE_PERIOD)
        pattern = stale_pattern((period, *t.shape[1:]), t.dtype, seed, t.device)
        reps, rest = divmod(t.shape[0], period)
        if t.element_size() == 1:  # fp8: copy the bytes (a broadcast fp8 copy is not a kernel every device has)
            t, pattern = t.view(torch.uint8), pattern.view(torch.uint8)
        t[: reps * period].unflatten(0, (reps, period)).copy_(pattern.expand(reps, *pattern.shape))
        if rest:
            t[reps * period :].copy_(pattern[:rest])


#: Caches larger than this (bytes, key + value) are poisoned only in the blocks the block table references:
#: a big-cache example (kvfuzz.strategies.batches.big_cache_examples) places a few blocks past 2**31 elements
#: of a cache of several GiB, and filling all of it would cost seconds per example for nothing the contract
#: lets a kernel read. The other blocks hold whatever ``torch.empty`` returned.
FULL_POISON_MAX_BYTES = 1 << 30


def is_big(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the caches together exceed :data:`FULL_POISON_MAX_BYTES` (then only referenced blocks are
    poisoned, and reproducers store only those)."""
    return key_cache.numel() * key_cache.element_size() + value_cache.numel() * value_cache.element_size() \
        > FULL_POISON_MAX_BYTES


def referenced_blocks(batch: Batch) -> torch.Tensor:
    """int64 sorted unique block ids in ``batch.block_table`` (padding columns included)."""
    return torch.unique(torch.tensor(batch.block_table, dtype=torch.int64).flatten())


def referenced_slots(batch: Batch) -> torch.Tensor:
    """int64 every slot of the blocks :func:`referenced_blocks` names (``block * block_size + offset``), block by
    block."""
    offsets = torch.arange(batch.block_size, dtype=torch.int64)
    return (referenced_blocks(batch)[:, None] * batch.block_size + offsets).flatten()


def block_major(batch: Batch, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether both caches have the block index as dimension 0 (every layout but torch's PagedAttention
    ``[1, Hkv, num_blocks * block_size, D]``, kvfuzz.fuzz.targets.torch_flex)."""
    return key_cache.shape[0] == value_cache.shape[0] == batch.num_blocks


def referenced_rows(batch: Batch, layout: CacheLayout, key_cache: torch.Tensor,
                    value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks :func:`referenced_blocks` names, key and value: ``cache[blocks]`` for a block-major layout
    (:func:`block_major`), else their slots read through ``layout.gather`` as ``[blocks, block_size, Hkv, D]``."""
    if block_major(batch, key_cache, value_cache):
        ids = referenced_blocks(batch)
        return key_cache[ids.to(key_cache.device)], value_cache[ids.to(value_cache.device)]
    k, v = layout.gather(key_cache, value_cache, referenced_slots(batch).to(key_cache.device))
    return k.unflatten(0, (-1, batch.block_size)), v.unflatten(0, (-1, batch.block_size))


def _poison_blocks(t: torch.Tensor, poison: Poison, seed: int, blocks: torch.Tensor) -> None:
    part = torch.empty((len(blocks), *t.shape[1:]), dtype=t.dtype, device=t.device)
    fill_poison(part, poison, seed)
    if t.element_size() == 1:  # index_copy_ has no fp8 kernel on CUDA: copy the bytes
        t, part = t.view(torch.uint8), part.view(torch.uint8)
    t.index_copy_(0, blocks.to(t.device), part)


def _poison_referenced(batch: Batch, layout: CacheLayout, kc: torch.Tensor, vc: torch.Tensor, poison: Poison,
                       seeds: tuple[int, int]) -> None:
    """Poison the blocks the block table references: along dim 0 of a block-major cache; otherwise (torch's
    PagedAttention, whose dim 0 is 1: an index_copy_ of block ids there was a device-side assert on an H200 at
    65,537 blocks) their slots through ``layout.write``, rows of the cache's dtype."""
    if block_major(batch, kc, vc):
        blocks = referenced_blocks(batch)
        _poison_blocks(kc, poison, seeds[0], blocks)
        _poison_blocks(vc, poison, seeds[1], blocks)
        return
    slots = referenced_slots(batch).to(kc.device)
    dv = batch.value_head_size or batch.head_size
    rows = []
    for t, d, seed in ((kc, batch.head_size, seeds[0]), (vc, dv, seeds[1])):
        part = torch.empty((len(slots), batch.num_kv_heads, d), dtype=t.dtype, device=t.device)
        fill_poison(part, poison, seed)
        rows.append(part)
    layout.write(kc, vc, slots, *rows)


def materialize(batch: Batch, data: BatchData, layout: CacheLayout, cached_lens: tuple[int, ...],
                poison: Poison, device: str | torch.device = "cpu",
                poison_seeds: tuple[int, int] | None = None) -> CacheState:
    """Build a cache in ``layout`` that holds positions ``0 .. cached_lens[i]-1`` of every sequence ``i``
    at the slots its block table names, and ``poison`` in every other slot. With ``batch.freed_window_blocks``
    the positions of freed columns are not written (:meth:`~kvfuzz.contracts.model.batch.Batch.held_positions`):
    the null block they point at keeps its poison, as vLLM's null block holds whatever was last there.

    ``cached_lens`` usually comes from :meth:`~kvfuzz.contracts.model.contract.Contract.cached_lens`; a caller
    fault passes something else. ``poison_seeds``: seeds of the key and value caches' STALE poison (default
    ``batch.seed + 1``, ``+ 2``). Vectorized: one gather and one indexed store per cache. Caches over
    :data:`FULL_POISON_MAX_BYTES` are poisoned only in the referenced blocks (:func:`referenced_blocks`).

    Raises LayoutError if the layout cannot hold this batch; ValueError if a cached length exceeds seq_len.
    """
    if len(cached_lens) != batch.num_seqs:
        raise ValueError(f"cached_lens has {len(cached_lens)} entries for {batch.num_seqs} sequences")
    for i, (n, s) in enumerate(zip(cached_lens, batch.seq_lens)):
        if not 0 <= n <= s:
            raise ValueError(f"cached_lens[{i}] = {n} is outside 0..seq_len={s}")
    kc, vc = layout.allocate(batch, device=device)
    ks, vs = poison_seeds if poison_seeds is not None else (batch.seed + 1, batch.seed + 2)
    if is_big(kc, vc):
        _poison_referenced(batch, layout, kc, vc, poison, (ks, vs))
    else:
        fill_poison(kc, poison, ks)
        fill_poison(vc, poison, vs)
    # where the ground truth is (a large batch of a CUDA target: its GPU; no host sync there), less the freed
    # columns' positions (Batch.freed_window_blocks)
    seq, pos = batch.held_positions(cached_lens, device=data.cache_keys.device)
    slots = batch.slots(seq, pos)
    if len(slots):
        if tuple(cached_lens) == batch.seq_lens and len(data.cache_keys) == len(seq):
            keys, values = data.cache_keys, data.cache_values  # every position: the ground truth's rows in order
        else:
            rows = data.token_rows(batch, seq, pos)
            keys, values = data.cache_keys.index_select(0, rows), data.cache_values.index_select(0, rows)
        layout.write(kc, vc, *(host_to(t, device) if t.device.type == "cpu" else t.to(device)
                               for t in (slots, keys, values)))
    return CacheState(layout, kc, vc, tuple(cached_lens), slots, poison)


__all__ = ["FULL_POISON_MAX_BYTES", "STALE_MAGNITUDE", "STALE_PERIOD", "STALE_POOL_SEED", "STALE_POOL_SIZE",
           "CacheState", "block_major", "fill_poison", "is_big", "materialize", "referenced_blocks", "referenced_rows",
           "referenced_slots", "stale_pattern"]
