"""vLLM's MLA decode kernels over the latent cache: the TRITON_MLA backend's ``decode_attention_fwd`` (compiled
on CUDA, under Triton's interpreter on CPU: :mod:`kvfuzz.fuzz.targets.triton_runtime`).

How vLLM 0.33.0 calls it (vllm/v1/attention/backends/mla/triton_mla.py, ``TritonMLAImpl.forward_mqa``):

- ``q`` ``[B, H, 576]``: the query already in the latent space (``q_nope`` absorbed through ``W_UK``, 512,
  concatenated with ``q_pe``, 64: ``torch.cat(q, dim=-1)`` when the caller hands a tuple);
- ``k_buffer`` = ``kv_c_and_k_pe_cache.unsqueeze(2)``, ``[num_blocks, block_size, 1, 576]`` (``kv_c`` 512 then
  ``k_pe`` 64), and ``v_buffer`` = ``kv_c_cache = kv_c_and_k_pe_cache[..., :kv_lora_rank]``, a view of its
  first 512 dims; ``page_size`` = ``kv_c_and_k_pe_cache.size(1)``;
- ``o`` ``[B, H, 512]`` (``kv_lora_rank``), ``lse`` ``[B, H]``, ``attn_logits`` ``[B, H, num_kv_splits,
  512 + 1]`` fp32 from the shared workspace (reused across layers, uninitialised), ``num_kv_splits`` from
  ``_compute_num_kv_splits(max_seq_len, sm_count)``;
- ``sm_scale`` = ``self.scale``, the model's softmax scale (DeepSeek: ``1 / sqrt(qk_nope 128 + qk_rope 64)``
  = ``1 / sqrt(192)``, not ``1 / sqrt(576)``);
- ``block_table`` (``req_to_token``), ``seq_lens`` (``b_seq_len``), ``k_scale=layer._k_scale``,
  ``v_scale=layer._k_scale`` (one scale: one cached row), ``is_mla=True``.

In vllm/v1/attention/ops/triton_decode_attention.py (``decode_attention_fwd`` -> ``_decode_grouped_att_m_fwd``),
``is_mla`` with ``Lk == 576`` splits the key into ``BLOCK_DMODEL = 512`` and ``BLOCK_DPE = 64`` and takes the
value as the transposed key tile (``v = tl.trans(k)``): the value is read from ``k_buffer``'s first 512 dims,
never from ``v_buffer`` (whose last dim only sets ``Lv``). With one query head per kv head (``H == 1``)
``decode_attention_fwd`` takes the MHA kernel instead, which reads ``v_buffer`` (``is_mla`` is not passed to it).

The family's home: its kernel is ``decode_attention_fwd``, whose signature the vLLM Triton family declares
(:data:`kvfuzz.fuzz.targets.vllm_triton.DECODE_ATTENTION_FWD`; its builder reads the latent form, ``is_mla``
included): this module reuses it and declares no signature of its own (:data:`SIGNATURES` is empty; the guard's
table refuses a kernel name twice). Importing this module imports neither vllm nor triton.
"""

from __future__ import annotations

import torch

from kvfuzz.contracts.caches.layouts import CacheLayout, LatentLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData

from .base import KernelCall
from .triton_runtime import poisoned_scratch, scales
from .vllm_triton import DECODE_ATTENTION_FWD, VllmDecodeAttentionFwd

#: DeepSeek-V2/V3's latent cache: ``kv_lora_rank`` (the value and the output) and the rope dims after it.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
#: DeepSeek's softmax scale, ``1 / sqrt(qk_nope_head_dim 128 + qk_rope_head_dim 64)`` (what the backend passes).
DEEPSEEK_SM_SCALE = 1.0 / (128 + 64) ** 0.5

#: This family's own checked kernels: none; its target checks vllm_triton's DECODE_ATTENTION_FWD.
SIGNATURES = ()


class VllmTritonMlaDecode(VllmDecodeAttentionFwd):
    """vLLM's TRITON_MLA decode: ``decode_attention_fwd(..., is_mla=True)`` on the latent cache, called as
    vllm/v1/attention/backends/mla/triton_mla.py ``TritonMLAImpl.forward_mqa`` calls it (module docstring).

    Contract: unified, decode only (every sequence ``query_len == 1``; the backend's multi-token rows are
    flattened to decode rows), MQA over the latent cache: ``num_kv_heads == 1``, keys ``head_size`` 576 and values
    the first 512 dims of the same cached row (:attr:`~kvfuzz.contracts.model.batch.Batch.value_head_size`,
    :class:`~kvfuzz.contracts.caches.layouts.LatentLayout`); the fp64 reference takes the query in the latent
    space, as the kernel does. Output ``[num_seqs, num_heads, 512]``.

    Declaration, from the backend's code: dtypes fp16/bf16 (``supported_dtypes``; on CPU fp16/fp32, the
    interpreter computes bf16 wrongly); kv_cache_dtypes auto, fp8, fp8_e4m3 (``supported_kv_cache_dtypes``; fp8
    needs SM89+ on CUDA; dequantized with ``k_scale`` inside the kernel); block sizes multiples of 16
    (``supports_block_size``): 16, 32, 64; any head count (no check in the backend; DeepSeek-V3's 128 heads
    split by tensor parallelism): group sizes 1 to 128 in powers of two, 1 taking the MHA kernel; no alibi,
    sliding window or softcap (``TritonMLAImpl.__init__`` raises NotImplementedError), no sinks.

    ``sm_scale``: the batch's (:attr:`~kvfuzz.contracts.model.batch.Batch.scale`; DeepSeek's is
    :data:`DEEPSEEK_SM_SCALE`). num_kv_splits: 4 by default, as :class:`VllmDecodeAttentionFwd` (``None``:
    vLLM's ``_compute_num_kv_splits``, which gives 1 for every batch small enough to interpret).
    """

    name = "vllm.triton_mla_decode"
    checked_kernel = DECODE_ATTENTION_FWD
    #: docs/findings.md, Finding 3: group size 1 takes the MHA kernel, whose fp16 q.k sum "extreme" values overflow
    #: (NaN output); the gate draws the other ranges, `kvfuzz fuzz` all
    gate_value_ranges = ("normal", "large", "equal", "dominant")
    description = "vLLM TRITON_MLA decode over the 576/512 latent cache (decode only, MQA, unified contract)"
    capabilities = Capabilities(
        contract=Contract.UNIFIED,
        devices=("cpu", "cuda"),
        dtypes=("float16", "float32"),  # per device: see VllmTritonTarget
        head_sizes=(KV_LORA_RANK + QK_ROPE_HEAD_DIM,),
        value_head_size=KV_LORA_RANK,
        block_sizes=(16, 32, 64),
        decode_only=True,
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3"),
        gqa_ratios=(1, 2, 4, 8, 16, 32, 64, 128),
        shared_prefix_blocks=True,  # vLLM's prefix caching shares full blocks
    )

    def layout(self, batch: Batch) -> CacheLayout:
        return LatentLayout()

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        """``decode_attention_fwd`` kwargs as forward_mqa builds them: ``k_buffer`` the latent cache
        ``[NB, BS, 1, 576]``, ``v_buffer`` its first 512 dims (a view), ``o`` ``[N, H, 512]``, ``attn_logits``
        ``[N, H, splits, 513]`` (poisoned), ``v_scale`` = ``k_scale``, ``is_mla=True``. Raises ValueError for a
        prefill sequence or a batch that is not latent."""
        if batch.prefill_seqs:
            raise ValueError(f"{self.name} takes decode sequences only (query_len == 1); sequences "
                             f"{list(batch.prefill_seqs)} have query_len > 1")
        if batch.value_head_size is None:
            raise ValueError(f"{self.name} reads a latent cache: the batch needs value_head_size "
                             f"({KV_LORA_RANK}), got None")
        dev = cache.key_cache.device
        n, h, dv = batch.num_seqs, batch.num_heads, batch.head_size_v
        splits = self.num_kv_splits(batch)
        k_scale, _ = scales(batch, dev)
        kwargs = dict(
            q=data.query.to(dev), k_buffer=cache.key_cache, v_buffer=cache.value_cache,
            o=torch.zeros((n, h, dv), dtype=batch.torch_dtype, device=dev),
            lse=torch.zeros((n, h), dtype=batch.torch_dtype, device=dev), req_to_token=batch.block_table_tensor(dev),
            b_seq_len=batch.seq_lens_tensor(dev),
            attn_logits=poisoned_scratch((n, h, splits, dv + 1), cache, batch.seed + 3),
            num_kv_splits=splits, sm_scale=batch.scale, page_size=batch.block_size,
            k_scale=k_scale, v_scale=k_scale, is_mla=True,
        )
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, kwargs["o"])

    def path(self, batch: Batch) -> str:
        stage1 = "normal" if batch.gqa_ratio == 1 else "grouped,mla"
        return f"{stage1},splits={self.num_kv_splits(batch)}"


__all__ = ["DEEPSEEK_SM_SCALE", "KV_LORA_RANK", "QK_ROPE_HEAD_DIM", "SIGNATURES", "VllmTritonMlaDecode"]
