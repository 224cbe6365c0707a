"""The logical model of one paged-attention call: a mixed batch of prefill and decode sequences.

Terms follow vLLM (vllm/v1/attention/backend.py, CommonAttentionMetadata): sequence ``i`` has ``ctx_len``
tokens already cached and ``query_len`` new tokens, ``seq_len = ctx_len + query_len``. Query token ``j``
(0-based) of sequence ``i`` sits at position ``ctx_len + j`` and attends causally to positions
``0 .. ctx_len + j``. Position ``p`` of sequence ``i`` lives in slot
``block_table[i, p // block_size] * block_size + p % block_size`` of the paged cache.

A ``Batch`` is pure structure: no tensors. Its tensors (queries, the ground-truth keys and values of every
position) are drawn deterministically from ``seed`` by :func:`kvfuzz.contracts.data.make_batch_data`.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

#: Query/output dtypes kvfuzz models, by the names vLLM's ``--dtype`` uses.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

#: vLLM's ``kv_cache_dtype`` values (vllm/config/cache.py, CacheDType).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def _tuple_of_ints(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _table(value: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return tuple(_tuple_of_ints(row) for row in value)


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class Batch:
    """One mixed batch handed to a paged-attention kernel.

    Fields
    ------
    query_lens, ctx_lens:
        Per sequence, number of new (query) tokens (>= 1) and of tokens already cached (>= 0).
        A sequence with ``query_len == 1`` is a decode sequence, otherwise a prefill.
    num_heads, num_kv_heads, head_size:
        Query heads ``H``, key/value heads ``Hkv`` (``H % Hkv == 0``; GQA group = ``H // Hkv``) and ``D``.
    block_size, num_blocks:
        Tokens per cache block and physical blocks in the cache.
    block_table:
        ``[num_seqs][max_blocks_per_seq]`` physical block ids (stored as a tuple of tuples; the kernel gets
        int32). Every column a sequence uses (``ceil(seq_len / block_size)``) must hold a block id in
        ``[0, num_blocks)`` and no block may be used by two sequences; unused columns are padding.
    dtype:
        Query/key/value/output dtype name, a key of :data:`DTYPES`.
    kv_cache_dtype:
        One of :data:`KV_CACHE_DTYPES`; ``"auto"`` stores the cache in ``dtype``.
    seed:
        Seed of the tensor data (queries, keys, values, poison values).
    sm_scale:
        Softmax scale; ``None`` means the kernels' default ``1 / sqrt(head_size)``.

    Raises
    ------
    ValueError
        If the structure is inconsistent (lengths differ, a table is too short, a block id is out of range or
        shared, ``num_heads % num_kv_heads != 0``, an unknown dtype); the message names the field.
    """

    query_lens: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    ctx_lens: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_size: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(validator=_positive)
    num_blocks: int = attrs.field(validator=_positive)
    block_table: tuple[tuple[int, ...], ...] = attrs.field(converter=_table)
    dtype: str = attrs.field(default="float16", validator=attrs.validators.in_(tuple(DTYPES)))
    kv_cache_dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(KV_CACHE_DTYPES))
    seed: int = 0
    sm_scale: float | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.query_lens)
        if n == 0:
            raise ValueError("a batch needs at least one sequence (query_lens is empty)")
        if len(self.ctx_lens) != n or len(self.block_table) != n:
            raise ValueError(
                f"query_lens ({n}), ctx_lens ({len(self.ctx_lens)}) and block_table rows "
                f"({len(self.block_table)}) must have one entry per sequence"
            )
        if min(self.query_lens) < 1:
            raise ValueError(f"every query_len must be >= 1, got {self.query_lens}")
        if min(self.ctx_lens) < 0:
            raise ValueError(f"every ctx_len must be >= 0, got {self.ctx_lens}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        width = {len(row) for row in self.block_table}
        if len(width) != 1:
            raise ValueError(f"block_table rows must all have the same length, got {sorted(width)}")
        used: dict[int, int] = {}
        for i, row in enumerate(self.block_table):
            need = self.blocks_needed(i)
            if need > len(row):
                raise ValueError(
                    f"block_table row {i} has {len(row)} columns but seq_len {self.seq_lens[i]} needs "
                    f"{need} blocks of block_size {self.block_size}"
                )
            for col, blk in enumerate(row[:need]):
                if not 0 <= blk < self.num_blocks:
                    raise ValueError(
                        f"block_table[{i}][{col}] = {blk} is outside [0, num_blocks={self.num_blocks})"
                    )
                if blk in used:
                    raise ValueError(
                        f"block {blk} is used by sequences {used[blk]} and {i}; each sequence needs its own blocks"
                    )
                used[blk] = i

    # ---- derived quantities -------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.ctx_lens, self.query_lens))

    @property
    def num_tokens(self) -> int:
        """Total query tokens ``T`` in the batch."""
        return sum(self.query_lens)

    @property
    def query_start_loc(self) -> tuple[int, ...]:
        """``[num_seqs + 1]`` prefix sums of query_lens (vLLM's ``query_start_loc``)."""
        out = [0]
        for q in self.query_lens:
            out.append(out[-1] + q)
        return tuple(out)

    @property
    def seq_start_loc(self) -> tuple[int, ...]:
        """``[num_seqs + 1]`` prefix sums of seq_lens: where each sequence's positions start in the
        flat ground-truth key/value tensors of :class:`~kvfuzz.contracts.data.BatchData`."""
        out = [0]
        for s in self.seq_lens:
            out.append(out[-1] + s)
        return tuple(out)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def max_blocks_per_seq(self) -> int:
        return len(self.block_table[0])

    @property
    def scale(self) -> float:
        """The softmax scale in effect: ``sm_scale`` or ``1 / sqrt(head_size)``."""
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.head_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_decode(self, seq: int) -> bool:
        return self.query_lens[seq] == 1

    @property
    def decode_seqs(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_seqs) if self.is_decode(i))

    @property
    def prefill_seqs(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_seqs) if not self.is_decode(i))

    def blocks_needed(self, seq: int) -> int:
        return -(-self.seq_lens[seq] // self.block_size)

    # ---- tensors handed to kernels ------------------------------------------------------------------
    def block_table_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs, max_blocks_per_seq]``."""
        return torch.tensor(self.block_table, dtype=torch.int32, device=device)

    def seq_lens_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs]``."""
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=device)

    def query_start_loc_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs + 1]``."""
        return torch.tensor(self.query_start_loc, dtype=torch.int32, device=device)

    def slots(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Slots of positions ``pos`` of sequences ``seq`` (int64 tensors of one shape), vectorized.

        ``slot = block_table[seq, pos // block_size] * block_size + pos % block_size``
        (vllm/v1/worker/block_table.py, BlockTable.compute_slot_mapping).
        """
        table = torch.tensor(self.block_table, dtype=torch.int64)
        return table[seq, pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: the slot of every query token, in query order (vLLM's ``slot_mapping``)."""
        seq, pos = positions(self.query_lens, offsets=self.ctx_lens)
        return self.slots(seq, pos)

    # ---- serialization ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["query_lens"] = list(self.query_lens)
        d["ctx_lens"] = list(self.ctx_lens)
        d["block_table"] = [list(r) for r in self.block_table]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Batch":
        names = {a.name for a in attrs.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Batch fields {sorted(unknown)}; known fields are {sorted(names)}")
        return cls(**d)

    def summary(self) -> str:
        kinds = "".join("d" if q == 1 else "p" for q in self.query_lens)
        return (
            f"{self.num_seqs} seqs [{kinds}] query_lens={list(self.query_lens)} ctx_lens={list(self.ctx_lens)} "
            f"H={self.num_heads} Hkv={self.num_kv_heads} D={self.head_size} block_size={self.block_size} "
            f"num_blocks={self.num_blocks} dtype={self.dtype} kv_cache_dtype={self.kv_cache_dtype}"
        )


def positions(lens: tuple[int, ...] | list[int], offsets: tuple[int, ...] | list[int] | None = None):
    """Vectorized enumeration of ``(seq, pos)`` for ``pos in offsets[seq] .. offsets[seq] + lens[seq] - 1``.

    Returns two int64 tensors of length ``sum(lens)``, ordered by sequence then position (query order when
    ``lens = query_lens`` and ``offsets = ctx_lens``).
    """
    counts = torch.tensor(list(lens), dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(int(counts.sum())) - starts[seq]
    if offsets is not None:
        pos = pos + torch.tensor(list(offsets), dtype=torch.int64)[seq]
    return seq, pos
