"""The logical model of one paged-attention call: a mixed batch of prefill and decode sequences.

Terms follow vLLM (vllm/v1/attention/backend.py, CommonAttentionMetadata): sequence ``i`` has ``ctx_len``
tokens already cached and ``query_len`` new tokens, ``seq_len = ctx_len + query_len``. Query token ``j``
(0-based) of sequence ``i`` sits at position ``ctx_len + j`` and attends causally to positions
``0 .. ctx_len + j``. Position ``p`` of sequence ``i`` lives in slot
``block_table[i, p // block_size] * block_size + p % block_size`` of the paged cache.

A ``Batch`` is pure structure: no tensors. Its tensors (queries, the ground-truth keys and values of every
position) are drawn deterministically from ``seed`` by :func:`kvfuzz.contracts.model.data.make_batch_data`.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import attrs
import torch

from . import freed_window
from .freed_window import NULL_BLOCK  # noqa: F401 (re-exported: the state's home holds it)
from .space import (  # noqa: F401 (re-exported)
    DTYPES,
    FEATURES,
    FP8_DTYPES,
    KV_CACHE_DTYPES,
    VALUE_RANGES,
    alibi_slopes,
    host_tensor,
    positions,
    table_tensor,
)


def _tuple_of_ints(value: Any) -> tuple[int, ...]:
    """``tuple(int(v) for v in value)``. A list or tuple of integers (a drawn block table's rows: ~12,000 ids a
    serving batch) goes through an int64 array, ~2x faster for the same ints (``__index__``, which an integer's
    ``int()`` equals); anything else, or what the array refuses (floats, strings, past int64), takes the loop."""
    if type(value) is list or type(value) is tuple:
        try:
            return tuple(array("q", value))
        except (TypeError, OverflowError):
            pass
    return tuple(int(v) for v in value)


def _table(value: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return tuple(_tuple_of_ints(row) for row in value)


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


def _positive_float(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value}")


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


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
        ``[0, num_blocks)``; unused columns are padding. A block may be used by several sequences only as a
        **shared prefix block** (:meth:`shared_prefix_rows`): at the same column ``c`` of every user, full
        context of each (``(c + 1) * block_size <= ctx_len``, so no call writes it), and every user's columns
        before ``c`` the same blocks too (a shared prefix, as SGLang's radix cache and vLLM's prefix caching
        share whole pages); its positions then hold the same keys and values in every user.
    dtype:
        Query/key/value/output dtype name, a key of :data:`DTYPES`.
    kv_cache_dtype:
        One of :data:`KV_CACHE_DTYPES`; ``"auto"`` stores the cache in ``dtype``, the fp8 ones store
        ``round_fp8(k / k_scale)`` (:data:`FP8_DTYPES`) and kernels read back ``fp8 * k_scale``.
    seed:
        Seed of the tensor data (queries, keys, values, poison values).
    sm_scale:
        Softmax scale; ``None`` means the kernels' default ``1 / sqrt(head_size)``.
    k_scale, v_scale:
        Per-tensor dequantization scales of an fp8 cache (vLLM's ``layer._k_scale``); must be 1.0 for
        ``"auto"``, where kernels ignore them.
    q_scale:
        The per-tensor scale vLLM's attention layer quantizes the query with for a kernel that takes an fp8 query
        with an fp8 cache (``layer._q_scale``: a checkpoint's calibrated ``q_scale``, 1.0 without one,
        vllm/model_executor/layers/quantization/kv_cache.py ``process_weights_after_loading``; applied by
        ``Attention.forward``'s ``query_quant`` and passed as ``q_descale``, vllm/v1/attention/backends/flash_attn.py):
        the kernel gets ``round_e4m3(q / q_scale)`` and ``q_descale = q_scale``. Drawn only for targets that declare
        ``Capabilities.quant_query``; must be 1.0 for ``"auto"``.
    sliding_window:
        ``None`` or ``W >= 1``: query position ``p`` attends to key positions ``p - W + 1 .. p`` (``W`` keys,
        itself included): the model config's ``sliding_window``, which vLLM's backends hand to kernels in
        each kernel's own convention (unified_attention: ``window_size = (W - 1, 0)``; prefix_prefill and
        chunked_prefill_paged_decode: ``sliding_window = W``; vllm/v1/attention/backends/triton_attn.py).
    alibi:
        Add ALiBi bias ``slope[h] * (key_pos - query_pos)`` with vLLM's slopes (:func:`alibi_slopes`).
    sinks:
        Attention sinks (gpt-oss): one logit per query head (drawn from ``seed``) that joins every row's
        softmax denominator and carries no value.
    softcap:
        ``None`` or ``c > 0``: logits become ``c * tanh(logits / c)`` (Gemma 2's attention soft-capping),
        applied after the scale and before ALiBi and masking (unified_attention's order).
    value_range:
        How queries and keys are drawn, one of :data:`VALUE_RANGES`.
    value_head_size:
        ``None`` (values have ``head_size`` dims of their own) or ``Dv < head_size``: MLA's latent cache, where
        a position's cached row is its key (``kv_c`` then ``k_pe``: DeepSeek's 512 + 64 = 576) and its value is
        the first ``Dv`` dims of that same row (vLLM's ``kv_c_cache = kv_c_and_k_pe_cache[..., :kv_lora_rank]``,
        vllm/v1/attention/backends/mla/triton_mla.py). The query is already in the latent space (``[*, H,
        head_size]``), the output ``[*, H, Dv]``; one row per token needs ``num_kv_heads == 1`` and one fp8 scale
        (``v_scale == k_scale``).
    csr_tail:
        Entries of a CSR ``kv_indices`` past ``kv_indptr[-1]`` (:func:`kvfuzz.contracts.model.csr.token_slot_lists`):
        ids no kernel may read, as a buffer allocated for a larger batch holds them (SGLang's CUDA-graph
        ``kv_indices`` buffers): out of range (``-1``, ``num_blocks * block_size``) or slots of other positions
        (poisoned or another sequence's). Only CSR targets see them; empty by default.
    num_pad_seqs:
        CUDA-graph pad sequences after the real ones (the "CUDA-graph padding" state,
        :mod:`kvfuzz.contracts.model.padding`): the call carries them as the engine builds them (the target's
        ``Capabilities.cuda_graph_padding`` convention), the reference computes only the real sequences, and
        every other field describes the real sequences alone. 0 by default.
    freed_window_blocks:
        The production state of a sliding-window KV manager (needs ``sliding_window``): every block wholly before
        sequence ``i``'s first visible key ``max(0, ctx_len - W + 1)`` is given back to the pool and its column
        points at the **null block** (:data:`NULL_BLOCK`, block 0), as vLLM's ``SlidingWindowManager`` does
        (vllm/v1/core/single_type_kv_cache_manager.py: ``get_num_skipped_tokens(num_computed_tokens) =
        num_computed_tokens - sliding_window + 1``, ``remove_skipped_blocks`` frees the
        ``num_skipped_tokens // block_size`` leading blocks and puts ``null_block`` in their place; vLLM's
        ``BlockPool`` pops block 0 as ``null_block`` and never hands it to a request, vllm/v1/core/block_pool.py).
        Those positions are not in the cache (:meth:`held_positions`): the null block holds poison. The first
        :meth:`freed_blocks` columns of every sequence must then be :data:`NULL_BLOCK` and no other column a
        sequence uses may be. False by default.

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
    sm_scale: float | None = attrs.field(default=None, converter=_optional_float, validator=_positive_float)
    k_scale: float = attrs.field(default=1.0, converter=float, validator=_positive_float)
    v_scale: float = attrs.field(default=1.0, converter=float, validator=_positive_float)
    q_scale: float = attrs.field(default=1.0, converter=float, validator=_positive_float)
    sliding_window: int | None = attrs.field(default=None, converter=_optional_int)
    alibi: bool = attrs.field(default=False, converter=bool)
    sinks: bool = attrs.field(default=False, converter=bool)
    softcap: float | None = attrs.field(default=None, converter=_optional_float, validator=_positive_float)
    value_range: str = attrs.field(default="normal", validator=attrs.validators.in_(VALUE_RANGES))
    csr_tail: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_ints)
    value_head_size: int | None = attrs.field(default=None, converter=_optional_int)
    num_pad_seqs: int = attrs.field(default=0, converter=int)
    freed_window_blocks: bool = attrs.field(default=False, converter=bool)

    def __attrs_post_init__(self) -> None:
        if self.num_pad_seqs < 0:
            raise ValueError(f"num_pad_seqs must be >= 0 (CUDA-graph pad sequences), got {self.num_pad_seqs}")
        if self.kv_cache_dtype == "auto" and (self.k_scale != 1.0 or self.v_scale != 1.0):
            raise ValueError(
                f"k_scale={self.k_scale} / v_scale={self.v_scale} apply to fp8 caches only; with "
                "kv_cache_dtype='auto' kernels ignore them: set kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2', or "
                "leave the scales at 1.0"
            )
        if self.kv_cache_dtype == "auto" and self.q_scale != 1.0:
            raise ValueError(
                f"q_scale={self.q_scale} applies with an fp8 cache only (vLLM quantizes the query for an fp8 "
                "cache's kernel alone): set kv_cache_dtype='fp8_e4m3', or leave q_scale at 1.0"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None (no window) or >= 1 keys, got {self.sliding_window}")
        if self.value_head_size is not None:
            self._check_latent()
        if self.freed_window_blocks and self.sliding_window is None:
            raise ValueError("freed_window_blocks models a sliding-window KV manager: it needs sliding_window set "
                             "(or set freed_window_blocks=False)")
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
        if self._blocks_plainly_valid():
            return
        used: dict[int, tuple[int, int]] = {}
        for i, row in enumerate(self.block_table):
            need = self.blocks_needed(i)
            if need > len(row):
                raise ValueError(
                    f"block_table row {i} has {len(row)} columns but seq_len {self.seq_lens[i]} needs "
                    f"{need} blocks of block_size {self.block_size}"
                )
            freed = self.freed_blocks(i)
            for col, blk in enumerate(row[:need]):
                if not 0 <= blk < self.num_blocks:
                    raise ValueError(
                        f"block_table[{i}][{col}] = {blk} is outside [0, num_blocks={self.num_blocks})"
                    )
                if self.freed_window_blocks:
                    freed_window.check_column(self, i, col, blk, freed)
                    if col < freed:
                        continue  # the null block, aliased by every freed column
                if blk in used:
                    self._check_shared(blk, used[blk], (i, col))
                else:
                    used[blk] = (i, col)

    def _blocks_plainly_valid(self) -> bool:
        """Whether every row holds its sequence's blocks, each id in range and none used twice (nothing shared, no
        freed window): the common case, checked over all ids at once (a serving batch has thousands; the loop over
        them cost ~1 ms a draw). False: the loop in ``__attrs_post_init__`` decides, and names the first fault."""
        if self.freed_window_blocks:
            return False
        ids: list[int] = []
        for row, seq_len in zip(self.block_table, self.seq_lens):
            need = -(-seq_len // self.block_size)
            if need > len(row):
                return False
            ids += row[:need]
        return min(ids) >= 0 and max(ids) < self.num_blocks and len(set(ids)) == len(ids)

    def _check_latent(self) -> None:
        """A latent batch (``value_head_size`` set): ``1 <= Dv < head_size``, one kv head, one fp8 scale."""
        dv = self.value_head_size
        if not 1 <= dv < self.head_size:
            raise ValueError(f"value_head_size {dv} must be in [1, head_size={self.head_size}) (the value is the "
                             "first value_head_size dims of the key row); None for values of their own")
        if self.num_kv_heads != 1:
            raise ValueError(f"value_head_size (a latent cache) needs num_kv_heads == 1, got {self.num_kv_heads}: "
                             "MLA caches one latent row per token, shared by every query head")
        if self.v_scale != self.k_scale:
            raise ValueError(f"a latent cache has one fp8 scale: v_scale {self.v_scale} must equal k_scale "
                             f"{self.k_scale} (vLLM's Triton MLA passes v_scale=layer._k_scale)")

    def _check_shared(self, blk: int, first: tuple[int, int], other: tuple[int, int]) -> None:
        """A block used twice is legal only as a shared prefix block (see ``block_table``); raises ValueError."""
        (a, ca), (b, cb) = first, other
        full = (ca + 1) * self.block_size
        why = None
        if ca != cb:
            why = f"at columns {ca} and {cb} (a shared prefix block sits at the same column in every user)"
        elif full > self.ctx_lens[a] or full > self.ctx_lens[b]:
            why = (f"but it is not full context of both (positions {ca * self.block_size}..{full - 1}, ctx_lens "
                   f"{self.ctx_lens[a]} and {self.ctx_lens[b]}): a shared block must never be written")
        elif self.block_table[a][(lo := max(self.freed_blocks(a), self.freed_blocks(b))):ca] \
                != self.block_table[b][lo:cb]:  # freed columns (the null block) are no one's
            why = f"but their columns before {ca} differ (only a whole shared prefix can be shared)"
        if why is not None:
            raise ValueError(f"block {blk} is used by sequences {a} and {b} {why}; each sequence needs its own "
                             "blocks except for shared prefix blocks")

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
    def kv_elements(self) -> int:
        """Elements of the keys (as many again of the values) the sequences hold: ``sum(seq_lens) *
        num_kv_heads * head_size``."""
        return sum(self.seq_lens) * self.num_kv_heads * self.head_size

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
        flat ground-truth key/value tensors of :class:`~kvfuzz.contracts.model.data.BatchData`."""
        out = [0]
        for s in self.seq_lens:
            out.append(out[-1] + s)
        return tuple(out)

    @property
    def head_size_v(self) -> int:
        """The value (and output) head size: ``value_head_size`` for a latent batch, else ``head_size``."""
        return self.head_size if self.value_head_size is None else self.value_head_size

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
    def fp8_dtype(self) -> torch.dtype | None:
        """The cache's fp8 dtype, or None for ``kv_cache_dtype="auto"``."""
        return FP8_DTYPES.get(self.kv_cache_dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        """What one cache element is stored as: ``dtype`` for "auto", else the fp8 dtype."""
        return self.fp8_dtype or self.torch_dtype

    @property
    def alibi_slopes(self) -> tuple[float, ...] | None:
        """``[num_heads]`` fp32 slopes when ``alibi`` is set (:func:`alibi_slopes`), else None."""
        return alibi_slopes(self.num_heads) if self.alibi else None

    def alibi_slopes_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor | None:
        """float32 ``[num_heads]`` or None."""
        s = self.alibi_slopes
        return None if s is None else torch.tensor(s, dtype=torch.float32, device=device)

    @property
    def features(self) -> tuple[str, ...]:
        """Which optional attention features the batch uses, by :data:`FEATURES` names."""
        on = {"sliding_window": self.sliding_window is not None, "alibi": self.alibi, "sinks": self.sinks,
              "softcap": self.softcap is not None}
        return tuple(f for f in FEATURES if on[f])

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

    def freed_blocks(self, seq: int) -> int:
        """How many leading columns of ``seq`` are freed to the null block
        (:func:`kvfuzz.contracts.model.freed_window.freed_blocks`; 0 without ``freed_window_blocks``)."""
        return freed_window.freed_blocks(self, seq)

    def held_positions(self, lens, device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq, pos)`` int64 of positions ``0 .. lens[i]-1`` of every sequence ``i`` that the cache holds:
        all of them, less the positions of freed columns (:meth:`freed_blocks`), which sit on the null block. On
        ``device`` (default the CPU; :func:`positions`)."""
        seq, pos = positions(lens, device=device)
        if self.freed_window_blocks:
            keep = freed_window.held_mask(self, seq, pos)
            seq, pos = seq[keep], pos[keep]
        return seq, pos

    def _shared_prefixes(self) -> list[list[int | None]]:
        """Per sequence, the first user (an earlier sequence) of each of its leading columns up to its last
        shared block: None for a freed column (it points at the null block and shares nothing) and, with freed
        window blocks, for a column this sequence still holds alone that an earlier user already freed (the
        prefix was shared, the earlier user's window moved past it: vLLM frees per request, so a later column
        stays shared; ``_check_shared`` compares the columns both still hold)."""
        owner: dict[int, int] = {}
        out = []
        for j in range(self.num_seqs):
            freed = self.freed_blocks(j)
            row = self.block_table[j][: self.blocks_needed(j)]
            shared: list[int | None] = [None] * min(freed, len(row))
            for blk in row[freed:]:
                shared.append(owner.get(blk))
            while shared and shared[-1] is None:
                shared.pop()
            out.append(shared)
            for blk in row[freed:]:
                owner.setdefault(blk, j)
        return out

    @property
    def shared_prefix_blocks(self) -> tuple[int, ...]:
        """Per sequence, how many leading blocks it shares with earlier sequences (0: none)."""
        return tuple(len(s) for s in self._shared_prefixes())

    def shared_prefix_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where shared prefix blocks make two sequences' positions one: ``(dst, src)`` int64 rows into the
        flat per-position tensors of :class:`~kvfuzz.contracts.model.data.BatchData` (``seq_start_loc`` order),
        each position of a later user's shared block paired with the same position of the block's first user;
        None when no block is shared. A first user never copies that block from anyone, so one indexed copy
        ``x[dst] = x[src]`` makes every user agree."""
        dst, src = [], []
        starts, bs = self.seq_start_loc, self.block_size
        for j, owners in enumerate(self._shared_prefixes()):
            for c, i in enumerate(owners):
                if i is None:  # a freed column
                    continue
                dst += range(starts[j] + c * bs, starts[j] + (c + 1) * bs)
                src += range(starts[i] + c * bs, starts[i] + (c + 1) * bs)
        if not dst:
            return None
        return torch.tensor(dst, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)

    # ---- tensors handed to kernels ------------------------------------------------------------------
    def block_table_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs, max_blocks_per_seq]``."""
        return table_tensor(self.block_table, torch.int32, device)

    def seq_lens_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs]``."""
        return host_tensor(self.seq_lens, torch.int32, device)

    def query_start_loc_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs + 1]``."""
        return host_tensor(self.query_start_loc, torch.int32, device)

    def slots(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Slots of positions ``pos`` of sequences ``seq`` (int64 tensors of one shape), vectorized.

        ``slot = block_table[seq, pos // block_size] * block_size + pos % block_size``
        (vllm/v1/worker/block_table.py, BlockTable.compute_slot_mapping). On the device of ``seq`` and ``pos``.
        """
        table = table_tensor(self.block_table, torch.int64, seq.device)
        return table[seq, pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: the slot of every query token, in query order (vLLM's ``slot_mapping``)."""
        seq, pos = positions(self.query_lens, offsets=self.ctx_lens)
        return self.slots(seq, pos)

    # ---- serialization ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields in their declared order, tuples as lists (what ``attrs.asdict`` gives, without its walk over
        every element: a serving batch's block table has thousands, and a campaign worker sends this dict to its
        supervisor before every example)."""
        d = {name: list(v) if isinstance(v := getattr(self, name), tuple) else v for name in _FIELD_NAMES}
        d["block_table"] = [list(r) for r in self.block_table]
        if self.value_head_size is None:  # absent unless latent: dicts of other batches stay as they were
            del d["value_head_size"]
        if not self.num_pad_seqs:  # absent unless padded, likewise
            del d["num_pad_seqs"]
        if not self.freed_window_blocks:  # absent unless set, likewise
            del d["freed_window_blocks"]
        if self.q_scale == 1.0:  # absent unless calibrated, likewise
            del d["q_scale"]
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
        extra = ""
        if self.kv_cache_dtype != "auto":
            extra += f" k_scale={self.k_scale:g} v_scale={self.v_scale:g}"
            if self.q_scale != 1.0:
                extra += f" q_scale={self.q_scale:g}"
        if self.sliding_window is not None:
            extra += f" sliding_window={self.sliding_window}"
        if self.alibi:
            extra += " alibi"
        if self.sinks:
            extra += " sinks"
        if self.softcap is not None:
            extra += f" softcap={self.softcap:g}"
        if self.value_range != "normal":
            extra += f" values={self.value_range}"
        if any(self.shared_prefix_blocks):
            extra += f" shared_prefix_blocks={list(self.shared_prefix_blocks)}"
        if self.csr_tail:
            extra += f" csr_tail={list(self.csr_tail)}"
        if self.value_head_size is not None:
            extra += f" latent Dv={self.value_head_size}"
        if self.num_pad_seqs:
            extra += f" cuda_graph_pads={self.num_pad_seqs}"
        if self.freed_window_blocks:
            extra += f" freed_window_blocks={[self.freed_blocks(i) for i in range(self.num_seqs)]}"
        return (
            f"{self.num_seqs} seqs [{kinds}] query_lens={list(self.query_lens)} ctx_lens={list(self.ctx_lens)} "
            f"H={self.num_heads} Hkv={self.num_kv_heads} D={self.head_size} block_size={self.block_size} "
            f"num_blocks={self.num_blocks} dtype={self.dtype} kv_cache_dtype={self.kv_cache_dtype}{extra}"
        )



def contiguous_batch(query_lens, ctx_lens, *, block_size: int, spare_blocks: int = 0, first_block: int = 0,
                     reverse: bool = False, pad_columns: int = 0, block_ids=None, pad_ids=None, **fields) -> Batch:
    """A :class:`Batch` whose block table hands each sequence, in order, its ``ceil(seq_len / block_size)``
    blocks: a fixed case for a test, a benchmark or a reproducer, without drawing one.

    ``query_lens``, ``ctx_lens``: per sequence (as the fields). The pool has ``num_blocks = first_block +
    blocks used + spare_blocks`` blocks; the used ones are handed out from ``block_ids`` (default ids
    ``first_block .. num_blocks - 1``, lowest first, highest first with ``reverse``; ids below ``first_block`` stay
    unused, e.g. vLLM's null block 0 that CUDA-graph pad rows point at), ``spare_blocks`` never referenced. Each
    row is as wide as the longest sequence's blocks plus ``pad_columns``; its unused columns hold 0, or the next
    ``pad_ids`` entries row by row (in range: unused columns are padding no kernel may read). ``fields``: every
    other :class:`Batch` field (``num_heads``, ``num_kv_heads``, ``head_size`` at least).
    Raises ValueError when ``block_ids`` or ``pad_ids`` run short, or as :class:`Batch` does."""
    query_lens, ctx_lens = list(query_lens), list(ctx_lens)
    need = [-(-(q + c) // block_size) for q, c in zip(query_lens, ctx_lens)]
    num_blocks = first_block + sum(need) + spare_blocks
    if block_ids is None:
        block_ids = range(first_block, num_blocks)[::-1] if reverse else range(first_block, num_blocks)
    ids, pads = list(block_ids), iter(() if pad_ids is None else pad_ids)
    if len(ids) < sum(need):
        raise ValueError(f"block_ids has {len(ids)} ids; the sequences use {sum(need)} blocks of {block_size}")
    width = max(need, default=0) + pad_columns
    table, j = [], 0
    for n in need:
        row_pads = [0 if pad_ids is None else next(pads, None) for _ in range(width - n)]
        if None in row_pads:
            raise ValueError(f"pad_ids ran short: the table has {width} columns and needs more pad ids")
        table.append(ids[j : j + n] + row_pads)
        j += n
    return Batch(query_lens=query_lens, ctx_lens=ctx_lens, block_size=block_size, num_blocks=num_blocks,
                 block_table=table, **fields)

#: Batch's attrs fields in their declared order (:meth:`Batch.to_dict`).
_FIELD_NAMES = tuple(a.name for a in attrs.fields(Batch))

# DTYPES, FEATURES, KV_CACHE_DTYPES, VALUE_RANGES and positions are defined in .space and re-exported here,
# where the batch's fields are described; NULL_BLOCK in .freed_window (the freed-window state's home)
__all__ = ["Batch", "DTYPES", "FEATURES", "KV_CACHE_DTYPES", "NULL_BLOCK", "VALUE_RANGES", "contiguous_batch",
           "positions"]
