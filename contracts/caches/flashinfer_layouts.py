"""FlashInfer's paged KV-cache layouts (flashinfer/decode.py ``BatchDecodeWithPagedKVCacheWrapper.run``,
flashinfer/prefill.py ``BatchPrefillWithPagedKVCacheWrapper.run``, flashinfer/page.py ``append_paged_kv_cache``;
unpacked by flashinfer/utils.py ``_unpack_paged_kv_cache``).

``paged_kv_cache`` is either

- one 5-D tensor: ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (``kv_layout="NHD"``) or
  ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (``"HND"``), keys at ``[:, 0]``, values at ``[:, 1]``
  (``_unpack_paged_kv_cache`` does ``unbind(dim=1)``); or
- a tuple ``(k_cache, v_cache)`` of 4-D tensors ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
  ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND).

Token ``p`` of a sequence whose pages are ``indices[indptr[i] : indptr[i + 1]]`` lives in page
``indices[indptr[i] + p // page_size]`` at offset ``p % page_size``: kvfuzz's slot ``page * page_size + offset``
with the block table's ids as page ids (:func:`kvfuzz.contracts.model.csr.page_lists`). A layout here allocates
the key and value caches as the 4-D views FlashInfer unpacks (``allocate`` returns ``(cache[:, 0], cache[:, 1])``
for the 5-D form), writes and gathers token rows ``[n, Hkv, D]`` by slot, and rebuilds the argument FlashInfer
takes from those views (:meth:`FlashInferLayout.paged_kv_cache`). Pure torch.
"""

from __future__ import annotations

import torch

from ..model.batch import Batch
from .layouts import LayoutError

#: FlashInfer's two kv_layout strings (flashinfer/utils.py ``_check_kv_layout``).
KV_LAYOUTS = ("NHD", "HND")


class FlashInferLayout:
    """One of FlashInfer's four cache forms: ``kv_layout`` "NHD" or "HND", ``combined`` (one 5-D tensor with
    keys and values at dimension 1) or separate ``(k_cache, v_cache)`` 4-D tensors. Storage dtype:
    ``batch.cache_dtype`` (the float8 dtype itself for fp8 caches: FlashInfer takes ``torch.float8_e4m3fn`` /
    ``torch.float8_e5m2`` caches, not uint8, which its run() reads as NVFP4)."""

    def __init__(self, kv_layout: str = "NHD", combined: bool = True) -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        self.kv_layout = kv_layout
        self.combined = bool(combined)
        self.name = f"flashinfer-{kv_layout.lower()}-{'5d' if combined else 'kv-tuple'}"

    def __repr__(self) -> str:
        return f"FlashInferLayout({self.kv_layout!r}, combined={self.combined})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlashInferLayout) and (other.kv_layout, other.combined) == (self.kv_layout,
                                                                                             self.combined)

    def __hash__(self) -> int:
        return hash((self.kv_layout, self.combined))

    # ---- shapes ---------------------------------------------------------------------------------------
    def page_shape(self, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        """The shape of one page of keys (or values): ``(page, Hkv, D)`` for NHD, ``(Hkv, page, D)`` for HND."""
        if self.kv_layout == "NHD":
            return (page_size, num_kv_heads, head_dim)
        return (num_kv_heads, page_size, head_dim)

    def dims(self, cache4d: torch.Tensor) -> tuple[int, int, int, int]:
        """``(num_pages, page_size, num_kv_heads, head_dim)`` of a 4-D key or value cache in this layout (as
        flashinfer/decode.py ``run`` reads ``page_size = k_cache.shape[1]`` for NHD, ``shape[2]`` for HND)."""
        if cache4d.dim() != 4:
            raise LayoutError(f"{self.name}: a 4-D key/value cache expected, got shape {tuple(cache4d.shape)}")
        p, a, b, d = (int(x) for x in cache4d.shape)
        return (p, a, b, d) if self.kv_layout == "NHD" else (p, b, a, d)

    # ---- CacheLayout ----------------------------------------------------------------------------------
    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        dt = batch.cache_dtype
        page = self.page_shape(batch.block_size, batch.num_kv_heads, batch.head_size)
        if self.combined:
            kv = torch.empty((batch.num_blocks, 2, *page), dtype=dt, device=device)
            return kv[:, 0], kv[:, 1]
        return (torch.empty((batch.num_blocks, *page), dtype=dt, device=device),
                torch.empty((batch.num_blocks, *page), dtype=dt, device=device))

    def _page_size(self, key_cache: torch.Tensor) -> int:
        return int(key_cache.shape[1] if self.kv_layout == "NHD" else key_cache.shape[2])

    def write(self, key_cache, value_cache, slots, key, value) -> None:
        bs = self._page_size(key_cache)
        blk, off = slots // bs, slots % bs
        if self.kv_layout == "NHD":
            key_cache[blk, off] = key.to(key_cache.dtype)
            value_cache[blk, off] = value.to(value_cache.dtype)
        else:  # [P, Hkv, page, D]: advanced indices around a slice put the row dimension first: [n, Hkv, D]
            key_cache[blk, :, off] = key.to(key_cache.dtype)
            value_cache[blk, :, off] = value.to(value_cache.dtype)

    def gather(self, key_cache, value_cache, slots):
        bs = self._page_size(key_cache)
        blk, off = slots // bs, slots % bs
        if self.kv_layout == "NHD":
            return key_cache[blk, off], value_cache[blk, off]
        return key_cache[blk, :, off], value_cache[blk, :, off]

    # ---- FlashInfer's argument ------------------------------------------------------------------------
    def paged_kv_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor):
        """What FlashInfer takes as ``paged_kv_cache`` for caches this layout allocated (possibly sliced along
        pages, e.g. inside guard blocks): the 5-D tensor whose ``[:, 0]`` and ``[:, 1]`` are ``key_cache`` and
        ``value_cache`` (rebuilt over their shared storage), or the tuple ``(key_cache, value_cache)``.
        Raises LayoutError if the two views are not keys and values of one 5-D allocation."""
        if not self.combined:
            return (key_cache, value_cache)
        k_off, v_off = key_cache.storage_offset(), value_cache.storage_offset()
        if (key_cache.untyped_storage().data_ptr() != value_cache.untyped_storage().data_ptr()
                or key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride()
                or v_off <= k_off or (key_cache.shape[0] > 1 and v_off - k_off >= key_cache.stride(0))):
            raise LayoutError(f"{self.name}: key_cache and value_cache are not [:, 0] and [:, 1] of one "
                              f"[pages, 2, ...] tensor")
        return torch.as_strided(key_cache, (key_cache.shape[0], 2, *key_cache.shape[1:]),
                                (key_cache.stride(0), v_off - k_off, *key_cache.stride()[1:]), k_off)


def unpack_paged_kv_cache(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache)`` 4-D of FlashInfer's ``paged_kv_cache`` argument, as flashinfer/utils.py
    ``_unpack_paged_kv_cache`` does (a tuple as is, a 5-D tensor ``unbind(dim=1)``). Raises ValueError for
    anything else (a 4-D single tensor, a tuple that is not two tensors)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2 or not all(isinstance(t, torch.Tensor) for t in paged_kv_cache):
            raise ValueError("paged_kv_cache as a tuple must be (k_cache, v_cache), two tensors")
        return paged_kv_cache[0], paged_kv_cache[1]
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"paged_kv_cache as one tensor must be [num_pages, 2, ...] 5-D, got "
                             f"{tuple(paged_kv_cache.shape)}")
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    raise ValueError(f"paged_kv_cache must be a tensor or a (k, v) tuple, got {type(paged_kv_cache).__name__}")


__all__ = ["KV_LAYOUTS", "FlashInferLayout", "unpack_paged_kv_cache"]
