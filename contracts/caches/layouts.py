"""Physical layouts of a paged KV cache, with vectorized writers and readers over slot indices.

A layout knows how to allocate a key and a value cache for a batch, how to write the k/v rows of a set of
tokens into given slots, and how to read rows back from slots (the invariant checkers read the cache through
it). All three work on whole index tensors at once; nothing loops over tokens in Python.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..model.batch import Batch


class LayoutError(ValueError):
    """A layout cannot hold this batch (dtype, head_size or kv_cache_dtype it does not support)."""


@runtime_checkable
class CacheLayout(Protocol):
    name: str

    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized ``(key_cache, value_cache)`` for ``batch.num_blocks`` blocks."""

    def write(self, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Store rows ``key[n]``/``value[n]`` (``[n, num_kv_heads, head_size]``) at ``slots[n]`` (int64)."""

    def gather(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[n, num_kv_heads, head_size]`` key and value rows stored at ``slots`` (int64)."""


def _cache_dtype(batch: Batch) -> torch.dtype:
    """``batch.dtype`` for kv_cache_dtype "auto", the fp8 dtype otherwise (vLLM allocates fp8 caches as uint8;
    targets pass ``cache.view(torch.uint8)`` where vLLM's backends do)."""
    return batch.cache_dtype


class VllmPagedLayout:
    """vLLM's split-contract layout (vllm/v1/attention/ops/chunked_prefill_paged_decode.py and
    prefix_prefill.py): key_cache ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` with
    ``x = 16 // element_size``, value_cache ``[num_blocks, num_kv_heads, head_size, block_size]``."""

    name = "vllm-paged-5d"

    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        dt = _cache_dtype(batch)
        x = 16 // torch.empty((), dtype=dt).element_size()
        if batch.head_size % x:
            raise LayoutError(f"head_size {batch.head_size} is not a multiple of x={x} for {dt}")
        nb, h, d, bs = batch.num_blocks, batch.num_kv_heads, batch.head_size, batch.block_size
        kc = torch.empty((nb, h, d // x, bs, x), dtype=dt, device=device)
        vc = torch.empty((nb, h, d, bs), dtype=dt, device=device)
        return kc, vc

    @staticmethod
    def _views(kc: torch.Tensor, vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Token-major views: kv[blk, off] -> [Hkv, D//x, x] and [Hkv, D].
        return kc.permute(0, 3, 1, 2, 4), vc.permute(0, 3, 1, 2)

    def write(self, key_cache, value_cache, slots, key, value) -> None:
        bs = value_cache.shape[3]
        kv, vv = self._views(key_cache, value_cache)
        blk, off = slots // bs, slots % bs
        kv[blk, off] = key.reshape(len(slots), *kv.shape[2:]).to(kv.dtype)
        vv[blk, off] = value.to(vv.dtype)

    def gather(self, key_cache, value_cache, slots):
        bs = value_cache.shape[3]
        kv, vv = self._views(key_cache, value_cache)
        blk, off = slots // bs, slots % bs
        k = kv[blk, off]
        return k.flatten(2), vv[blk, off]  # [n, Hkv, D//x, x] -> [n, Hkv, D]; n may be 0 (every position freed)


class NHDLayout:
    """The flash layout ``[num_blocks, block_size, num_kv_heads, head_size]`` for keys and for values
    (vllm/v1/attention/ops/triton_unified_attention.py; FlashAttention's ``k_cache``/``v_cache``)."""

    name = "nhd"

    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        dt = _cache_dtype(batch)
        shape = (batch.num_blocks, batch.block_size, batch.num_kv_heads, batch.head_size)
        return torch.empty(shape, dtype=dt, device=device), torch.empty(shape, dtype=dt, device=device)

    def write(self, key_cache, value_cache, slots, key, value) -> None:
        bs = key_cache.shape[1]
        key_cache[slots // bs, slots % bs] = key.to(key_cache.dtype)
        value_cache[slots // bs, slots % bs] = value.to(value_cache.dtype)

    def gather(self, key_cache, value_cache, slots):
        if key_cache.is_contiguous() and value_cache.is_contiguous():  # slot = block * block_size + offset
            return key_cache.flatten(0, 1)[slots], value_cache.flatten(0, 1)[slots]
        bs = key_cache.shape[1]
        return key_cache[slots // bs, slots % bs], value_cache[slots // bs, slots % bs]


class LatentLayout(NHDLayout):
    """MLA's latent cache (vllm/v1/attention/backends/mla/triton_mla.py, ``TritonMLAImpl.forward_mqa``): one
    buffer ``[num_blocks, block_size, 1, head_size]`` (``kv_c_and_k_pe_cache.unsqueeze(2)``: 512 + 64 = 576 for
    DeepSeek) is the key cache, and the value cache is a view of its first ``value_head_size`` dims
    (``kv_c_cache = kv_c_and_k_pe_cache[..., :kv_lora_rank]``), so a written key row is its value too. Reads and
    writes as :class:`NHDLayout` (writing the value into the view rewrites the same bytes: a latent batch's values
    are its keys' first dims). Raises LayoutError for a batch that is not latent
    (``Batch.value_head_size`` None)."""

    name = "latent"

    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        if batch.value_head_size is None:
            raise LayoutError("the latent layout holds latent batches only (Batch.value_head_size is None)")
        shape = (batch.num_blocks, batch.block_size, batch.num_kv_heads, batch.head_size)
        cache = torch.empty(shape, dtype=_cache_dtype(batch), device=device)
        return cache, cache[..., : batch.value_head_size]


__all__ = ["CacheLayout", "LatentLayout", "LayoutError", "NHDLayout", "VllmPagedLayout"]
