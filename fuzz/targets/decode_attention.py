"""What SGLang's Triton split-KV decode kernel and vLLM's copy of it share: ``decode_attention_fwd``
(sglang/kernels/ops/attention/decode_attention.py, sglang 0.5.23; vllm/v1/attention/ops/triton_decode_attention.py,
vllm 0.33.0, "Adapted from" SGLang's sglang/srt/layers/attention/triton_ops/decode_attention.py).

Both choose the stage-1 kernel the same way (:func:`stage1`), and both grouped kernels map a program to its kv head
the same way, wrongly for some group sizes (:func:`split_heads`, docs/findings.md Finding 14; the findings baseline
scopes its entries with it). Their targets (:mod:`.vllm_triton`, :mod:`.sglang_triton`) declare alike what the
shared kernel code decides (:data:`DECODE_ATTENTION_FAMILY`). Imports neither kernel library.
"""

from __future__ import annotations

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.contract import Contract

#: ``_decode_grouped_att_m_fwd``'s ``BLOCK_H``: the query heads one program of ``_fwd_grouped_kernel_stage1`` covers.
BLOCK_H = 16

#: What both projects' ``decode_attention_fwd`` targets declare alike (the rest, page sizes, fp8, features and
#: CUDA-graph padding, differ between the two projects' callers): decode only, every position read from the cache,
#: head sizes padded to a power of 2 inside (``BLOCK_DMODEL``), both devices, prefix-shared blocks.
DECODE_ATTENTION_FAMILY = dict(
    contract=Contract.UNIFIED,
    devices=("cpu", "cuda"),
    dtypes=("float16", "float32"),  # per device: see VllmTritonTarget
    head_sizes=(32, 40, 64, 80, 128),
    decode_only=True,
    shared_prefix_blocks=True,  # vLLM's prefix caching and SGLang's radix cache share full pages
)


def stage1(batch: Batch) -> str:
    """The stage-1 kernel ``decode_attention_fwd`` runs for ``batch``: ``"normal"`` (``_fwd_kernel_stage1``) when
    every query head has its own kv head (``num_heads == num_kv_heads``), else ``"grouped"``
    (``_fwd_grouped_kernel_stage1``), as ``decode_attention_fwd`` picks by ``kv_group_num == 1``."""
    return "normal" if batch.gqa_ratio == 1 else "grouped"


def split_heads(batch: Batch) -> set[int]:
    """The query heads of ``batch`` that the grouped decode kernel (``_fwd_grouped_kernel_stage1``, :data:`BLOCK_H`
    16) reads from the wrong kv head: program ``p`` covers heads ``16p .. 16p + 15`` and reads kv head
    ``p // cdiv(group, 16)``; empty unless the group is past 16, not a multiple of 16, over two or more kv heads
    (docs/findings.md, Finding 14)."""
    group = batch.num_heads // batch.num_kv_heads
    if batch.num_kv_heads < 2 or group <= BLOCK_H or group % BLOCK_H == 0:
        return set()
    per = -(-group // BLOCK_H)
    return {h for h in range(batch.num_heads) if (h // BLOCK_H) // per != h // group}


__all__ = ["BLOCK_H", "DECODE_ATTENTION_FAMILY", "split_heads", "stage1"]
